package enrol

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// This file keeps running pods in line with the policy when the store
// changes: late enrolment and unenrolment, done by the agent itself with
// the netns it kept from the pod's ADD (or found through /proc), and the
// release of pods that finished, were deleted or left the pod source.

// Reconcile brings one pod in line with the policy after it, its labels,
// its namespace's labels or its phase changed, or it disappeared.
func (e *Enroller) Reconcile(ctx context.Context, namespace, name string) error {
	kp := e.store.Pod(namespace, name)
	key := namespace + "/" + name
	var atts []*pod
	for _, p := range e.snapshot() {
		if p.id.Key() == key {
			atts = append(atts, p)
		}
	}
	var errs []error
	for _, p := range atts {
		errs = append(errs, e.reconcilePod(ctx, p, kp))
	}
	if len(atts) == 0 && kp != nil && !finished(kp) {
		errs = append(errs, e.adoptIfEnrolled(ctx, kp))
	}
	return errors.Join(errs...)
}

// ReconcileAll reconciles every pod of the store and every pod the agent
// tracks that the store no longer has (a static source's file removed).
func (e *Enroller) ReconcileAll(ctx context.Context) error {
	seen := map[string]bool{}
	var errs []error
	for _, kp := range e.store.Pods() {
		key := kp.Namespace + "/" + kp.Name
		seen[key] = true
		errs = append(errs, e.Reconcile(ctx, kp.Namespace, kp.Name))
	}
	for _, p := range e.snapshot() {
		if key := p.id.Key(); !seen[key] {
			seen[key] = true
			errs = append(errs, e.Reconcile(ctx, p.id.Namespace, p.id.Name))
		}
	}
	return errors.Join(errs...)
}

func finished(kp *corev1.Pod) bool {
	return kp.Status.Phase == corev1.PodSucceeded || kp.Status.Phase == corev1.PodFailed
}

// reconcilePod applies the store's view of the pod to one attachment.
func (e *Enroller) reconcilePod(ctx context.Context, p *pod, kp *corev1.Pod) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.state == gone:
		return nil
	case kp == nil || (string(kp.UID) != "" && p.id.UID != "" && string(kp.UID) != p.id.UID):
		// Deleted, or replaced by a newer pod of the same name: its
		// sandbox will not be enrolled again.
		return e.step(ctx, p, change{ev: evPodGone, why: "the pod is gone from the pod source"})
	case finished(kp):
		return e.step(ctx, p, change{ev: evFinished, why: "the pod finished (" + string(kp.Status.Phase) + ")"})
	case p.netns == nil:
		return nil
	}
	d := e.policy.Decide(kp, e.store.Namespace(kp.Namespace), p.id.IPs)
	switch {
	case !p.enrolled() && d.Mode == wire.ModeAmbient:
		return e.enrolByAgent(ctx, p, d, "late enrolment")
	case p.d.Mode == wire.ModeAmbient && d.Mode != wire.ModeAmbient:
		return e.step(ctx, p, change{ev: evUnenrol, why: "unenrolled: " + d.Reason})
	case p.d.Mode == wire.ModeAmbient && !reflect.DeepEqual(p.d.Ambient, d.Ambient):
		return e.step(ctx, p, change{ev: evChanged, d: d})
	}
	return e.step(ctx, p, change{ev: evSync})
}

// enrolByAgent enrols a running pod, the agent programming its rules. A
// netns that is captured already keeps its capture whatever happens:
// istio-cni's rules are taken over (and someone else's beside them leave
// the pod alone), our own intact rules are left in place, and a failed
// enrolment removes neither.
func (e *Enroller) enrolByAgent(ctx context.Context, p *pod, d *enablement.Decision, why string) error {
	rs, batch, err := e.batches.get(d)
	if err != nil {
		return err
	}
	st, err := e.rules.Survey(p.fd())
	if err == nil {
		if err = st.Refused(); err != nil {
			p.d = none(refusedHandover(err))
		}
	}
	if err != nil {
		return fmt.Errorf("enrolling pod %s: %w", p.id.Key(), err)
	}
	h := how{rules: func(context.Context) error { return e.rules.Program(p.fd(), batch) }}
	if st.Found() {
		h.keepRules = true
		h.rules = func(context.Context) error { return e.takeOver(p, batch) }
	} else if _, cerr := e.rules.Check(p.fd(), rs, 0); cerr == nil {
		h.keepRules = true
		h.rules = func(context.Context) error { return nil }
	}
	if err := e.step(ctx, p, change{ev: evEnrol, d: d, how: h}); err != nil {
		return err
	}
	e.log.Info("pod enrolled by the agent", "pod", p.id.Key(), "mode", d.Mode, "uid", p.id.UID, "why", why)
	return nil
}

// takeOver replaces istio-cni's rules in p's netns with batch's, in one
// transaction, counted and logged.
func (e *Enroller) takeOver(p *pod, batch *nft.Batch) error {
	replaced, err := e.rules.TakeOver(p.fd(), batch)
	if err != nil {
		return err
	}
	e.metrics.Handovers.WithLabelValues("taken").Inc()
	e.log.Info("took a pod over from istio-cni: its rules replaced by ours in one transaction", "pod", p.id.Key(), "uid", p.id.UID, "replaced", replaced)
	return nil
}

// reprogram swaps an enrolled pod's ruleset for the one its annotations now
// ask for (DNS capture, inbound bypass, virtual interfaces), in one atomic
// replace: the pod stays captured throughout (step's doReprogram).
func (e *Enroller) reprogram(ctx context.Context, p *pod, d *enablement.Decision) error {
	_, batch, err := e.batches.get(d)
	if err != nil {
		return err
	}
	if err := e.rules.Program(p.fd(), batch); err != nil {
		return err
	}
	p.d = d
	p.verify = verifyState{pending: true}
	e.saveRecord(p, d)
	e.log.Info("pod's ruleset changed with its annotations", "pod", p.id.Key(), "uid", p.id.UID)
	return nil
}

// adoptIfEnrolled enrols a running pod the agent never saw an ADD for
// (it started before the agent knew it) when the policy enrols it: its
// netns is looked for through /proc.
func (e *Enroller) adoptIfEnrolled(ctx context.Context, kp *corev1.Pod) error {
	ips := podIPs(kp)
	if len(ips) == 0 {
		return nil
	}
	d := e.policy.Decide(kp, e.store.Namespace(kp.Namespace), ips)
	if d.Mode != wire.ModeAmbient {
		return nil
	}
	p, err := e.find(kp, ips)
	if err != nil {
		// Retrying cannot help until the pod changes.
		e.log.Info("pod should be enrolled but its netns was not found; it is enrolled when its sandbox is next created", "pod", kp.Namespace+"/"+kp.Name, "err", err)
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := e.enrolByAgent(ctx, p, d, "late enrolment of a pod found through /proc"); err != nil {
		return err
	}
	if st := kp.Status.StartTime; st != nil && st.After(e.started) {
		// Never in silence: its runtime ran a chain without our entry.
		e.metrics.OutsideChain.Inc()
		e.log.Warn("an ambient pod started without nftcni in its CNI chain while the agent ran, and ran un-captured until now: the runtime did not run our entry (a primary that rewrote its config without it, or a runtime that reads no drop-ins: use owned mode there)",
			"pod", kp.Namespace+"/"+kp.Name, "started", st.Time)
	}
	return nil
}

// find looks for a running pod's netns through the Finder and tracks it
// as known. Its sandbox's container ID is unknown, so the attachment is
// named after the pod UID.
func (e *Enroller) find(kp *corev1.Pod, ips []string) (*pod, error) {
	if e.opts.Finder == nil {
		return nil, errNoFinder
	}
	f, err := e.opts.Finder.Find(string(kp.UID), addrs(ips))
	if err != nil {
		return nil, err
	}
	// The netns is known by the pod's process (/proc/PID/ns/net), which
	// inspect can open while the pod runs.
	id := wire.Pod{Namespace: kp.Namespace, Name: kp.Name, UID: string(kp.UID), IPs: ips, Netns: f.Name(),
		Attachment: wire.Attachment{ContainerID: "found:" + string(kp.UID), IfName: "eth0"}}
	p := &pod{id: id, d: none("found through /proc"), netns: f}
	e.mu.Lock()
	old := e.pods[id.Attachment]
	e.pods[id.Attachment] = p
	e.mu.Unlock()
	if old != nil {
		old.mu.Lock()
		_ = e.step(context.Background(), old, change{ev: evStop})
		old.mu.Unlock()
	}
	e.log.Info("found a running pod's netns through /proc", "pod", id.Key(), "uid", kp.UID)
	return p, nil
}

var errNoFinder = errors.New("no netns finder (/proc scan) configured")

// podIPs are the pod's addresses from its status, as host CIDRs.
func podIPs(p *corev1.Pod) []string {
	var raw []string
	for _, ip := range p.Status.PodIPs {
		raw = append(raw, ip.IP)
	}
	if len(raw) == 0 && p.Status.PodIP != "" {
		raw = append(raw, p.Status.PodIP)
	}
	var out []string
	for _, r := range raw {
		if a, err := netip.ParseAddr(r); err == nil {
			out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()).String())
		}
	}
	return out
}

// RepairSidecar programs a running sidecar pod's ruleset into its netns,
// found through /proc: istio-cni's repairPods, for a pod whose capture
// check failed because it started before the CNI was ready. Its check
// passes the next time kubelet runs it. The agent keeps nothing for the
// pod: a sidecar pod's rules need no ztunnel, and its DEL removes them
// with the netns.
func (e *Enroller) RepairSidecar(ctx context.Context, kp *corev1.Pod) error {
	ips := podIPs(kp)
	if len(ips) == 0 {
		return fmt.Errorf("pod %s/%s has no IP yet", kp.Namespace, kp.Name)
	}
	d := e.policy.Decide(kp, e.store.Namespace(kp.Namespace), ips)
	if d.Mode != wire.ModeSidecar {
		return fmt.Errorf("pod %s/%s is not a sidecar pod to the policy (%s)", kp.Namespace, kp.Name, d.Reason)
	}
	if e.opts.Finder == nil {
		return errNoFinder
	}
	f, err := e.opts.Finder.Find(string(kp.UID), addrs(ips))
	if err != nil {
		return fmt.Errorf("pod %s/%s: finding its netns: %w", kp.Namespace, kp.Name, err)
	}
	defer f.Close()
	_, batch, err := e.batches.get(d)
	if err != nil {
		return err
	}
	if err := e.rules.Program(int(f.Fd()), batch); err != nil {
		return fmt.Errorf("pod %s/%s: programming its sidecar ruleset: %w", kp.Namespace, kp.Name, err)
	}
	return nil
}
