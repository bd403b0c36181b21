package nft

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/google/nftables"

	"github.com/nftcni/nftcni/istio"
)

// HostTable is our table in the host netns.
const HostTable = "nftcni-host"

const (
	probeSetV4 = "probe-v4"
	probeSetV6 = "probe-v6"
	hostPost   = "postrouting"
	prioSrcNAT = 100
)

// Istio's default probe SNAT addresses (istio.ProbeSNATv4, istio.ProbeSNATv6).
var (
	ProbeSNATv4 = netip.MustParseAddr(istio.ProbeSNATv4)
	ProbeSNATv6 = netip.MustParseAddr(istio.ProbeSNATv6)
)

// ProbeSNAT is where kubelet's probes to enrolled pods come from after the
// host's SNAT: istio-cni's HOST_PROBE_SNAT_IP and HOST_PROBE_SNAT_IPV6.
// A zero address is Istio's default.
type ProbeSNAT struct {
	V4 netip.Addr `json:"v4,omitzero"`
	V6 netip.Addr `json:"v6,omitzero"`
}

// Addr is the address for one family, the default filled in.
func (p ProbeSNAT) Addr(v4 bool) netip.Addr {
	switch {
	case v4 && p.V4.IsValid():
		return p.V4
	case v4:
		return ProbeSNATv4
	case p.V6.IsValid():
		return p.V6
	}
	return ProbeSNATv6
}

// HostSpec is what decides the host probe table.
type HostSpec struct {
	IPv6 bool // a set and a rule for IPv6 pods
	SNAT ProbeSNAT
}

// Member is one enrolled pod in the host probe set.
type Member struct {
	UID string
	IPs []netip.Addr
}

// HostProbe builds the host-netns table that SNATs kubelet's probes to
// enrolled pods to the probe SNAT address (by default 169.254.7.127; IPv6:
// fd16:9254:7127:1337:ffff:ffff:ffff:ffff), so the pod's ruleset can let
// them bypass ztunnel. Each set element carries
// the pod UID as its comment.
//
// Kubelet's packets are told apart by having a local socket (LocalSocket,
// `meta skuid >= 0`), as iptables' `--socket-exists` did, not by looking up
// the uid of a process called "kubelet": that lookup breaks on k3s and
// MicroK8s, where kubelet runs inside another binary (istio#58185), and
// needs re-resolving on every kubelet restart. Forwarded traffic (other
// pods, other nodes) has no local socket and is never SNATed; any local
// process reaching an enrolled pod is, exactly like Istio's iptables backend.
func HostProbe(spec HostSpec, members []Member) *Ruleset {
	ipv6 := spec.IPv6
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
	t.add(hostPost, L4(TCP), AddrInSet(false, true, probeSetV4), LocalSocket(), Counter(), SNAT(spec.SNAT.Addr(true)))
	if ipv6 {
		t.add(hostPost, L4(TCP), AddrInSet(false, false, probeSetV6), LocalSocket(), Counter(), SNAT(spec.SNAT.Addr(false)))
	}
	return &Ruleset{Tables: []*Table{t}}
}

// ProbeSet reads and changes the elements of the host probe sets over
// one lasting netlink connection in the host netns: the agent keeps it for
// its lifetime, so a pod's element change is one send.
type ProbeSet struct {
	mu sync.Mutex // a google/nftables Conn queues messages: one batch at a time
	c  *nftables.Conn
}

// OpenProbeSet connects to nf_tables in the netns behind fd.
func OpenProbeSet(fd int) (*ProbeSet, error) {
	c, err := conn(fd)
	if err != nil {
		return nil, err
	}
	return &ProbeSet{c: c}, nil
}

// Close closes the connection.
func (p *ProbeSet) Close() error { return p.c.CloseLasting() }

func probeSet(ip netip.Addr) *nftables.Set {
	s := &nftables.Set{Table: &nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet}, Name: probeSetV4, KeyType: nftables.TypeIPAddr}
	if !ip.Is4() {
		s.Name, s.KeyType = probeSetV6, nftables.TypeIP6Addr
	}
	return s
}

// Update deletes dels, then adds adds (each element's comment is its
// owner's UID), in one transaction. A delete of an absent element fails
// the whole transaction: callers delete what they know is there.
func (p *ProbeSet) Update(dels []netip.Addr, adds []Element) error {
	if len(dels) == 0 && len(adds) == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ip := range dels {
		if err := p.c.SetDeleteElements(probeSet(ip.Unmap()), []nftables.SetElement{{Key: ip.Unmap().AsSlice()}}); err != nil {
			return err
		}
	}
	for _, e := range adds {
		if err := p.c.SetAddElements(probeSet(e.Addr.Unmap()), []nftables.SetElement{{Key: e.Addr.Unmap().AsSlice(), Comment: e.Comment}}); err != nil {
			return err
		}
	}
	if err := p.c.Flush(); err != nil {
		return fmt.Errorf("updating the host probe set: %w", err)
	}
	return nil
}

// Elements reads the probe sets: each IP and the UID in its comment. ok is
// false when the host table or its IPv4 set is missing.
func (p *ProbeSet) Elements() (owners map[netip.Addr]string, ok bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if have, err := ourTables(p.c, []string{HostTable}); err != nil || !have[HostTable] {
		return nil, false, err
	}
	sets, err := p.c.GetSets(&nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet})
	if err != nil {
		return nil, false, fmt.Errorf("listing sets of table inet %s: %w", HostTable, err)
	}
	owners = map[netip.Addr]string{}
	for _, s := range sets {
		if s.Name != probeSetV4 && s.Name != probeSetV6 {
			continue
		}
		ok = ok || s.Name == probeSetV4
		els, err := p.c.GetSetElements(s)
		if err != nil {
			return nil, false, fmt.Errorf("reading host probe set %s: %w", s.Name, err)
		}
		for _, e := range els {
			if a, valid := netip.AddrFromSlice(e.Key); valid {
				owners[a.Unmap()] = e.Comment
			}
		}
	}
	return owners, ok, nil
}

// Members groups probe set elements by owner UID, sorted.
func Members(owners map[netip.Addr]string) []Member {
	byUID := map[string][]netip.Addr{}
	for ip, uid := range owners {
		byUID[uid] = append(byUID[uid], ip)
	}
	out := make([]Member, 0, len(byUID))
	for uid, ips := range byUID {
		slices.SortFunc(ips, netip.Addr.Compare)
		out = append(out, Member{UID: uid, IPs: ips})
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.UID, b.UID) })
	return out
}
