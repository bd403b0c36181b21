package hostprobe

import (
	"log/slog"
	"maps"
	"net/netip"
	"testing"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
)

var (
	ip1 = netip.MustParseAddr("10.1.0.7")
	ip2 = netip.MustParseAddr("fd00::7")
)

// The table's logic without root: elements owned by pod UID, one batch per
// change, someone else's flush put back from memory, and the agent's start
// (the table asserted before any pod is added: an Add into a table that is
// not there fails, which is why the agent asserts it first).
func TestTableLogic(t *testing.T) {
	k := &nft.FakeHost{}
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
	if n := k.Updates(); n != 4 {
		t.Errorf("%d batches for 4 changes", n)
	}

	// Someone flushes the sets: Repair puts back exactly what the agent wrote.
	k.FlushSets()
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
	if err := tb2.Delete(); err != nil || k.Dump() != "" {
		t.Errorf("Delete: %v, table %s", err, k.Dump())
	}
}
