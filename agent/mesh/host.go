package mesh

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

func addrs(ips []netip.Prefix) []netip.Addr {
	out := make([]netip.Addr, 0, len(ips))
	for _, p := range ips {
		out = append(out, p.Addr())
	}
	return out
}

func (m *Mesh) addProbe(uid string, ips []netip.Prefix) error {
	if m.opts.HostNetns == nil || len(ips) == 0 {
		return nil
	}
	if err := nft.AddProbeIPs(int(m.opts.HostNetns.Fd()), uid, addrs(ips)); err != nil {
		return fmt.Errorf("host probe set: %w", err)
	}
	return nil
}

func (m *Mesh) removeProbe(uid string, ips []netip.Prefix) error {
	if m.opts.HostNetns == nil || len(ips) == 0 {
		return nil
	}
	return nft.RemoveProbeIPs(int(m.opts.HostNetns.Fd()), uid, addrs(ips))
}

// hostRuleset is what the host table must hold: every ambient member's IPs,
// and the elements already there (pods enrolled before this agent started
// are kept, never pruned here: only a full pod list can tell they are gone).
func (m *Mesh) hostRuleset(present []nft.Member) *nft.Ruleset {
	owner := map[netip.Addr]string{} // one element per IP; members win
	for _, p := range present {
		for _, ip := range p.IPs {
			owner[ip] = p.UID
		}
	}
	m.mu.Lock()
	for _, mb := range m.members {
		if mb.Mode == wire.ModeAmbient {
			for _, ip := range addrs(mb.Pod.IPs) {
				owner[ip.Unmap()] = mb.UID
			}
		}
	}
	m.mu.Unlock()
	byUID := map[string][]netip.Addr{}
	for ip, uid := range owner {
		byUID[uid] = append(byUID[uid], ip)
	}
	members := make([]nft.Member, 0, len(byUID))
	for uid, ips := range byUID {
		slices.SortFunc(ips, netip.Addr.Compare)
		members = append(members, nft.Member{UID: uid, IPs: ips})
	}
	slices.SortFunc(members, func(a, b nft.Member) int { return strings.Compare(a.UID, b.UID) })
	return nft.HostProbe(m.opts.IPv6, members)
}

// PruneHost makes the probe set hold exactly the members' IPs, dropping
// entries nobody accounts for (a pod whose ADD died with the previous
// agent). Only call it when the members are complete: at start, after
// Restore.
func (m *Mesh) PruneHost() error {
	_, err := m.assertHost(false)
	return err
}

// EnsureHost makes the host probe table hold what the members need, and
// keeps entries already there, replacing it atomically when it is missing
// or drifted (someone flushed the ruleset, a firewall reload:
// istio#60607). It reports whether it had to repair.
func (m *Mesh) EnsureHost() (bool, error) { return m.assertHost(true) }

// assertHost verifies the host table against the members (plus, with
// keepPresent, the elements already in it) and re-applies it on drift.
func (m *Mesh) assertHost(keepPresent bool) (bool, error) {
	if m.opts.HostNetns == nil {
		return false, nil
	}
	fd := int(m.opts.HostNetns.Fd())
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	var present []nft.Member
	if keepPresent {
		var err error
		if present, err = nft.ProbeMembers(fd); err != nil {
			return false, err
		}
	}
	rs := m.hostRuleset(present)
	err := nft.Verify(fd, rs)
	var drift *nft.DriftError
	if err == nil {
		return false, nil
	}
	if !errors.As(err, &drift) {
		return false, err
	}
	if err := nft.Apply(fd, rs); err != nil {
		return false, fmt.Errorf("re-asserting the host probe table: %w", err)
	}
	return true, nil
}

// GuardHost re-asserts the host table every interval until ctx ends, and
// sweeps members whose sandbox is gone.
func (m *Mesh) GuardHost(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		m.Sweep(ctx)
		if fixed, err := m.EnsureHost(); err != nil {
			m.log.Error("host probe table", "err", err)
		} else if fixed {
			m.log.Warn("host probe table had drifted (flushed or edited by someone else); re-asserted", "table", "inet "+nft.HostTable)
		}
	}
}

// RemoveHost deletes the host table (uninstall).
func (m *Mesh) RemoveHost() error {
	if m.opts.HostNetns == nil {
		return nil
	}
	return nft.Delete(int(m.opts.HostNetns.Fd()), nft.HostProbe(m.opts.IPv6, nil))
}
