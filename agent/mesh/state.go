package mesh

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// StateName is the agent's record of the pods it knows, in the run dir.
// It lets a restarted agent find every pod's netns again, re-check its
// rules and give ztunnel a full snapshot, so no pod loses capture.
const StateName = "pods.json"

type savedPod struct {
	Pod      wire.Pod       `json:"pod"`
	UID      string         `json:"uid"`
	Decision *wire.Decision `json:"decision"`
}

// saveState writes the record; called with m.mu held. A process crash
// leaves the old or the new file (rename); it is not fsynced, because a
// machine crash restarts every pod anyway.
func (m *Mesh) saveState() {
	if m.runDir == "" {
		return
	}
	var out []savedPod
	for _, mb := range m.members {
		out = append(out, savedPod{Pod: mb.Pod, UID: mb.UID, Decision: mb.decision})
	}
	b, err := json.Marshal(out)
	if err == nil {
		path := filepath.Join(m.runDir, StateName)
		tmp := path + ".tmp"
		if err = os.WriteFile(tmp, b, 0o600); err == nil {
			err = os.Rename(tmp, path)
		}
	}
	if err != nil {
		m.log.Error("could not save the pod record; a restart would not find these pods", "dir", m.runDir, "err", err)
	}
}

// Restore reloads the pods a previous agent knew: each netns is reopened
// by path and must still be a network namespace holding the pod's
// addresses (a reused path is not the pod); enrolled pods get their rules
// verified and repaired, and ztunnel's next snapshot includes them.
// It returns how many pods were restored and how many rulesets repaired.
func (m *Mesh) Restore(ctx context.Context) (restored, repaired int, err error) {
	b, err := os.ReadFile(filepath.Join(m.runDir, StateName))
	if errors.Is(err, os.ErrNotExist) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, err
	}
	var saved []savedPod
	if err := json.Unmarshal(b, &saved); err != nil {
		return 0, 0, fmt.Errorf("pod record %s: %w", StateName, err)
	}
	for _, sp := range saved {
		d := sp.Decision
		if d == nil {
			d = &wire.Decision{Mode: wire.ModeNone}
		}
		f, err := openPodNetns(sp.Pod)
		if err != nil {
			m.log.Info("a pod from the previous agent is gone", "pod", sp.Pod.Key(), "reason", err)
			if d.Mode == wire.ModeAmbient {
				// Its sandbox went while no agent was there: undo what
				// enrolment left outside it (probe entry, annotation).
				m.release(ctx, &Member{Pod: sp.Pod, UID: sp.UID, Mode: d.Mode}, true)
			}
			continue
		}
		if rs, _ := d.Ruleset(); rs != nil {
			if verr := nft.Verify(int(f.Fd()), rs); verr != nil {
				if aerr := nft.Apply(int(f.Fd()), rs); aerr != nil {
					m.log.Error("could not repair a pod's rules after restart", "pod", sp.Pod.Key(), "drift", verr, "err", aerr)
				} else {
					repaired++
					m.log.Warn("repaired a pod's rules after restart", "pod", sp.Pod.Key(), "drift", verr)
				}
			}
		}
		if d.Mode == wire.ModeAmbient && m.opts.Ztunnel != nil {
			m.opts.Ztunnel.Track(sp.UID, m.workload(&sp.Pod), f)
		}
		m.mu.Lock()
		m.members[sp.Pod.Attachment] = &Member{Pod: sp.Pod, Mode: d.Mode, UID: sp.UID, decision: d, netns: f, pathVisible: true}
		m.mu.Unlock()
		restored++
	}
	m.mu.Lock()
	m.saveState()
	m.mu.Unlock()
	return restored, repaired, nil
}

// openPodNetns reopens a pod's netns by path and checks it is the pod's.
func openPodNetns(p wire.Pod) (*os.File, error) {
	if p.Netns == "" {
		return nil, errors.New("no netns path recorded")
	}
	f, err := os.Open(p.Netns)
	if err != nil {
		return nil, err
	}
	if t, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		f.Close()
		return nil, fmt.Errorf("%s is not a network namespace", p.Netns)
	}
	if len(p.IPs) > 0 {
		h, err := netlink.NewHandleAt(netns.NsHandle(f.Fd()))
		if err != nil {
			f.Close()
			return nil, err
		}
		defer h.Close()
		addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
		if err != nil {
			f.Close()
			return nil, err
		}
		want := p.IPs[0].Addr()
		found := false
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == want {
				found = true
			}
		}
		if !found {
			f.Close()
			return nil, fmt.Errorf("%s no longer holds the pod's address %s", p.Netns, want)
		}
	}
	return f, nil
}

// PruneGone releases pods the store no longer has (deleted while the agent
// was down); call it once the store is complete.
func (m *Mesh) PruneGone(ctx context.Context) int {
	m.mu.Lock()
	var gone []*Member
	for _, mb := range m.members {
		p := m.store.Pod(mb.Pod.Namespace, mb.Pod.Name)
		if p == nil || (string(p.UID) != "" && string(p.UID) != mb.UID) {
			gone = append(gone, mb)
		}
	}
	m.mu.Unlock()
	for _, mb := range gone {
		if mb.Mode == wire.ModeAmbient {
			m.release(ctx, mb, false)
		}
		m.forget(mb.Pod.Attachment)
	}
	return len(gone)
}

// Sweep releases members whose sandbox is gone: the runtime removed the
// netns (its path no longer names the namespace we hold) without a DEL
// reaching us, e.g. while the agent was down. Only pods whose netns path
// the agent could see when they were added are judged (the agent's pod
// needs the host's netns dir mounted for this and for Restore).
func (m *Mesh) Sweep(ctx context.Context) {
	m.mu.Lock()
	var gone []*Member
	for _, mb := range m.members {
		if mb.pathVisible && !sameFile(mb.Pod.Netns, mb.netns) {
			gone = append(gone, mb)
		}
	}
	m.mu.Unlock()
	for _, mb := range gone {
		m.log.Info("a pod's sandbox is gone without a DEL; releasing it", "pod", mb.Pod.Key(), "netns", mb.Pod.Netns)
		if mb.Mode == wire.ModeAmbient {
			m.release(ctx, mb, m.store.Pod(mb.Pod.Namespace, mb.Pod.Name) != nil)
		}
		m.forget(mb.Pod.Attachment)
	}
}

// sameFile says whether path still names the open file f.
func sameFile(path string, f *os.File) bool {
	var a, b unix.Stat_t
	if unix.Stat(path, &a) != nil || unix.Fstat(int(f.Fd()), &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// AdoptAnnotated deals with pods annotated as enrolled that Restore did not
// bring back (no record: an agent that predates this one, a wiped run
// dir): their netns is looked for through /proc and, if found, their rules
// are verified and repaired and ztunnel gets them in its snapshot;
// otherwise the annotation goes, since the pod is not enrolled. Call after
// Restore, before ztunnel is served. It returns how many were adopted and
// how many annotations cleared.
func (m *Mesh) AdoptAnnotated(ctx context.Context) (adopted, cleared int) {
	if m.opts.Annotator == nil {
		return 0, 0
	}
	enrolled := map[string]bool{}
	m.mu.Lock()
	for _, mb := range m.members {
		if mb.Mode == wire.ModeAmbient {
			enrolled[mb.Pod.Key()] = true
		}
	}
	m.mu.Unlock()
	for _, p := range m.store.Pods() {
		if _, ok := p.Annotations[enablement.AnnRedirection]; !ok || enrolled[p.Namespace+"/"+p.Name] {
			continue
		}
		d := m.policy.Decide(p, m.store.Namespace(p.Namespace), podIPs(p))
		if d.Mode == wire.ModeAmbient {
			if mb, err := m.adopt(p, podIPs(p)); err == nil {
				rs, _ := d.Ruleset()
				if nft.Verify(int(mb.netns.Fd()), rs) != nil {
					if err := nft.Apply(int(mb.netns.Fd()), rs); err != nil {
						m.log.Error("could not repair an adopted pod's rules", "pod", mb.Pod.Key(), "err", err)
					}
				}
				if m.opts.Ztunnel != nil {
					m.opts.Ztunnel.Track(mb.UID, m.workload(&mb.Pod), mb.netns)
				}
				m.setMode(mb, d)
				adopted++
				continue
			}
		}
		if err := m.opts.Annotator.SetRedirection(ctx, p.Namespace, p.Name, ""); err != nil {
			m.log.Warn("could not clear a stale enrolment annotation", "pod", p.Namespace+"/"+p.Name, "err", err)
			continue
		}
		cleared++
	}
	return adopted, cleared
}
