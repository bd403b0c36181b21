package enrol

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/procscan"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/internal/netnsaddr"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// This file is the agent's start: what a previous agent left is taken
// over before ztunnel may connect, so ztunnel's first snapshot holds every
// enrolled pod and none loses capture across a restart.

// Restored counts what Restore, PruneGone and AdoptAnnotated did.
type Restored struct {
	Restored, Gone, Pruned, Adopted, Kept, Cleared int
}

// Restore reloads the pods a previous agent recorded. Each netns is
// reopened by its path and must still be the one recorded (same device and
// inode; older records without them: a network namespace holding the
// pod's address); enrolled pods are enrolled again as restored — ztunnel
// gets them in its first snapshot, their probe set entries are kept, and
// their rules are verified by the first verification pass, right after
// the agent is ready. Pods whose sandbox went while no agent ran are
// released.
func (e *Enroller) Restore(ctx context.Context) (Restored, error) {
	var n Restored
	if e.opts.Records == nil {
		return n, nil
	}
	recs, bad, err := e.opts.Records.Load()
	for _, b := range bad {
		e.log.Warn("skipping an unreadable pod record", "err", b)
	}
	if err != nil {
		return n, err
	}
	marks, err := e.opts.Records.Marks()
	if err != nil {
		e.log.Warn("could not read what the plugin left while no agent ran; every recorded pod is checked as usual", "err", err)
		if marks == nil {
			marks = &records.Marks{}
		}
	}
	for _, r := range recs {
		d := r.Decision
		if d == nil {
			d = none("recorded without a decision")
		}
		id := r.Pod
		if r.UID != "" {
			id.UID = r.UID
		}
		p := &pod{id: id, d: d, nsDev: r.NetnsDev, nsIno: r.NetnsIno}
		if d.Mode != wire.ModeNone {
			p.state = enrolled // as the previous agent left it
		}
		p.mu.Lock()
		if marks.Deleted(r.Pod.Attachment) {
			// The runtime's DEL (or GC) ran while no agent did: the plugin
			// removed the rules; the rest goes now, and ztunnel never sees
			// the pod again.
			e.log.Info("a pod was deleted while no agent ran", "pod", r.Pod.Key())
			_ = e.step(ctx, p, change{ev: evDeletedAway, why: "the runtime deleted it while no agent ran"})
			p.mu.Unlock()
			n.Gone++
			continue
		}
		legacy := r.NetnsIno == 0
		f, err := openRecorded(&r)
		if err != nil {
			e.log.Info("a pod from the previous agent is gone", "pod", r.Pod.Key(), "reason", err)
			_ = e.step(ctx, p, change{ev: evSandboxGone, why: "its sandbox went while no agent ran"})
			p.mu.Unlock()
			n.Gone++
			continue
		}
		p.netns, p.pathVisible, p.nsDev, p.nsIno = f, true, r.NetnsDev, r.NetnsIno
		e.mu.Lock()
		e.pods[p.id.Attachment] = p
		e.mu.Unlock()
		switch {
		case d.Mode != wire.ModeNone:
			p.d, p.state = none("restored"), known
			if err := e.step(ctx, p, change{ev: evEnrol, d: d, how: how{rules: deferred, restored: true, recorded: !legacy}}); err != nil {
				e.log.Error("could not restore a pod's enrolment", "pod", r.Pod.Key(), "err", err)
			}
		case legacy:
			e.saveRecord(p, d) // with the netns inode from now on
		}
		p.mu.Unlock()
		n.Restored++
	}
	if err := e.opts.Records.ClearMarks(marks); err != nil {
		e.log.Warn("could not clear what the plugin left while no agent ran", "err", err)
	}
	return n, nil
}

// deferred leaves the rules to the verifier's first pass.
func deferred(context.Context) error { return nil }

// openRecorded reopens a recorded pod's netns by path and checks it is the
// pod's.
func openRecorded(r *records.Record) (*os.File, error) {
	if r.Pod.Netns == "" {
		return nil, errors.New("no netns path recorded")
	}
	f, err := os.Open(r.Pod.Netns)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	if r.NetnsIno != 0 {
		if st.Dev != r.NetnsDev || st.Ino != r.NetnsIno {
			f.Close()
			return nil, fmt.Errorf("%s names another netns now", r.Pod.Netns)
		}
		return f, nil
	}
	// A record from an agent that did not keep the inode.
	if t, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		f.Close()
		return nil, fmt.Errorf("%s is not a network namespace", r.Pod.Netns)
	}
	if ips := addrs(r.Pod.IPs); len(ips) > 0 && !netnsaddr.Holds(f, ips[0]) {
		f.Close()
		return nil, fmt.Errorf("%s no longer holds the pod's address %s", r.Pod.Netns, ips[0])
	}
	r.NetnsDev, r.NetnsIno = st.Dev, st.Ino
	return f, nil
}

// PruneGone releases the restored pods the store no longer has (deleted
// while the agent was down, or gone from the static source): their rules
// go from a netns that still exists, and ztunnel never sees them. Call it
// once the store is complete, before ztunnel is served.
func (e *Enroller) PruneGone(ctx context.Context) int {
	n := 0
	for _, p := range e.snapshot() {
		kp := e.store.Pod(p.id.Namespace, p.id.Name)
		if kp != nil && (string(kp.UID) == "" || p.id.UID == "" || string(kp.UID) == p.id.UID) {
			continue
		}
		p.mu.Lock()
		if p.state != gone {
			_ = e.step(ctx, p, change{ev: evPodGone, why: "the pod is gone from the pod source"})
			n++
		}
		p.mu.Unlock()
	}
	return n
}

// AdoptAnnotated deals with pods annotated as enrolled that Restore did not
// bring back (no record: an agent that predates this one, a wiped run
// dir). Their netns is looked for through /proc. A pod that should still
// be enrolled is adopted (rules verified and repaired, in ztunnel's first
// snapshot) or, when its netns cannot be found, kept in ztunnel's snapshot
// without one (ZDS KeepWorkload, as istio-cni does), so ztunnel does not
// drop a proxy that may be serving it. A pod that should no longer be
// enrolled has its rules removed when found and its annotation cleared.
// Call after Restore, before ztunnel is served.
func (e *Enroller) AdoptAnnotated(ctx context.Context) (adopted, kept, cleared int) {
	if e.opts.Annotator == nil {
		return 0, 0, 0
	}
	enrolled := map[string]bool{}
	for _, m := range e.Members() {
		enrolled[m.Pod.Key()] = true
	}
	// Pods go a few at a time: a takeover's commit waits for the kernel to
	// retire the hooks it replaces, and those waits overlap across netns.
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan *corev1.Pod)
	for range e.opts.AdoptConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for kp := range work {
				o := e.adoptOne(ctx, kp)
				mu.Lock()
				switch o {
				case outcomeAdopted:
					adopted++
				case outcomeKept:
					kept++
				case outcomeCleared:
					cleared++
				}
				mu.Unlock()
			}
		}()
	}
	for _, kp := range e.store.Pods() {
		key := kp.Namespace + "/" + kp.Name
		if _, ok := kp.Annotations[istio.AnnRedirection]; ok && !enrolled[key] {
			work <- kp
		}
	}
	close(work)
	wg.Wait()
	return adopted, kept, cleared
}

// DefaultAdoptConcurrency is how many annotated pods are adopted at once.
// Each adoption waits on the kernel (its netns's base chains replaced in
// one commit) more than it computes: 32 took 500 pods over from istio-cni
// in 0.65-0.72 s where 8 took 0.95-1.12 s on two cores
// (BenchmarkIstioHandover, docs/benchmarks.md).
const DefaultAdoptConcurrency = 32

type adoptOutcome int

const (
	outcomeNone adoptOutcome = iota
	outcomeAdopted
	outcomeKept
	outcomeCleared
)

// adoptOne adopts, keeps or clears one annotated pod with no record.
func (e *Enroller) adoptOne(ctx context.Context, kp *corev1.Pod) adoptOutcome {
	key := kp.Namespace + "/" + kp.Name
	ips := podIPs(kp)
	d := e.policy.Decide(kp, e.store.Namespace(kp.Namespace), ips)
	p, err := e.find(kp, ips)
	switch {
	case d.Mode == wire.ModeAmbient && err == nil:
		aerr := e.adopt(ctx, p, d)
		if aerr == nil {
			return outcomeAdopted
		}
		var foreign *nft.ForeignError
		if errors.As(aerr, &foreign) {
			// istio-cni's rules with someone else's: left exactly as they
			// are, and ztunnel keeps the workload it is serving.
			e.metrics.Handovers.WithLabelValues("refused").Inc()
			p.mu.Lock()
			p.d = none(refusedHandover(aerr))
			p.mu.Unlock()
			e.log.Error("not taking a pod over from istio-cni: its netns holds rules of someone else beside Istio's; left as it is (drain the node to move it)",
				"pod", key, "uid", kp.UID, "err", aerr)
			e.keepInZtunnel(kp)
			return outcomeKept
		}
	case d.Mode == wire.ModeAmbient:
		e.keepInZtunnel(kp)
		// No process of the pod runs: its sandbox is gone (every pod
		// after a reboot) and its next ADD enrols it; the restore's
		// summary counts these. Anything else is a scan that failed.
		lvl := slog.LevelWarn
		if errors.Is(err, procscan.ErrNotFound) {
			lvl = slog.LevelDebug
		}
		e.log.Log(ctx, lvl, "pod annotated as enrolled but its netns was not found; kept in ztunnel's snapshot without one", "pod", key, "err", err)
		return outcomeKept
	case err == nil:
		p.mu.Lock()
		if rerr := e.step(ctx, p, change{ev: evStale}); rerr != nil {
			e.log.Warn("could not remove the rules of a pod no longer enrolled", "pod", key, "err", rerr)
		}
		p.mu.Unlock()
	}
	if err := e.opts.Annotator.SetRedirection(ctx, kp.Namespace, kp.Name, ""); err != nil {
		e.log.Warn("could not clear a stale enrolment annotation", "pod", key, "err", err)
		return outcomeNone
	}
	return outcomeCleared
}

// refusedHandover is the reason a pod keeps istio-cni's rules, as inspect
// shows it.
func refusedHandover(err error) string {
	return "istio-cni's rules left in place, not taken over: " + err.Error()
}

// keepInZtunnel keeps a pod in ztunnel's snapshot without a netns (ZDS
// KeepWorkload, as istio-cni does), so ztunnel does not drop a proxy that
// may be serving it.
func (e *Enroller) keepInZtunnel(kp *corev1.Pod) {
	if e.opts.Ztunnel == nil || kp.UID == "" {
		return
	}
	e.opts.Ztunnel.Track(string(kp.UID), workloadInfo(kp.Namespace, kp.Name, kp), nil)
}

// adopt enrols a running pod found through /proc, its rules verified and
// repaired by the agent, ztunnel getting it in its first snapshot.
func (e *Enroller) adopt(ctx context.Context, p *pod, d *enablement.Decision) error {
	rs, batch, err := e.batches.get(d)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// istio-cni's rules in the pod (a live migration from it): ours replace
	// them in one transaction, unless someone else's rules are there too,
	// in which case nothing is touched.
	st, err := e.rules.Survey(p.fd())
	if err != nil {
		return err
	}
	if err := st.Refused(); err != nil {
		return err
	}
	if len(st.Legacy) > 0 && !st.Found() {
		// Annotated as enrolled, with x_tables tables: istio-cni's
		// iptables-legacy mode, whose rules nf_tables cannot replace.
		return &nft.ForeignError{Legacy: st.Legacy}
	}
	repair := func(context.Context) error {
		if st.Found() {
			return e.takeOver(p, batch)
		}
		_, err := e.rules.Check(p.fd(), rs, 0)
		var drift *nft.DriftError
		if errors.As(err, &drift) {
			return e.rules.Program(p.fd(), batch)
		}
		return err
	}
	if err := e.step(ctx, p, change{ev: evEnrol, d: d, how: how{rules: repair, restored: true}}); err != nil {
		e.log.Error("could not adopt a pod", "pod", p.id.Key(), "err", err)
		return err
	}
	return nil
}
