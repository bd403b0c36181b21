package nft

import (
	"errors"
	"net/netip"
	"slices"
	"sync"

	"github.com/google/nftables"
)

// FakeHost is the host netns's nf_tables in memory: the table as the last
// Apply left it (none: not there), changed by Update as the kernel's sets
// are, and istio-cni's state as PlantIstio put it.
type FakeHost struct {
	mu      sync.Mutex
	rs      *Ruleset
	istio   *IstioState
	updates int
	// IpsetsBusy is how many more DestroyIstioProbeSets find the ipsets
	// still referenced (ErrIpsetBusy).
	IpsetsBusy      int
	ipsetsDestroyed bool
}

// errNoTable is what the kernel says of an element change in a table that
// is not there.
var errNoTable = errors.New("netlink receive: no such file or directory")

// Update changes the sets' elements.
func (k *FakeHost) Update(dels []netip.Addr, adds []Element) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.rs == nil {
		return errNoTable
	}
	k.updates++
	for _, s := range k.rs.Tables[0].Sets {
		s.Elements = slices.DeleteFunc(s.Elements, func(e Element) bool { return slices.Contains(dels, e.Addr) })
		for _, a := range adds {
			if a.Addr.Is6() == s.V6 {
				s.Elements = append(s.Elements, a)
			}
		}
	}
	return nil
}

// Updates counts the Updates that reached a table.
func (k *FakeHost) Updates() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.updates
}

// Elements reads the sets' elements.
func (k *FakeHost) Elements() (map[netip.Addr]string, bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.rs == nil {
		return nil, false, nil
	}
	out := map[netip.Addr]string{}
	for _, s := range k.rs.Tables[0].Sets {
		for _, e := range s.Elements {
			out[e.Addr] = e.Comment
		}
	}
	return out, true, nil
}

// Dump is the table as nft lists it, elements sorted (a set has no
// order); "" when it is not there.
func (k *FakeHost) Dump() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return sortedRender(k.rs)
}

func sortedRender(rs *Ruleset) string {
	if rs == nil {
		return ""
	}
	c := *rs.Tables[0]
	c.Sets = nil
	for _, s := range rs.Tables[0].Sets {
		cs := *s
		cs.Elements = slices.Clone(s.Elements)
		slices.SortFunc(cs.Elements, func(a, b Element) int { return a.Addr.Compare(b.Addr) })
		c.Sets = append(c.Sets, &cs)
	}
	return Render(&c)
}

// Verify compares the table with rs, elements in any order.
func (k *FakeHost) Verify(rs *Ruleset) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if have, want := sortedRender(k.rs), sortedRender(rs); have != want {
		return &DriftError{Problems: []string{"have:\n" + have + "want:\n" + want}}
	}
	return nil
}

// Apply puts rs's table in place of what is there.
func (k *FakeHost) Apply(rs *Ruleset) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.rs = cloneRuleset(&Ruleset{Tables: rs.Tables[:1]})
	return nil
}

// Delete takes the table away.
func (k *FakeHost) Delete(*Ruleset) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.rs = nil
	return nil
}

// FlushSets empties the probe sets as someone else would.
func (k *FakeHost) FlushSets() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.rs != nil {
		for _, s := range k.rs.Tables[0].Sets {
			s.Elements = nil
		}
	}
}

// PlantIstio puts istio-cni's host state there.
func (k *FakeHost) PlantIstio(s *IstioState) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.istio = s
}

// SurveyIstio is what PlantIstio put there.
func (k *FakeHost) SurveyIstio() (*IstioState, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.istio == nil {
		return &IstioState{}, nil
	}
	return k.istio, nil
}

// RemoveIstio removes istio-cni's state.
func (k *FakeHost) RemoveIstio(*IstioState) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.istio = nil
	return nil
}

// DestroyIstioProbeSets destroys istio-cni's ipsets once IpsetsBusy has
// run out.
func (k *FakeHost) DestroyIstioProbeSets() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.IpsetsBusy > 0 {
		k.IpsetsBusy--
		return ErrIpsetBusy
	}
	k.ipsetsDestroyed = true
	return nil
}

// IpsetsDestroyed says whether DestroyIstioProbeSets has destroyed them.
func (k *FakeHost) IpsetsDestroyed() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.ipsetsDestroyed
}

// Close does nothing.
func (k *FakeHost) Close() error { return nil }

// FakeIstioHostState is istio-cni's host state as SurveyHost finds it with
// istio-cni's iptables backend: its chains in the host's ip nat table,
// whose probe rules match ipsets (UsesIpsets).
func FakeIstioHostState(chains ...string) *IstioState {
	s := &IstioState{}
	for _, c := range chains {
		s.Chains = append(s.Chains, istioChain{table: TableRef{Family: nftables.TableFamilyIPv4, Name: "nat"}, name: c})
	}
	return s
}
