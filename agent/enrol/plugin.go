package enrol

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/netnsaddr"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// This file is what the plugin's requests reach (events.Handler).

// Decide looks the pod up and applies the enablement policy.
func (e *Enroller) Decide(ctx context.Context, p *wire.Pod) (*enablement.Decision, error) {
	kp := e.store.Pod(p.Namespace, p.Name)
	for i := 0; kp == nil && i < e.lookupRetries; i++ {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(e.lookupDelay):
		}
		kp = e.store.Pod(p.Namespace, p.Name)
	}
	ns := e.store.Namespace(p.Namespace)
	if kp == nil || (p.UID != "" && string(kp.UID) != "" && string(kp.UID) != p.UID) {
		// Unknown (or an older pod of the same name): decide from the
		// namespace alone, failing closed where it enrols pods.
		if e.policy.NamespaceEnrols(ns) {
			return nil, fmt.Errorf("pod %s (uid %s) is not in the agent's cache yet and namespace %s enrols its pods; retry", p.Key(), p.UID, p.Namespace)
		}
		return none("pod not in the agent's cache; its namespace does not enrol pods"), nil
	}
	return e.policy.Decide(kp, ns, p.IPs), nil
}

// uid is the pod's UID: the runtime's, else the store's, else "".
func (e *Enroller) uid(p *wire.Pod) string {
	if p.UID != "" {
		return p.UID
	}
	if kp := e.store.Pod(p.Namespace, p.Name); kp != nil {
		return string(kp.UID)
	}
	return ""
}

// track starts tracking a new attachment with its own dup of netns. An
// older entry for the same attachment (the runtime re-running ADD for a
// sandbox) is forgotten first; the plugin is about to program its netns.
func (e *Enroller) track(ctx context.Context, wp *wire.Pod, netns *os.File) (*pod, error) {
	e.mu.Lock()
	old := e.pods[wp.Attachment]
	e.mu.Unlock()
	if old != nil {
		old.mu.Lock()
		_ = e.step(ctx, old, change{ev: evReAdd, why: "the runtime ran ADD again for this sandbox"})
		old.mu.Unlock()
	}
	f, err := dupFile(netns)
	if err != nil {
		return nil, fmt.Errorf("keeping the netns of pod %s: %w", wp.Key(), err)
	}
	id := *wp
	id.UID = e.uid(wp)
	p := &pod{id: id, d: none("new"), netns: f}
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) == nil {
		p.nsDev, p.nsIno = st.Dev, st.Ino
	}
	p.pathVisible = wp.Netns != "" && sameFile(wp.Netns, f)
	e.mu.Lock()
	e.pods[wp.Attachment] = p
	e.mu.Unlock()
	return p, nil
}

// Add runs a pod's ADD: the decision, and for a pod it enrols the one
// enrolment, with the plugin programming the rules.
func (e *Enroller) Add(ctx context.Context, wp *wire.Pod, netns *os.File, plugin events.Plugin) error {
	if len(wp.IPs) == 0 {
		// No prevResult (a standalone network, Multus's extra network):
		// the pod's addresses are the ones its netns holds.
		ps, err := netnsaddr.List(netns)
		if err != nil {
			e.log.Warn("reading the addresses of a pod's netns", "pod", wp.Key(), "err", err)
		}
		for _, p := range ps {
			wp.IPs = append(wp.IPs, p.String())
		}
	}
	wp.IPs = canonical(wp.IPs)
	d, err := e.Decide(ctx, wp)
	if err != nil {
		return err
	}
	if d.Mode == wire.ModeNone {
		// The plugin has its answer first; then the pod is known, with
		// its netns, so that enrolling it later (a label added) needs no
		// search for its netns.
		if err := plugin.Decide(d.Verdict(), nil); err != nil {
			e.log.Debug("plugin went away after its decision", "pod", wp.Key(), "err", err)
		}
		p, err := e.track(ctx, wp, netns)
		if err != nil {
			e.log.Warn("could not keep the netns of a pod outside the mesh; enrolling it later searches /proc", "pod", wp.Key(), "err", err)
			return nil
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		p.d = d
		e.saveRecord(p, d)
		return nil
	}
	if zt := e.opts.Ztunnel; d.Mode == wire.ModeAmbient && zt != nil && !zt.Accepting() {
		// As after a reboot, before ztunnel's pod is back: nothing is
		// programmed, and the plugin asks again (within its wait for the
		// agent) instead of failing the sandbox into the kubelet's back-off.
		return fmt.Errorf("pod %s: %w (%w)", wp.Key(), zds.ErrNoZtunnel, events.ErrTryAgain)
	}
	_, batch, err := e.batches.get(d)
	if err != nil {
		return fmt.Errorf("pod %s: encoding its %s ruleset: %w", wp.Key(), d.Mode, err)
	}
	p, err := e.track(ctx, wp, netns)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var t *wire.Timings
	start := time.Now()
	var answered time.Duration // when the plugin was told it may answer the runtime
	decide := func(context.Context) error { return plugin.Decide(d.Verdict(), batch) }
	if batch.Size() > wire.MaxMessage-decisionRoom {
		// Too large for one message (a sidecar excluding thousands of
		// ranges): the agent writes it through the pod's netns it holds, and
		// the plugin gets the decision alone.
		decide = func(context.Context) error {
			if err := e.rules.Program(p.fd(), batch); err != nil {
				return fmt.Errorf("programming its %s ruleset of %d bytes (too large for the plugin's message): %w", d.Mode, batch.Size(), err)
			}
			v := d.Verdict()
			v.Programmed = true
			return plugin.Decide(v, nil)
		}
	}
	err = e.step(ctx, p, change{ev: evEnrol, d: d, how: how{
		start: decide,
		ready: func(err error) { answered = time.Since(start); plugin.Ready(err) },
		rules: func(context.Context) (err error) { t, err = plugin.Outcome(); return err }}})
	if err != nil {
		return err
	}
	// ready_ms is what the ADD waited on the agent (ztunnel's ack, the
	// probe set, the record); done_ms adds the rules' outcome and the
	// annotation's PATCH, which nothing in the ADD waits for.
	args := []any{"pod", wp.Key(), "mode", d.Mode, "uid", p.id.UID, "containerID", wp.ContainerID, "reason", d.Reason,
		"ready_ms", ms(answered), "done_ms", ms(time.Since(start))}
	if t != nil {
		args = append(args, "plugin_decided_ms", t.Decided, "plugin_programmed_ms", t.Programmed)
	}
	e.log.Info("pod enrolled", args...)
	return nil
}

// decisionRoom is what a decision message holds besides its batch: the
// JSON verdict and the batch's lengths.
const decisionRoom = 1024

// Del is the pod's DEL: the rules go through netns, the descriptor the
// plugin hands over while the netns exists (whether this agent tracks the
// pod or not), the rest of the enrolment goes, and the pod is forgotten.
// The agent removes the rules rather than the plugin: its sockets are
// closed after the answer (nft.Kernel.Remove), the plugin's would hold the DEL.
// A failed removal is the error (the plugin then removes them itself);
// the pod is released all the same.
func (e *Enroller) Del(ctx context.Context, wp *wire.Pod, netns *os.File) error {
	e.mu.Lock()
	p := e.pods[wp.Attachment]
	e.mu.Unlock()
	remove := func() error {
		if netns == nil {
			return nil
		}
		if err := e.rules.Remove(int(netns.Fd())); err != nil {
			return fmt.Errorf("removing the rules of pod %s: %w", wp.Key(), err)
		}
		return nil
	}
	if p == nil {
		rerr := remove()
		// Never seen, or gone already. ztunnel holds only what this agent
		// gave it, so a pod kept without a netns (adopted, no record) is
		// the one thing left to let go, by its real UID.
		if zt := e.opts.Ztunnel; zt != nil && wp.UID != "" && zt.Holds(wp.UID) && !e.uidTracked(wp.UID) {
			zt.Del(ctx, wp.UID)
		}
		return rerr
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// Under the pod's lock: a verification pass cannot put back what
	// this removes.
	rerr := remove()
	return errors.Join(rerr, e.step(ctx, p, change{ev: evDel, why: "DEL"}))
}

// uidTracked says whether any attachment with uid is tracked.
func (e *Enroller) uidTracked(uid string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.pods {
		if p.id.UID == uid && p.state != gone {
			return true
		}
	}
	return false
}

// Check verifies a pod's ruleset through the descriptor the plugin handed
// over, against what the pod should have now.
func (e *Enroller) Check(ctx context.Context, wp *wire.Pod, netns *os.File) error {
	wp.IPs = canonical(wp.IPs)
	d, err := e.Decide(ctx, wp)
	if err != nil {
		return err
	}
	rs, _, err := e.batches.get(d)
	if err != nil {
		return err
	}
	if rs == nil {
		has, err := nft.HasTable(int(netns.Fd()), nft.PodTable)
		if err == nil && has {
			err = fmt.Errorf("pod %s is not enrolled (%s) but its netns holds table inet %s", wp.Key(), d.Reason, nft.PodTable)
		}
		return err
	}
	_, err = e.rules.Check(int(netns.Fd()), rs, 0)
	if err != nil {
		return fmt.Errorf("pod %s %s ruleset: %w", wp.Key(), d.Mode, err)
	}
	return nil
}

// GC forgets every attachment the runtime no longer has.
func (e *Enroller) GC(ctx context.Context, valid []wire.Attachment) error {
	keep := make(map[wire.Attachment]bool, len(valid))
	for _, a := range valid {
		keep[a] = true
	}
	n := 0
	for _, p := range e.snapshot() {
		if keep[p.id.Attachment] {
			continue
		}
		p.mu.Lock()
		if p.state != gone {
			_ = e.step(ctx, p, change{ev: evGC, why: "GC: the runtime no longer has this attachment"})
			n++
		}
		p.mu.Unlock()
	}
	if n > 0 {
		e.log.Info("GC released stale attachments", "count", n)
	}
	return nil
}

// Ready is nil: the plugin can be served as soon as the server runs.
func (e *Enroller) Ready() error { return nil }

// Inspect says what the agent knows of a pod.
func (e *Enroller) Inspect(q *wire.Pod) *wire.Inspect {
	in := &wire.Inspect{}
	uid := q.UID
	if uid == "" { // asked by name: a pod the agent tracks without a record
		for _, p := range e.snapshot() {
			p.mu.Lock()
			if p.state != gone && in.Pod == nil && p.id.Key() == q.Key() {
				id := p.id
				in.Pod, in.Enrolment, uid = &id, fmt.Sprintf("%s (%s)", p.d.Mode, p.d.Reason), p.id.UID
			}
			p.mu.Unlock()
		}
	}
	for _, p := range e.snapshot() {
		p.mu.Lock()
		if uid != "" && p.id.UID == uid && p.enrolled() {
			in.Verified, in.Drift, in.Repairs = p.verify.at, p.verify.drift, p.verify.repairs
		}
		p.mu.Unlock()
	}
	in.ZDS = "no ztunnel configured (--ztunnel-socket none)"
	if e.opts.Ztunnel != nil {
		in.ZDS = e.opts.Ztunnel.State(uid)
	}
	return in
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// sameFile says whether path still names the open file f.
func sameFile(path string, f *os.File) bool {
	var a, b unix.Stat_t
	if unix.Stat(path, &a) != nil || unix.Fstat(int(f.Fd()), &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}
