package nft

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
)

// HostTable is our table in the host netns.
const HostTable = "nftcni-host"

const (
	probeSetV4 = "probe-v4"
	probeSetV6 = "probe-v6"
	hostPost   = "postrouting"
	prioSrcNAT = 100
)

// Member is one enrolled pod in the host probe set.
type Member struct {
	UID string
	IPs []netip.Addr
}

// HostProbe builds the host-netns table that SNATs kubelet's probes to
// enrolled pods to 169.254.7.127 (IPv6: fd16:9254:7127:1337:ffff:ffff:ffff:ffff),
// so the pod's ruleset can let them bypass ztunnel. Each set element carries
// the pod UID as its comment.
//
// Kubelet's packets are told apart by having a local socket (LocalSocket,
// `meta skuid >= 0`), as iptables' `--socket-exists` did, not by looking up
// the uid of a process called "kubelet": that lookup breaks on k3s and
// MicroK8s, where kubelet runs inside another binary (istio#58185), and
// needs re-resolving on every kubelet restart. Forwarded traffic (other
// pods, other nodes) has no local socket and is never SNATed; any local
// process reaching an enrolled pod is, exactly like Istio's iptables backend.
func HostProbe(ipv6 bool, members []Member) *Ruleset {
	t := &Table{Name: HostTable}
	v4 := &Set{Name: probeSetV4, Comment: "enrolled pod IPs; element comment = pod UID"}
	t.Sets = append(t.Sets, v4)
	v6 := &Set{Name: probeSetV6, V6: true, Comment: v4.Comment}
	if ipv6 {
		t.Sets = append(t.Sets, v6)
	}
	for _, m := range members {
		for _, ip := range m.IPs {
			switch {
			case ip.Is4() || ip.Is4In6():
				v4.Elements = append(v4.Elements, Element{Addr: ip.Unmap(), Comment: m.UID})
			case ipv6:
				v6.Elements = append(v6.Elements, Element{Addr: ip, Comment: m.UID})
			}
		}
	}
	t.base(hostPost, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, prioSrcNAT)
	t.add(hostPost, L4(TCP), AddrInSet(false, true, probeSetV4), LocalSocket(), Counter(), SNAT(ProbeSNATv4))
	if ipv6 {
		t.add(hostPost, L4(TCP), AddrInSet(false, false, probeSetV6), LocalSocket(), Counter(), SNAT(ProbeSNATv6))
	}
	return &Ruleset{Tables: []*Table{t}}
}

func probeSet(ip netip.Addr) *nftables.Set {
	s := &nftables.Set{Table: &nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet}, Name: probeSetV4, KeyType: nftables.TypeIPAddr}
	if !ip.Is4() {
		s.Name, s.KeyType = probeSetV6, nftables.TypeIP6Addr
	}
	return s
}

// AddProbeIPs puts one pod's IPs into the host probe sets in one batch,
// touching no other element. An IP still held under another UID (reused
// after a pod died without cleanup) is taken over by this pod.
func AddProbeIPs(fd int, uid string, ips []netip.Addr) error {
	return changeProbeIPs(fd, ips, func(c *nftables.Conn, s *nftables.Set, key []byte, owner string, present bool) (bool, error) {
		if present && owner == uid {
			return false, nil
		}
		if present {
			if err := c.SetDeleteElements(s, []nftables.SetElement{{Key: key}}); err != nil {
				return false, err
			}
		}
		return true, c.SetAddElements(s, []nftables.SetElement{{Key: key, Comment: uid}})
	}, "adding pod "+uid+" IPs to")
}

// RemoveProbeIPs removes one pod's IPs, but only elements whose comment is
// this pod's UID: an IP reused by another pod stays enrolled (Istio's rule).
func RemoveProbeIPs(fd int, uid string, ips []netip.Addr) error {
	return changeProbeIPs(fd, ips, func(c *nftables.Conn, s *nftables.Set, key []byte, owner string, present bool) (bool, error) {
		if !present || owner != uid {
			return false, nil
		}
		return true, c.SetDeleteElements(s, []nftables.SetElement{{Key: key}})
	}, "removing pod "+uid+" IPs from")
}

// changeProbeIPs reads the probe sets once, lets change queue element
// updates for each IP (given its current owner UID), and sends them as one
// batch. IPv6 addresses are skipped on a node without the v6 set.
func changeProbeIPs(fd int, ips []netip.Addr, change func(c *nftables.Conn, s *nftables.Set, key []byte, owner string, present bool) (bool, error), what string) error {
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	owners, err := probeOwners(c)
	if err != nil {
		return err
	}
	queued := false
	for _, ip := range ips {
		ip = ip.Unmap()
		s := probeSet(ip)
		setOwners, ok := owners[s.Name]
		if !ok {
			continue // IPv6 is off on this node: no v6 set, nothing to probe
		}
		owner, present := setOwners[ip]
		q, err := change(c, s, ip.AsSlice(), owner, present)
		if err != nil {
			return err
		}
		queued = queued || q
	}
	if !queued {
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("%s the host probe set (%v): %w", what, ips, err)
	}
	return nil
}

// probeOwners reads every existing probe set once: set name -> IP -> UID.
// The host table and its v4 set must exist.
func probeOwners(c *nftables.Conn) (map[string]map[netip.Addr]string, error) {
	t := &nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet}
	sets, err := c.GetSets(t)
	if err != nil {
		return nil, fmt.Errorf("listing sets of table inet %s: %w (is the host table in place?)", HostTable, err)
	}
	out := map[string]map[netip.Addr]string{}
	for _, s := range sets {
		if s.Name != probeSetV4 && s.Name != probeSetV6 {
			continue
		}
		els, err := c.GetSetElements(s)
		if err != nil {
			return nil, fmt.Errorf("reading host probe set %s: %w", s.Name, err)
		}
		m := map[netip.Addr]string{}
		for _, e := range els {
			if a, ok := netip.AddrFromSlice(e.Key); ok {
				m[a] = e.Comment
			}
		}
		out[s.Name] = m
	}
	if _, ok := out[probeSetV4]; !ok {
		return nil, fmt.Errorf("table inet %s has no set %s (is the host table in place?)", HostTable, probeSetV4)
	}
	return out, nil
}

// ProbeMembers reads the host probe sets back as members (UID -> IPs);
// none when the host table is absent.
func ProbeMembers(fd int) ([]Member, error) {
	c, err := conn(fd)
	if err != nil {
		return nil, err
	}
	defer c.CloseLasting()
	if have, err := ourTables(c, []string{HostTable}); err != nil || !have[HostTable] {
		return nil, err
	}
	owners, err := probeOwners(c)
	if err != nil {
		return nil, nil // a table without our sets is drift: nothing to keep
	}
	byUID := map[string][]netip.Addr{}
	for _, set := range []string{probeSetV4, probeSetV6} {
		for ip, uid := range owners[set] {
			byUID[uid] = append(byUID[uid], ip)
		}
	}
	out := make([]Member, 0, len(byUID))
	for uid, ips := range byUID {
		slices.SortFunc(ips, netip.Addr.Compare)
		out = append(out, Member{UID: uid, IPs: ips})
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.UID, b.UID) })
	return out, nil
}
