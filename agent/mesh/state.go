package mesh

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// StateDir holds the agent's record of the pods it knows, one small file
// per attachment in the run dir. It lets a restarted agent find every
// pod's netns again, re-check its rules and give ztunnel a full snapshot,
// so no pod loses capture. One file per pod keeps each ADD's write small
// whatever the number of pods.
const StateDir = "pods"

// Record is what the agent keeps on disk about one pod it knows.
type Record struct {
	Pod      wire.Pod       `json:"pod"`
	UID      string         `json:"uid"`
	Decision *wire.Decision `json:"decision"`
}

func (m *Mesh) statePath(a wire.Attachment) string {
	sum := sha256.Sum256([]byte(a.ContainerID + "/" + a.IfName))
	return filepath.Join(m.opts.RunDir, StateDir, hex.EncodeToString(sum[:12])+".json")
}

// saveMember records one member before its enrolment is acknowledged. A
// process crash leaves the old or the new file (rename); it is not fsynced,
// because a machine crash restarts every pod anyway.
func (m *Mesh) saveMember(mb *Member) {
	if m.opts.RunDir == "" {
		return
	}
	b, err := json.Marshal(Record{Pod: mb.Pod, UID: mb.UID, Decision: mb.decision})
	path := m.statePath(mb.Pod.Attachment)
	if err == nil {
		err = os.MkdirAll(filepath.Dir(path), 0o700)
	}
	if err == nil {
		tmp := path + ".tmp"
		if err = os.WriteFile(tmp, b, 0o600); err == nil {
			err = os.Rename(tmp, path)
		}
	}
	if err != nil {
		m.log.Error("could not record a pod; a restart would not find it", "pod", mb.Pod.Key(), "err", err)
	}
}

// dropMember removes a member's record.
func (m *Mesh) dropMember(a wire.Attachment) {
	if m.opts.RunDir == "" {
		return
	}
	if err := os.Remove(m.statePath(a)); err != nil && !errors.Is(err, os.ErrNotExist) {
		m.log.Warn("could not remove a pod's record", "err", err)
	}
}

func (m *Mesh) readState() ([]Record, error) {
	recs, bad, err := ReadRecords(m.opts.RunDir)
	for _, b := range bad {
		m.log.Warn("skipping an unreadable pod record", "err", b)
	}
	// Temp files a crash left behind.
	tmps, _ := filepath.Glob(filepath.Join(m.opts.RunDir, StateDir, "*.tmp"))
	for _, t := range tmps {
		_ = os.Remove(t)
	}
	return recs, err
}

// ReadRecords reads the pod records under runDir without changing
// anything; bad lists the files it could not read.
func ReadRecords(runDir string) (recs []Record, bad []error, err error) {
	dir := filepath.Join(runDir, StateDir)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	for _, e := range ents {
		if filepath.Ext(e.Name()) != ".json" {
			continue
		}
		p := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(p)
		var r Record
		if err == nil {
			err = json.Unmarshal(b, &r)
		}
		if err != nil {
			bad = append(bad, fmt.Errorf("%s: %w", p, err))
			continue
		}
		recs = append(recs, r)
	}
	return recs, bad, nil
}

// Restore reloads the pods a previous agent knew: each netns is reopened
// by path and must still be a network namespace holding the pod's
// addresses (a reused path is not the pod); enrolled pods get their rules
// verified and repaired, and ztunnel's next snapshot includes them.
// It returns how many pods were restored and how many rulesets repaired.
func (m *Mesh) Restore(ctx context.Context) (restored, repaired int, err error) {
	saved, err := m.readState()
	if err != nil {
		return 0, 0, err
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
			m.dropMember(sp.Pod.Attachment)
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
// dir). Their netns is looked for through /proc. A pod that should still
// be enrolled is adopted (rules verified, in ztunnel's snapshot) or, when
// its netns cannot be found, kept in ztunnel's snapshot without one (ZDS
// KeepWorkload, as istio-cni does), so ztunnel does not drop a proxy that
// may be serving it. A pod that should no longer be enrolled has its rules
// removed when found and its annotation cleared. Call after Restore,
// before ztunnel is served. It returns how many were adopted, kept without
// a netns, and cleared.
func (m *Mesh) AdoptAnnotated(ctx context.Context) (adopted, kept, cleared int) {
	if m.opts.Annotator == nil {
		return 0, 0, 0
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
		key := p.Namespace + "/" + p.Name
		ips := podIPs(p)
		d := m.policy.Decide(p, m.store.Namespace(p.Namespace), ips)
		mb, err := m.adopt(p, ips)
		switch {
		case d.Mode == wire.ModeAmbient && err == nil:
			rs, _ := d.Ruleset()
			if nft.Verify(int(mb.netns.Fd()), rs) != nil {
				if err := nft.Apply(int(mb.netns.Fd()), rs); err != nil {
					m.log.Error("could not repair an adopted pod's rules", "pod", key, "err", err)
				}
			}
			if m.opts.Ztunnel != nil {
				m.opts.Ztunnel.Track(mb.UID, m.workload(&mb.Pod), mb.netns)
			}
			m.setMode(mb, d)
			adopted++
			continue
		case d.Mode == wire.ModeAmbient:
			if m.opts.Ztunnel != nil {
				m.opts.Ztunnel.Track(string(p.UID), zds.WorkloadInfo{Name: p.Name, Namespace: p.Namespace, ServiceAccount: p.Spec.ServiceAccountName}, nil)
			}
			m.log.Warn("pod annotated as enrolled but its netns was not found; kept in ztunnel's snapshot without one", "pod", key, "err", err)
			kept++
			continue
		case err == nil:
			if derr := nft.Delete(int(mb.netns.Fd()), nft.PodCleanup()); derr != nil {
				m.log.Warn("could not remove the rules of a pod no longer enrolled", "pod", key, "err", derr)
			}
		}
		if err := m.opts.Annotator.SetRedirection(ctx, p.Namespace, p.Name, ""); err != nil {
			m.log.Warn("could not clear a stale enrolment annotation", "pod", key, "err", err)
			continue
		}
		cleared++
	}
	return adopted, kept, cleared
}
