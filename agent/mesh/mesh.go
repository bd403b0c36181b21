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
	"net/netip"
	"os"
	"slices"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/zds"
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
	// UID is the pod's UID (from CNI_ARGS, else the store).
	UID string
	// decision is what the pod got, kept so a restarted agent can verify it.
	decision *wire.Decision
	// netns is our own dup of the descriptor the plugin sent.
	netns *os.File
	// pathVisible: Pod.Netns named this netns from the agent's mount
	// namespace when we got it, so a later mismatch means it is gone.
	pathVisible bool
}

// Ztunnel is where ambient pods' netns go (package zds).
type Ztunnel interface {
	Add(ctx context.Context, uid string, info zds.WorkloadInfo, netns *os.File) error
	Del(uid string)
	// Track remembers a pod for the next snapshot without sending it now.
	Track(uid string, info zds.WorkloadInfo, netns *os.File)
}

// Annotator records a pod's enrolment state on the pod itself
// (ambient.istio.io/redirection); state "" removes it.
type Annotator interface {
	SetRedirection(ctx context.Context, namespace, name, state string) error
}

// Options are the parts of the node a Mesh works with; nil ones are
// skipped (tests, the demo, hosts without ztunnel).
type Options struct {
	RunDir    string // where the policy snapshot is kept
	Ztunnel   Ztunnel
	Annotator Annotator
	// HostNetns is the host's netns, where the probe SNAT table lives.
	HostNetns *os.File
	// IPv6 adds the v6 probe set.
	IPv6 bool
	// Finder finds the netns of a running pod the agent never saw an ADD
	// for (package procscan); nil: such pods wait for their next sandbox.
	Finder interface {
		Find(uid string, ips []netip.Addr) (*os.File, error)
	}
	Log *slog.Logger
}

// Mesh implements events.Handler.
type Mesh struct {
	policy *enablement.Policy
	store  Store
	opts   Options
	log    *slog.Logger

	// LookupRetries and LookupDelay ride out informer lag for a pod the
	// scheduler bound a moment ago.
	LookupRetries int
	LookupDelay   time.Duration

	// hostMu orders host probe set changes with member changes.
	hostMu  sync.Mutex
	mu      sync.Mutex
	members map[wire.Attachment]*Member
}

var _ events.Handler = (*Mesh)(nil)

// New returns a Mesh.
func New(policy *enablement.Policy, store Store, opts Options) *Mesh {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	return &Mesh{policy: policy, store: store, opts: opts, log: opts.Log,
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

// SetStore switches the pod source (before serving), with the annotator
// that goes with it (nil: none).
func (m *Mesh) SetStore(s Store, a Annotator) {
	m.store = s
	if a != nil {
		m.opts.Annotator = a
	}
}

// uid is the pod's UID: the runtime's, else the store's.
func (m *Mesh) uid(p *wire.Pod) string {
	if p.UID != "" {
		return p.UID
	}
	if pod := m.store.Pod(p.Namespace, p.Name); pod != nil {
		return string(pod.UID)
	}
	return p.Key()
}

func (m *Mesh) workload(p *wire.Pod) zds.WorkloadInfo {
	info := zds.WorkloadInfo{Name: p.Name, Namespace: p.Namespace}
	if pod := m.store.Pod(p.Namespace, p.Name); pod != nil {
		info.ServiceAccount = pod.Spec.ServiceAccountName
	}
	return info
}

// Prepare hands an ambient pod's netns to ztunnel and waits for its ack,
// while the plugin programs the rules. No ztunnel, or a refusal: the ADD
// fails, the plugin removes the rules it made, and no container of the pod
// ever runs with traffic sent where nothing listens; the runtime retries.
func (m *Mesh) Prepare(ctx context.Context, p *wire.Pod, d *wire.Decision, netns *os.File) error {
	if d.Mode != wire.ModeAmbient || m.opts.Ztunnel == nil {
		return nil
	}
	return m.opts.Ztunnel.Add(ctx, m.uid(p), m.workload(p), netns)
}

// Added completes an enrolment once the rules are in place: the pod's
// IPs go into the host probe set and the pod is annotated enabled; only
// then is it a member. If the rules failed, ztunnel is told to let go. A
// pod outside the mesh is remembered too, with its netns, so that enrolling
// it later (a label added) needs no search for its netns.
func (m *Mesh) Added(ctx context.Context, p *wire.Pod, d *wire.Decision, netns *os.File, programErr error) error {
	uid := m.uid(p)
	if programErr != nil {
		if d.Mode == wire.ModeAmbient && m.opts.Ztunnel != nil {
			m.opts.Ztunnel.Del(uid)
		}
		m.forget(p.Attachment)
		return nil
	}
	fd, err := dupFile(netns)
	if err != nil {
		return fmt.Errorf("keeping the netns of pod %s: %w", p.Key(), err)
	}
	// The probe set and the members change together, so the host guard
	// never sees one without the other.
	m.hostMu.Lock()
	if d.Mode == wire.ModeAmbient {
		err = m.addProbe(uid, p.IPs)
	}
	var old *Member
	if err == nil {
		m.mu.Lock()
		old = m.members[p.Attachment]
		mb := &Member{Pod: *p, Mode: d.Mode, UID: uid, decision: d, netns: fd,
			pathVisible: p.Netns != "" && sameFile(p.Netns, fd)}
		m.members[p.Attachment] = mb
		m.saveMember(mb)
		m.mu.Unlock()
	}
	m.hostMu.Unlock()
	if err != nil {
		fd.Close()
		return err
	}
	if old != nil {
		old.netns.Close()
	}
	if d.Mode == wire.ModeAmbient && m.opts.Annotator != nil {
		// A failure here fails the ADD; the runtime's DEL then undoes the rest.
		if err := m.opts.Annotator.SetRedirection(ctx, p.Namespace, p.Name, RedirectionEnabled); err != nil {
			return fmt.Errorf("annotating pod %s %s=%s: %w", p.Key(), enablement.AnnRedirection, RedirectionEnabled, err)
		}
	}
	if d.Mode != wire.ModeNone {
		m.log.Info("pod enrolled", "pod", p.Key(), "mode", d.Mode, "uid", uid, "containerID", p.ContainerID)
	}
	return nil
}

// RedirectionEnabled is the annotation value of an enrolled pod. Istio's
// "pending" (rules without ztunnel) cannot arise here: a pod is annotated
// only once ztunnel has acked it.
const RedirectionEnabled = "enabled"

// Deleted is the pod's DEL: ztunnel lets go, the probe set forgets its IPs,
// and the kept netns is closed. The pod's own rules went with DEL already.
// A pod whose sandbox was re-created keeps its UID: while another sandbox
// of the same pod is enrolled, ztunnel keeps the pod and only the old
// sandbox's own IPs leave the probe set.
func (m *Mesh) Deleted(ctx context.Context, p *wire.Pod) error {
	m.mu.Lock()
	mb := m.members[p.Attachment]
	uid := m.uid(p)
	if mb != nil {
		uid = mb.UID
	}
	var live []netip.Prefix // IPs of other enrolled sandboxes of this pod
	sibling := false
	for a, o := range m.members {
		if a != p.Attachment && o.UID == uid && o.Mode == wire.ModeAmbient {
			sibling = true
			live = append(live, o.Pod.IPs...)
		}
	}
	m.mu.Unlock()
	if m.opts.Ztunnel != nil && !sibling && (mb == nil || mb.Mode == wire.ModeAmbient) {
		m.opts.Ztunnel.Del(uid) // also for a pod we never finished: ztunnel may hold it
	}
	m.hostMu.Lock()
	if mb != nil && mb.Mode == wire.ModeAmbient {
		var gone []netip.Prefix
		for _, ip := range mb.Pod.IPs {
			if !slices.Contains(live, ip) {
				gone = append(gone, ip)
			}
		}
		if err := m.removeProbe(uid, gone); err != nil {
			m.log.Warn("could not remove a deleted pod's IPs from the host probe set; the guard will", "pod", p.Key(), "err", err)
		}
	}
	forgot := m.forget(p.Attachment)
	m.hostMu.Unlock()
	if forgot && mb.Mode != wire.ModeNone {
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

// ZDSState says what ztunnel has of a pod, when the ZDS side can tell.
func (m *Mesh) ZDSState(uid string) string {
	if z, ok := m.opts.Ztunnel.(interface{ State(string) string }); ok {
		return z.State(uid)
	}
	return "no ztunnel configured (--ztunnel-socket none)"
}

func (m *Mesh) forget(a wire.Attachment) bool {
	m.mu.Lock()
	old := m.members[a]
	delete(m.members, a)
	if old != nil {
		m.dropMember(a)
	}
	m.mu.Unlock()
	if old != nil {
		old.netns.Close()
	}
	return old != nil
}

// Members lists the enrolled attachments (ambient or sidecar), sorted by pod.
func (m *Mesh) Members() []Member {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Member, 0, len(m.members))
	for _, mb := range m.members {
		if mb.Mode != wire.ModeNone {
			out = append(out, Member{Pod: mb.Pod, Mode: mb.Mode, UID: mb.UID})
		}
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
	if m.opts.RunDir == "" {
		return errors.New("no run dir")
	}
	return events.WritePolicy(m.opts.RunDir, m.Policy())
}
