package nft

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/google/nftables"
)

// HostTable is our table in the host netns.
const HostTable = "nftcni-host"

// The host probe sets, by family, in HostTable.
const (
	ProbeSetV4 = "probe-v4"
	ProbeSetV6 = "probe-v6"
)

// Member is one enrolled pod in the host probe set.
type Member struct {
	UID string
	IPs []netip.Addr
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
	s := &nftables.Set{Table: &nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet}, Name: ProbeSetV4, KeyType: nftables.TypeIPAddr}
	if !ip.Is4() {
		s.Name, s.KeyType = ProbeSetV6, nftables.TypeIP6Addr
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
		if s.Name != ProbeSetV4 && s.Name != ProbeSetV6 {
			continue
		}
		ok = ok || s.Name == ProbeSetV4
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
