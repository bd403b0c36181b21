// Package mesh is the agent's record of which pods on this node are
// enrolled, and the events.Handler the plugin's requests reach: decisions
// from a Store of pods and namespaces through the enablement policy, the
// netns descriptors of enrolled pods kept for later unenrolment, and the
// policy snapshot the plugin falls back on.
package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Store is where pods and namespaces come from: an informer cache, or a
// static directory of manifests.
type Store interface {
	Pod(namespace, name string) *corev1.Pod
	Namespace(name string) *corev1.Namespace
	Pods() []*corev1.Pod
	Namespaces() []*corev1.Namespace
}

// Member is an enrolled pod attachment.
type Member struct {
	Pod  wire.Pod
	Mode wire.Mode
	// netns is our own dup of the descriptor the plugin sent.
	netns *os.File
}

// Mesh implements events.Handler.
type Mesh struct {
	policy *enablement.Policy
	store  Store
	runDir string
	log    *slog.Logger

	// LookupRetries and LookupDelay ride out informer lag for a pod the
	// scheduler bound a moment ago.
	LookupRetries int
	LookupDelay   time.Duration

	mu      sync.Mutex
	members map[wire.Attachment]*Member
}

var _ events.Handler = (*Mesh)(nil)

// New returns a Mesh; runDir is where the policy snapshot is kept ("" for
// none).
func New(policy *enablement.Policy, store Store, runDir string, log *slog.Logger) *Mesh {
	return &Mesh{policy: policy, store: store, runDir: runDir, log: log,
		LookupRetries: 10, LookupDelay: 10 * time.Millisecond, members: map[wire.Attachment]*Member{}}
}

// Decide looks the pod up and applies the enablement policy.
func (m *Mesh) Decide(ctx context.Context, p *wire.Pod) (*wire.Decision, error) {
	pod := m.store.Pod(p.Namespace, p.Name)
	for i := 0; pod == nil && i < m.LookupRetries; i++ {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(m.LookupDelay):
		}
		pod = m.store.Pod(p.Namespace, p.Name)
	}
	ns := m.store.Namespace(p.Namespace)
	if pod == nil || (p.UID != "" && string(pod.UID) != "" && string(pod.UID) != p.UID) {
		// Unknown (or an older pod of the same name): decide from the
		// namespace alone, failing closed where it enrols pods.
		if m.policy.NamespaceEnrols(ns) {
			return nil, fmt.Errorf("pod %s (uid %s) is not in the agent's cache yet and namespace %s enrols its pods; retry", p.Key(), p.UID, p.Namespace)
		}
		return &wire.Decision{Mode: wire.ModeNone, Reason: "pod not in the agent's cache; its namespace does not enrol pods"}, nil
	}
	return m.policy.Decide(pod, ns, p.IPs), nil
}

// Prepare has nothing to do before the rules until ztunnel is wired in.
func (m *Mesh) Prepare(ctx context.Context, p *wire.Pod, d *wire.Decision, netns *os.File) error {
	return nil
}

// Enrolled records a pod whose rules are in place, keeping a dup of its
// netns for unenrolment.
func (m *Mesh) Enrolled(ctx context.Context, p *wire.Pod, d *wire.Decision, netns *os.File, programErr error) error {
	if programErr != nil {
		m.forget(p.Attachment)
		return nil
	}
	fd, err := dupFile(netns)
	if err != nil {
		return fmt.Errorf("keeping the netns of pod %s: %w", p.Key(), err)
	}
	m.mu.Lock()
	old := m.members[p.Attachment]
	m.members[p.Attachment] = &Member{Pod: *p, Mode: d.Mode, netns: fd}
	m.mu.Unlock()
	if old != nil {
		old.netns.Close()
	}
	m.log.Info("pod enrolled", "pod", p.Key(), "mode", d.Mode, "containerID", p.ContainerID)
	return nil
}

// Deleted forgets the pod's attachment.
func (m *Mesh) Deleted(ctx context.Context, p *wire.Pod) error {
	if m.forget(p.Attachment) {
		m.log.Info("pod removed", "pod", p.Key(), "containerID", p.ContainerID)
	}
	return nil
}

// GC forgets every attachment the runtime no longer has.
func (m *Mesh) GC(ctx context.Context, valid []wire.Attachment) error {
	keep := make(map[wire.Attachment]bool, len(valid))
	for _, a := range valid {
		keep[a] = true
	}
	m.mu.Lock()
	var gone []wire.Attachment
	for a := range m.members {
		if !keep[a] {
			gone = append(gone, a)
		}
	}
	m.mu.Unlock()
	for _, a := range gone {
		m.forget(a)
	}
	if len(gone) > 0 {
		m.log.Info("GC released stale attachments", "count", len(gone))
	}
	return nil
}

// Ready is nil: the plugin can be served as soon as the server runs.
func (m *Mesh) Ready() error { return nil }

func (m *Mesh) forget(a wire.Attachment) bool {
	m.mu.Lock()
	old := m.members[a]
	delete(m.members, a)
	m.mu.Unlock()
	if old != nil {
		old.netns.Close()
	}
	return old != nil
}

// Members lists the enrolled attachments, sorted by pod.
func (m *Mesh) Members() []Member {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Member, 0, len(m.members))
	for _, mb := range m.members {
		out = append(out, Member{Pod: mb.Pod, Mode: mb.Mode})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pod.Key() < out[j].Pod.Key() })
	return out
}

// Close releases every descriptor held.
func (m *Mesh) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for a, mb := range m.members {
		mb.netns.Close()
		delete(m.members, a)
	}
}

// Policy computes the snapshot the plugin falls back on from the store.
func (m *Mesh) Policy() *wire.Policy {
	cfg := m.policy.Config()
	p := &wire.Policy{Generated: time.Now().UTC(), ExcludeNamespaces: cfg.ExcludeNamespaces,
		EnrolledNamespaces: []string{}, Pods: map[string]wire.Mode{}}
	nss := map[string]*corev1.Namespace{}
	for _, ns := range m.store.Namespaces() {
		nss[ns.Name] = ns
		if m.policy.NamespaceEnrols(ns) {
			p.EnrolledNamespaces = append(p.EnrolledNamespaces, ns.Name)
		}
	}
	sort.Strings(p.EnrolledNamespaces)
	for _, pod := range m.store.Pods() {
		p.Pods[pod.Namespace+"/"+pod.Name] = m.policy.Decide(pod, nss[pod.Namespace], nil).Mode
	}
	return p
}

// WritePolicy refreshes the snapshot in the run dir.
func (m *Mesh) WritePolicy() error {
	if m.runDir == "" {
		return errors.New("no run dir")
	}
	return events.WritePolicy(m.runDir, m.Policy())
}
