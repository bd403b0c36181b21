//go:build !unit

package hostprobe

import (
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
)

// open is a Table in a fresh netns standing in for the host, with the
// table put in place as the agent does at start.
func open(t *testing.T) (*Table, *testnet.NS) {
	t.Helper()
	testnet.RequireRoot(t)
	host := testnet.NewNS(t, "hostprobe")
	f, err := os.Open(host.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	tb, err := Open(f, capture.HostSpec{IPv6: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tb.Close() })
	if _, err := tb.Assert(nil, false); err != nil {
		t.Fatal(err)
	}
	return tb, host
}

// kernel is what the netns's sets hold, read back through a new
// connection: what a fresh agent would find.
func kernel(t *testing.T, host *testnet.NS) map[netip.Addr]string {
	t.Helper()
	ps, err := nft.OpenProbeSet(host.FD)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	owners, ok, err := ps.Elements()
	if err != nil || !ok {
		t.Fatalf("elements: %v (table there: %v)", err, ok)
	}
	return owners
}

func TestAddRemoveByOwner(t *testing.T) {
	tb, host := open(t)
	if err := tb.Add("uid-a", []netip.Addr{ip1, ip2}); err != nil {
		t.Fatal(err)
	}
	want := map[netip.Addr]string{ip1: "uid-a", ip2: "uid-a"}
	if got := kernel(t, host); !maps.Equal(got, want) {
		t.Fatalf("after Add: %v, want %v", got, want)
	}
	// The IP is reused by a new pod before the old one's release arrives:
	// the new pod takes it over, and the old pod's release leaves it.
	if err := tb.Add("uid-b", []netip.Addr{ip1}); err != nil {
		t.Fatal(err)
	}
	if err := tb.Remove("uid-a", []netip.Addr{ip1, ip2}); err != nil {
		t.Fatal(err)
	}
	want = map[netip.Addr]string{ip1: "uid-b"}
	if got := kernel(t, host); !maps.Equal(got, want) {
		t.Fatalf("after reuse and release: %v, want %v", got, want)
	}
	if got := tb.Owners(); !maps.Equal(got, want) {
		t.Errorf("owners in memory %v, want %v", got, want)
	}
}

func TestRepairPutsBackAFlushedTable(t *testing.T) {
	tb, host := open(t)
	if err := tb.Add("uid-a", []netip.Addr{ip1}); err != nil {
		t.Fatal(err)
	}
	if fixed, err := tb.Repair(); err != nil || fixed {
		t.Fatalf("Repair of an intact table: fixed %v, %v", fixed, err)
	}
	// Someone else flushes the ruleset (a firewall reload).
	if out, err := exec.Command("ip", "netns", "exec", host.Name, "nft", "flush", "ruleset").CombinedOutput(); err != nil {
		t.Fatalf("nft flush ruleset: %v\n%s", err, out)
	}
	fixed, err := tb.Repair()
	if err != nil || !fixed {
		t.Fatalf("Repair of a flushed table: fixed %v, %v", fixed, err)
	}
	if got := kernel(t, host); got[ip1] != "uid-a" {
		t.Errorf("after repair: %v", got)
	}
	out, err := exec.Command("ip", "netns", "exec", host.Name, "nft", "list", "table", "inet", nft.HostTable).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "169.254.7.127") {
		t.Errorf("repaired table has no probe SNAT: %v\n%s", err, out)
	}
}

func TestAssertKeepsPresentElementsUntilTold(t *testing.T) {
	tb, host := open(t)
	if err := tb.Add("uid-old", []netip.Addr{ip1}); err != nil {
		t.Fatal(err)
	}
	// A restarted agent: it asserts what it knows and keeps what it cannot
	// yet account for.
	members := []nft.Member{{UID: "uid-a", IPs: []netip.Addr{ip2}}}
	if _, err := tb.Assert(members, true); err != nil {
		t.Fatal(err)
	}
	want := map[netip.Addr]string{ip1: "uid-old", ip2: "uid-a"}
	if got := kernel(t, host); !maps.Equal(got, want) {
		t.Fatalf("keepPresent: %v, want %v", got, want)
	}
	// Once it knows, the stale element goes.
	if _, err := tb.Assert(members, false); err != nil {
		t.Fatal(err)
	}
	want = map[netip.Addr]string{ip2: "uid-a"}
	if got := kernel(t, host); !maps.Equal(got, want) {
		t.Fatalf("exact: %v, want %v", got, want)
	}
}
