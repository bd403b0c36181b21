// Package enrol is the agent's one enrolment state machine: every way a
// pod enters or leaves the mesh — the plugin's ADD, late enrolment and
// unenrolment, restart repair, adoption of pods found through /proc, DEL,
// GC, pods deleted or gone from the pod source, drift found by the
// verifier — is an event for Enroller.step, which looks the pod's state and
// the event up in one table (state.go) and acts: Enroller.enrol or
// Enroller.release, each in one order written once, or a reprogram, a
// repair, an owed annotation.
//
// enrol: the decision is made first; then the rules, ztunnel's hold on
// the netns, the host probe set entry and the pod's record are put in
// place, concurrently where they can be; then the pod is annotated. Any
// failure undoes what was done, and the pod is left as it was. Who puts
// the rules in place depends on the moment: the plugin at ADD (it writes
// the batch the agent encoded into the pod's netns), the agent itself
// everywhere else, with the same batch and the same nft code.
//
// release: the pod's rules and policy routes go whenever its netns still
// exists, then ztunnel's hold (a ZDS Del, sent only with the pod's real
// UID), the probe set entry, the annotation and, when the pod is gone, the
// record and the netns descriptor.
//
// The Enroller holds one descriptor of each pod's netns; ztunnel's side
// borrows it. Transitions of one pod are serialised by that pod's lock.
package enrol

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/faults"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
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

// Ztunnel is where ambient pods' netns go (package zds). The netns it is
// given is borrowed: the Enroller closes it only after Del.
type Ztunnel interface {
	// StartAdd sends the pod to ztunnel and returns the wait for its ack,
	// which must be called once (zds.Server.StartAdd).
	StartAdd(ctx context.Context, uid string, info zds.WorkloadInfo, netns *os.File) (wait func() error)
	// Track remembers a pod for the next snapshot without sending it now.
	Track(uid string, info zds.WorkloadInfo, netns *os.File)
	// Del tells ztunnel to drop the pod, within ctx's deadline.
	Del(ctx context.Context, uid string)
	Holds(uid string) bool
	State(uid string) string
	// Accepting says whether a ztunnel is connected, or receiving its
	// snapshot (StartAdd waits for that one).
	Accepting() bool
}

// Probes is the host probe set (package hostprobe).
type Probes interface {
	Add(uid string, ips []netip.Addr) error
	Remove(uid string, ips []netip.Addr) error
}

// Records is where the agent records the pods it knows (package records).
type Records interface {
	Save(*records.Record) error
	Drop(wire.Attachment) error
	Load() ([]records.Record, []error, error)
	// Marks are the DELs and GCs the plugin carried out while no agent
	// ran; ClearMarks removes them once acted on.
	Marks() (*records.Marks, error)
	ClearMarks(*records.Marks) error
}

// Annotator records a pod's enrolment state on the pod itself
// (ambient.istio.io/redirection); state "" removes it.
type Annotator interface {
	SetRedirection(ctx context.Context, namespace, name, state string) error
}

// Finder finds the netns of a running pod the agent never saw an ADD for
// (package procscan).
type Finder interface {
	Find(uid string, ips []netip.Addr) (*os.File, error)
}

// Options are the parts of the node an Enroller works with; nil ones are
// skipped (tests, the demo, hosts without ztunnel or Kubernetes).
type Options struct {
	Policy    *enablement.Policy
	Store     Store
	Rules     nft.Interface // nil: the kernel (nft.NewKernel)
	Ztunnel   Ztunnel
	Probes    Probes
	Records   Records
	Annotator Annotator
	Finder    Finder
	Metrics   *Metrics
	Log       *slog.Logger
	// LookupRetries bounds how often Decide looks again, 10 ms apart, for
	// a pod the store does not have yet (informer lag for a pod the
	// scheduler bound a moment ago); 0: 10.
	LookupRetries int
	// AdoptConcurrency is how many pods AdoptAnnotated takes over at once;
	// 0: DefaultAdoptConcurrency.
	AdoptConcurrency int
}

// Enroller implements events.Handler.
type Enroller struct {
	opts    Options
	policy  *enablement.Policy
	store   Store
	rules   nft.Interface
	log     *slog.Logger
	metrics *Metrics
	batches batchCache

	lookupRetries int
	lookupDelay   time.Duration
	// started is when this agent began: a pod that started after it and
	// is found without an ADD started outside our chain.
	started time.Time

	mu   sync.Mutex
	pods map[wire.Attachment]*pod
}

var _ events.Handler = (*Enroller)(nil)

// New returns an Enroller.
func New(opts Options) *Enroller {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Rules == nil {
		opts.Rules = nft.NewKernel(capture.PodCleanup())
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	if opts.AdoptConcurrency <= 0 {
		opts.AdoptConcurrency = DefaultAdoptConcurrency
	}
	if opts.LookupRetries == 0 {
		opts.LookupRetries = 10
	}
	return &Enroller{opts: opts, policy: opts.Policy, store: opts.Store, rules: opts.Rules, log: opts.Log,
		metrics: opts.Metrics, lookupRetries: opts.LookupRetries, lookupDelay: 10 * time.Millisecond, pods: map[wire.Attachment]*pod{},
		started: time.Now()}
}

// pod is one sandbox attachment the agent knows: enrolled, or known (its
// netns kept for a later enrolment).
type pod struct {
	mu sync.Mutex // held for a whole transition
	// id is the attachment as the runtime named it; id.UID is the pod's
	// Kubernetes UID, the runtime's or else the store's ("" when neither
	// gave one: such a pod is never handed to ztunnel).
	id wire.Pod
	d  *enablement.Decision // never nil; ModeNone: known, not enrolled
	// netns is the one descriptor of the pod's netns the agent holds; nil
	// for a record whose sandbox is gone.
	netns        *os.File
	nsDev, nsIno uint64
	pathVisible  bool  // id.Netns named netns from here when it was opened
	state        state // changed by Enroller.step alone
	verify       verifyState
}

// enrolled says whether p is captured: its decision is in force.
func (p *pod) enrolled() bool { return p.state == enrolled || p.state == unannotated }

func (p *pod) fd() int { return int(p.netns.Fd()) }

func none(reason string) *enablement.Decision {
	return &enablement.Decision{Mode: wire.ModeNone, Reason: reason}
}

func (e *Enroller) workload(p *pod) zds.WorkloadInfo {
	return workloadInfo(p.id.Namespace, p.id.Name, e.store.Pod(p.id.Namespace, p.id.Name))
}

// workloadInfo is what ztunnel is told of a pod: its name, namespace and
// service account (Kubernetes' "default" when the pod, or its spec, is
// not known).
func workloadInfo(namespace, name string, kp *corev1.Pod) zds.WorkloadInfo {
	info := zds.WorkloadInfo{Name: name, Namespace: namespace, ServiceAccount: "default"}
	if kp != nil && kp.Spec.ServiceAccountName != "" {
		info.ServiceAccount = kp.Spec.ServiceAccountName
	}
	return info
}

func (e *Enroller) record(p *pod, d *enablement.Decision) *records.Record {
	return &records.Record{Pod: p.id, UID: p.id.UID, Decision: d, NetnsDev: p.nsDev, NetnsIno: p.nsIno}
}

// how says how an enrolment comes about at the moment it happens.
type how struct {
	// rules puts the ruleset in place: the plugin's outcome at ADD, the
	// agent's own Program elsewhere, a deferred check at restart. At ADD
	// the outcome is read once ready has been called; elsewhere it runs
	// once ztunnel has acked (nothing is redirected to ports no one
	// listens on), beside the probe set entry and the record.
	rules func(context.Context) error
	// start, if set, runs before every other step, ztunnel's Add
	// included: at ADD it sends the plugin its decision, so that the
	// plugin's critical path does not wait behind the agent's own work,
	// or a ztunnel woken first, for a CPU.
	start func(context.Context) error
	// ready, if set, is told once ztunnel, the probe set and the record
	// are done (nil) or one of them failed, before rules runs. At ADD the
	// plugin programs the rules in its own process, reads this answer and
	// reports the rules with its outcome, its last message: told without
	// waiting for the outcome, the plugin exits without waiting for the
	// agent to wake up for it.
	ready func(error)
	// restored: the pod was enrolled before this agent started. ztunnel
	// gets it in its first snapshot (it is not connected yet), the record
	// is already there, and an undo must not remove rules the previous
	// agent put in place.
	restored bool
	// recorded: the pod's record already says this decision.
	recorded bool
	// keepRules: the netns was captured before this enrolment (our rules
	// intact, or istio-cni's taken over): an undo leaves the rules, since
	// removing them would let the pod's traffic out.
	keepRules bool
}

// enrol brings p into the mesh as d says (step's doEnrol). Called with
// p.mu held.
func (e *Enroller) enrol(ctx context.Context, p *pod, d *enablement.Decision, h how) error {
	ambient := d.Mode == wire.ModeAmbient
	if ambient && p.id.UID == "" {
		return fmt.Errorf("pod %s has no UID (neither K8S_POD_UID from the runtime nor metadata.uid in its manifest): ztunnel names workloads by UID, so it cannot be enrolled in ambient", p.id.Key())
	}
	if h.start != nil {
		if err := h.start(ctx); err != nil {
			if !h.restored && p.netns != nil {
				_ = e.rules.Remove(p.fd()) // the plugin may have begun
			}
			return fmt.Errorf("enrolling pod %s (%s): %w", p.id.Key(), d.Mode, err)
		}
	}
	var pr progress
	ztAck := func() {} // waits for ztunnel's ack; each path calls it once
	if ambient {
		ztAck = e.ztunnelAdd(ctx, p, h.restored, &pr)
	}
	own := func() { e.own(p, d, h.recorded, &pr) }
	var rulesErr error
	if h.ready != nil {
		// The plugin is programming the rules in its own process, woken
		// by the decision, and ztunnel is opening its listeners: the probe
		// set entry and the record are made meanwhile. ztunnel's ack is
		// the longer branch: two wake-ups of other processes and its
		// listeners, against the plugin's one batch.
		own()
		ztAck()
		faults.Point(faults.Acked)
		h.ready(pr.err())
		rulesErr = h.rules(ctx)
		faults.Point(faults.Outcome)
	} else {
		// A running pod (late enrolment, adoption, restart): ztunnel
		// listens in its netns before its traffic is redirected there, so
		// no connection is refused in between.
		var wg sync.WaitGroup
		wg.Go(own)
		if ztAck(); pr.ztErr == nil {
			rulesErr = h.rules(ctx)
		}
		wg.Wait()
	}
	if err := errors.Join(rulesErr, pr.err()); err != nil {
		e.undo(ctx, p, h, &pr)
		return fmt.Errorf("enrolling pod %s (%s): %w", p.id.Key(), d.Mode, err)
	}
	p.d = d
	p.verify = verifyState{pending: true}
	if ambient {
		if err := e.annotate(ctx, p, RedirectionEnabled); err != nil {
			// The annotation reports the capture to istiod; it does not
			// make it. A captured pod stays captured, and the annotation
			// is retried (its next reconcile, the next verification
			// pass) rather than undo a working enrolment, which at ADD
			// the plugin has reported to the runtime already.
			e.log.Warn("could not annotate an enrolled pod; retried", "pod", p.id.Key(), "err", err)
			return errAnnotationOwed
		}
	}
	return nil
}

// progress is what an enrolment has put in place so far, for its undo.
type progress struct {
	zt, probe, rec          bool
	ztErr, probeErr, recErr error
}

func (pr *progress) err() error { return errors.Join(pr.ztErr, pr.probeErr, pr.recErr) }

// ztunnelAdd hands p to ztunnel and returns the wait for its ack. A
// restored pod goes in ztunnel's first snapshot instead (it is not
// connected yet). The plugin, woken by its decision, programs the rules
// while ztunnel opens its listeners in the pod's netns: the AddWorkload
// goes out right after the decision (woken first, ztunnel would take this
// CPU before the decision is out), and its ack is waited for last.
func (e *Enroller) ztunnelAdd(ctx context.Context, p *pod, restored bool, pr *progress) (ack func()) {
	zt := e.opts.Ztunnel
	switch {
	case zt == nil:
		return func() {}
	case restored:
		zt.Track(p.id.UID, e.workload(p), p.netns)
		pr.zt = true
		return func() {}
	}
	wait := zt.StartAdd(ctx, p.id.UID, e.workload(p), p.netns)
	return func() {
		if pr.ztErr = wait(); pr.ztErr == nil {
			pr.zt = true
		}
	}
}

// own makes the agent's own part of an enrolment: the probe set entry,
// then the record.
func (e *Enroller) own(p *pod, d *enablement.Decision, recorded bool, pr *progress) {
	if probes := e.opts.Probes; d.Mode == wire.ModeAmbient && probes != nil {
		if pr.probeErr = probes.Add(p.id.UID, addrs(p.id.IPs)); pr.probeErr != nil {
			return
		}
		pr.probe = true
	}
	if recs := e.opts.Records; recs != nil && !recorded {
		if pr.recErr = recs.Save(e.record(p, d)); pr.recErr == nil {
			pr.rec = true
			faults.Point(faults.Recorded)
		}
	}
}

// undo takes back what a failed enrolment put in place, newest first; the
// pod is left as it was.
func (e *Enroller) undo(ctx context.Context, p *pod, h how, pr *progress) {
	if pr.rec {
		e.saveRecord(p, p.d)
	}
	if pr.probe {
		e.removeProbe(p, "undo")
	}
	if pr.zt && !h.restored {
		// ztunnel acked the Add: the undo's Del is owed whatever is left
		// of the plugin's time.
		e.ztunnelRelease(context.WithoutCancel(ctx), p)
	}
	if !h.restored && !h.keepRules && p.netns != nil {
		if err := e.rules.Remove(p.fd()); err != nil {
			e.log.Warn("could not remove the rules of a failed enrolment", "pod", p.id.Key(), "err", err)
		}
	}
}

// RedirectionEnabled is the annotation value of an enrolled pod. Istio's
// "pending" (rules without ztunnel) cannot arise here: a pod is annotated
// only once ztunnel has acked it.
const RedirectionEnabled = "enabled"

// annotate sets or clears the redirection annotation when the store does
// not already show that state.
func (e *Enroller) annotate(ctx context.Context, p *pod, state string) error {
	if e.opts.Annotator == nil {
		return nil
	}
	kp := e.store.Pod(p.id.Namespace, p.id.Name)
	if kp == nil {
		return nil // gone: nothing to annotate
	}
	if have, ok := kp.Annotations[istio.AnnRedirection]; (state == "" && !ok) || (state != "" && ok && have == state) {
		return nil
	}
	if err := e.opts.Annotator.SetRedirection(ctx, p.id.Namespace, p.id.Name, state); err != nil {
		return fmt.Errorf("annotating pod %s %s=%q: %w", p.id.Key(), istio.AnnRedirection, state, err)
	}
	return nil
}

// releaseHow says what a release keeps.
type releaseHow struct {
	why string
	// rulesGone: the caller removed the rules already (the plugin's DEL).
	rulesGone bool
	// forget: the pod is gone; drop its record and its netns descriptor.
	forget bool
	// keepAnnotation: leave the pod's annotation (DEL: the sandbox goes,
	// the pod may get a new one).
	keepAnnotation bool
}

// release takes p out of the mesh (step's doRelease and doForget).
// Called with p.mu held. An error means
// the pod's rules could not be removed from a netns that still exists; the
// pod then stays enrolled, so the caller retries.
func (e *Enroller) release(ctx context.Context, p *pod, r releaseHow) error {
	wasEnrolled, ambient := p.enrolled(), p.d.Mode == wire.ModeAmbient
	if wasEnrolled && !r.rulesGone && e.netnsAlive(p) {
		if err := e.rules.Remove(p.fd()); err != nil {
			if !r.forget {
				return fmt.Errorf("releasing pod %s: removing its rules: %w", p.id.Key(), err)
			}
			e.log.Warn("could not remove a released pod's rules", "pod", p.id.Key(), "err", err)
		}
	}
	if ambient {
		e.ztunnelRelease(ctx, p)
		e.removeProbe(p, r.why)
	}
	if wasEnrolled && !r.keepAnnotation {
		if err := e.annotate(ctx, p, ""); err != nil {
			e.log.Warn("could not remove the enrolment annotation", "pod", p.id.Key(), "err", err)
		}
	}
	if wasEnrolled {
		e.log.Info("pod released", "pod", p.id.Key(), "mode", p.d.Mode, "uid", p.id.UID, "containerID", p.id.ContainerID, "why", r.why)
	}
	p.d = none(r.why)
	if !r.forget {
		e.saveRecord(p, p.d)
		return nil
	}
	if e.opts.Records != nil {
		if err := e.opts.Records.Drop(p.id.Attachment); err != nil {
			e.log.Warn("could not remove a pod's record", "pod", p.id.Key(), "err", err)
		}
	}
	e.drop(p)
	return nil
}

// ztunnelRelease lets ztunnel go of p, unless another enrolled sandbox of
// the same pod (a re-created one) still needs it: then ztunnel keeps the
// pod, pointed at that sandbox's netns.
func (e *Enroller) ztunnelRelease(ctx context.Context, p *pod) {
	zt := e.opts.Ztunnel
	if zt == nil || p.id.UID == "" {
		return
	}
	if s := e.sibling(p); s != nil {
		zt.Track(p.id.UID, e.workload(s), s.netns)
		return
	}
	zt.Del(ctx, p.id.UID)
}

// removeProbe takes p's IPs out of the probe set, except those another
// enrolled sandbox of the same pod holds.
func (e *Enroller) removeProbe(p *pod, why string) {
	if e.opts.Probes == nil || p.id.UID == "" {
		return
	}
	keep := map[netip.Addr]bool{}
	if s := e.sibling(p); s != nil {
		for _, ip := range addrs(s.id.IPs) {
			keep[ip] = true
		}
	}
	var freed []netip.Addr
	for _, ip := range addrs(p.id.IPs) {
		if !keep[ip] {
			freed = append(freed, ip)
		}
	}
	if err := e.opts.Probes.Remove(p.id.UID, freed); err != nil {
		e.log.Warn("could not remove a pod's IPs from the host probe set; the host guard will", "pod", p.id.Key(), "why", why, "err", err)
	}
}

// sibling is another enrolled ambient attachment with p's UID.
func (e *Enroller) sibling(p *pod) *pod {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, o := range e.pods {
		if o != p && o.id.UID == p.id.UID && o.state != gone && o.netns != nil && o.d.Mode == wire.ModeAmbient {
			return o
		}
	}
	return nil
}

func (e *Enroller) saveRecord(p *pod, d *enablement.Decision) {
	if e.opts.Records == nil {
		return
	}
	if err := e.opts.Records.Save(e.record(p, d)); err != nil {
		e.log.Error("could not record a pod; a restarted agent would not find it", "pod", p.id.Key(), "err", err)
	}
}

// netnsAlive says whether p's netns is still its sandbox's: the path the
// runtime gave still names the descriptor held. A path the agent cannot
// see from its mount namespace tells nothing: the netns is taken as alive.
func (e *Enroller) netnsAlive(p *pod) bool {
	if p.netns == nil {
		return false
	}
	return !p.pathVisible || sameFile(p.id.Netns, p.netns)
}

// addrs are the addresses of a pod's CIDRs (package wire carries them as
// text). Those that do not parse were dropped when the pod arrived
// (canonical); records from disk are skipped over the same way.
func addrs(cidrs []string) []netip.Addr {
	out := make([]netip.Addr, 0, len(cidrs))
	for _, s := range cidrs {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Addr())
		}
	}
	return out
}

// canonical is a pod's CIDRs from its plugin as the agent keeps them: an
// IPv4-mapped IPv6 address as the IPv4 one, and no entry that does not
// parse (the plugin sends what the primary's result says, unchecked).
func canonical(cidrs []string) []string {
	out := make([]string, 0, len(cidrs))
	for _, s := range cidrs {
		p, err := netip.ParsePrefix(s)
		switch {
		case err != nil:
		case p.Addr().Is4In6():
			out = append(out, netip.PrefixFrom(p.Addr().Unmap(), max(p.Bits()-96, 0)).String())
		default:
			out = append(out, p.String())
		}
	}
	return out
}

// Member is an enrolled pod attachment, for tests and operators.
type Member struct {
	Pod  wire.Pod
	Mode wire.Mode
	UID  string
}

// Members lists the enrolled attachments (ambient or sidecar), sorted by pod.
func (e *Enroller) Members() []Member {
	var out []Member
	for _, p := range e.snapshot() {
		p.mu.Lock()
		if p.enrolled() {
			out = append(out, Member{Pod: p.id, Mode: p.d.Mode, UID: p.id.UID})
		}
		p.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pod.Key() < out[j].Pod.Key() })
	return out
}

// ProbeMembers is what the host probe set must hold: every enrolled
// ambient pod's IPs by UID.
func (e *Enroller) ProbeMembers() []nft.Member {
	byUID := map[string][]netip.Addr{}
	for _, m := range e.Members() {
		if m.Mode == wire.ModeAmbient && m.UID != "" {
			byUID[m.UID] = append(byUID[m.UID], addrs(m.Pod.IPs)...)
		}
	}
	out := make([]nft.Member, 0, len(byUID))
	for uid, ips := range byUID {
		out = append(out, nft.Member{UID: uid, IPs: ips})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	return out
}

// snapshot lists the pods tracked now.
func (e *Enroller) snapshot() []*pod {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*pod, 0, len(e.pods))
	for _, p := range e.pods {
		out = append(out, p)
	}
	return out
}

// Close releases every descriptor held (the agent stopping: in-pod rules
// and ztunnel's snapshot stay as they are for the next agent).
func (e *Enroller) Close() {
	for _, p := range e.snapshot() {
		p.mu.Lock()
		_ = e.step(context.Background(), p, change{ev: evStop})
		p.mu.Unlock()
	}
	e.mu.Lock()
	e.pods = map[wire.Attachment]*pod{}
	e.mu.Unlock()
}
