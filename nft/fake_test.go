package nft

import (
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The Fake holds what was programmed, renders it as nft lists it (the same
// golden file the kernel's listing is compared with), and tells drift from
// a netns left alone the way Check does.
func TestFake(t *testing.T) {
	f := NewFake()
	ns3, ns4 := fakeNetnsFile(t), fakeNetnsFile(t)
	rs := sample(true)
	b, err := Encode(rs)
	if err != nil {
		t.Fatal(err)
	}
	if f.Dump(ns3) != "" {
		t.Fatal("a fresh netns holds something")
	}
	if _, err := f.Check(ns3, rs, 0); !isDrift(err) || !strings.Contains(err.Error(), "table inet nftcni is missing") {
		t.Errorf("Check of an empty netns: %v, want drift naming the missing table", err)
	}
	if err := f.Program(ns3, b); err != nil {
		t.Fatal(err)
	}
	if got, want := f.Dump(ns3), Render(rs.Tables...); !strings.HasPrefix(got, want) || !strings.Contains(got, "route ipv4 fwmark 0x111/0xfff lookup 100") {
		t.Errorf("Dump after Program:\n%s\nwant what Render gives (nft's listing) and the policy routes:\n%s", got, want)
	}
	dup, err := unix.Dup(ns3)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dup)
	if f.Dump(dup) != f.Dump(ns3) {
		t.Error("a dup of the netns's descriptor is another netns to the Fake")
	}
	gen, err := f.Check(ns3, rs, 0)
	if err != nil {
		t.Fatalf("Check after Program: %v", err)
	}
	if f.Dump(ns4) != "" {
		t.Error("programming one netns changed another")
	}

	before := dumpRuleset(rs)
	f.Tamper(ns3, func(have *Ruleset) { have.Tables[0].Chains[0].Rules = nil })
	if _, err := f.Check(ns3, rs, gen); !isDrift(err) || !strings.Contains(err.Error(), "line ") {
		t.Errorf("Check after someone emptied a chain: %v, want drift naming the line", err)
	}
	if dumpRuleset(rs) != before {
		t.Error("the tamper reached the ruleset Program was given")
	}
	if err := f.Remove(ns3); err != nil || f.Dump(ns3) != "" {
		t.Errorf("Remove: %v, left %q", err, f.Dump(ns3))
	}
	if err := f.Remove(ns3); err != nil {
		t.Errorf("Remove of what is already gone: %v", err)
	}
	if err := f.Program(ns3, &Batch{Batch: b.Batch}); err == nil {
		t.Error("Program of a batch not made by Encode succeeded")
	}
}

// fakeNetnsFile is a file standing in for a netns: the Fake knows a netns
// by its descriptor's file.
func fakeNetnsFile(t *testing.T) int {
	f, err := os.CreateTemp(t.TempDir(), "netns")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return int(f.Fd())
}

func isDrift(err error) bool {
	var d *DriftError
	return errors.As(err, &d)
}
