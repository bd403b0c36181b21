package hostprobe

import (
	"errors"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
)

var (
	ip1 = netip.MustParseAddr("10.1.0.7")
	ip2 = netip.MustParseAddr("fd00::7")
)

// fakeKernel is the host netns's nf_tables in memory: the table as the
// last Apply left it (nil: not there), changed by Update as the kernel's
// sets are.
type fakeKernel struct {
	rs      *nft.Ruleset
	updates int
}

var errNoTable = errors.New("netlink receive: no such file or directory")

func (k *fakeKernel) Update(dels []netip.Addr, adds []nft.Element) error {
	if k.rs == nil {
		return errNoTable
	}
	k.updates++
	for _, s := range k.rs.Tables[0].Sets {
		s.Elements = slices.DeleteFunc(s.Elements, func(e nft.Element) bool { return slices.Contains(dels, e.Addr) })
		for _, a := range adds {
			if a.Addr.Is6() == s.V6 {
				s.Elements = append(s.Elements, a)
			}
		}
	}
	return nil
}

func (k *fakeKernel) Elements() (map[netip.Addr]string, bool, error) {
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

// render is the table as nft lists it, elements sorted (a set has no order).
func render(rs *nft.Ruleset) string {
	if rs == nil {
		return ""
	}
	c := *rs.Tables[0]
	c.Sets = nil
	for _, s := range rs.Tables[0].Sets {
		cs := *s
		cs.Elements = slices.Clone(s.Elements)
		slices.SortFunc(cs.Elements, func(a, b nft.Element) int { return a.Addr.Compare(b.Addr) })
		c.Sets = append(c.Sets, &cs)
	}
	return nft.Render(&c)
}

func (k *fakeKernel) Verify(rs *nft.Ruleset) error {
	if have, want := render(k.rs), render(rs); have != want {
		return &nft.DriftError{Problems: []string{"have:\n" + have + "want:\n" + want}}
	}
	return nil
}

func (k *fakeKernel) Apply(rs *nft.Ruleset) error {
	c := *rs.Tables[0]
	c.Sets = nil
	for _, s := range rs.Tables[0].Sets {
		cs := *s
		cs.Elements = slices.Clone(s.Elements)
		c.Sets = append(c.Sets, &cs)
	}
	k.rs = &nft.Ruleset{Tables: []*nft.Table{&c}}
	return nil
}

func (k *fakeKernel) Delete(*nft.Ruleset) error { k.rs = nil; return nil }
func (k *fakeKernel) Close() error              { return nil }

// The table's logic without root: elements owned by pod UID, one batch per
// change, someone else's flush put back from memory, and the agent's start
// (the table asserted before any pod is added: an Add into a table that is
// not there fails, which is why the agent asserts it first).
func TestTableLogic(t *testing.T) {
	k := &fakeKernel{}
	tb, err := New(k, capture.HostSpec{IPv6: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if err := tb.Add("uid-a", []netip.Addr{ip1}); err == nil {
		t.Fatal("Add into a table that is not there succeeded")
	}
	if _, err := tb.Assert(nil, true); err != nil {
		t.Fatal(err)
	}
	ip3 := netip.MustParseAddr("10.1.0.8")
	for _, step := range []func() error{
		func() error { return tb.Add("uid-a", []netip.Addr{ip1, ip2}) },
		func() error { return tb.Add("uid-b", []netip.Addr{ip3}) },
		func() error { return tb.Add("uid-c", []netip.Addr{ip1}) },    // ip1 reused: c takes it
		func() error { return tb.Remove("uid-a", []netip.Addr{ip1}) }, // a no longer owns ip1: kept
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	want := map[netip.Addr]string{ip1: "uid-c", ip2: "uid-a", ip3: "uid-b"}
	if got, _, _ := k.Elements(); !maps.Equal(got, want) {
		t.Fatalf("elements %v, want %v", got, want)
	}
	if k.updates != 4 {
		t.Errorf("%d batches for 4 changes", k.updates)
	}

	// Someone flushes the sets: Repair puts back exactly what the agent wrote.
	for _, s := range k.rs.Tables[0].Sets {
		s.Elements = nil
	}
	if fixed, err := tb.Repair(); err != nil || !fixed {
		t.Fatalf("Repair after a flush: fixed %v, %v", fixed, err)
	}
	if got, _, _ := k.Elements(); !maps.Equal(got, want) {
		t.Errorf("after Repair: %v, want %v", got, want)
	}
	if fixed, err := tb.Repair(); err != nil || fixed {
		t.Errorf("Repair of an intact table: fixed %v, %v", fixed, err)
	}

	// A restarted agent keeps what it cannot account for yet, then makes
	// the table exactly its members.
	tb2, err := New(k, capture.HostSpec{IPv6: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb2.Assert([]nft.Member{{UID: "uid-b", IPs: []netip.Addr{ip3}}}, true); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := k.Elements(); !maps.Equal(got, want) {
		t.Errorf("keepPresent lost elements: %v", got)
	}
	if _, err := tb2.Assert([]nft.Member{{UID: "uid-b", IPs: []netip.Addr{ip3}}}, false); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := k.Elements(); !maps.Equal(got, map[netip.Addr]string{ip3: "uid-b"}) {
		t.Errorf("exact Assert: %v", got)
	}
	if err := tb2.Delete(); err != nil || k.rs != nil || !strings.Contains(render(capture.HostProbe(capture.HostSpec{IPv6: true}, nil)), nft.HostTable) {
		t.Errorf("Delete: %v, table %v", err, k.rs)
	}
}
