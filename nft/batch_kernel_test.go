//go:build !unit

package nft

import (
	"errors"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft/nlsend"
)

// TestProgramTwiceReplaces: a second Program of the same batch into a netns
// that has the table replaces it (one copy of every rule and one ip rule),
// Remove takes everything away, and a second Remove finds nothing to do.
func TestProgramTwiceReplaces(t *testing.T) {
	testnet.RequireRoot(t)
	rs := sample(true)
	b, err := Encode(rs)
	if err != nil {
		t.Fatal(err)
	}
	n := testnet.NewNS(t, "nftbatch")
	for i := 0; i < 2; i++ {
		if err := Program(n.FD, b); err != nil {
			t.Fatalf("program %d: %v", i+1, err)
		}
		if err := Verify(n.FD, rs); err != nil {
			t.Fatalf("after program %d: %v", i+1, err)
		}
	}
	out, err := exec.Command("ip", "-n", n.Name, "rule", "list").CombinedOutput()
	if err != nil || strings.Count(string(out), "fwmark 0x111/0xfff lookup 100") != 1 {
		t.Errorf("want one ip rule for the connmark, have (%v):\n%s", err, out)
	}
	removal, err := EncodeRemoval(sampleCleanup())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := nlsend.Remove(n.FD, removal); err != nil {
			t.Fatalf("remove %d: %v", i+1, err)
		}
	}
	if out := testnet.NftList(t, n, PodTable); !strings.HasPrefix(out, "error:") {
		t.Errorf("table left after Remove:\n%s", out)
	}
	out, _ = exec.Command("ip", "-n", n.Name, "rule", "list").CombinedOutput()
	if strings.Contains(string(out), "lookup 100") {
		t.Errorf("ip rule left after Remove:\n%s", out)
	}
}

// TestProgramReportsTheKernelsReason: a transaction the kernel refuses
// fails whole, with the kernel's errno and the failing message's type.
func TestProgramReportsTheKernelsReason(t *testing.T) {
	testnet.RequireRoot(t)
	tb := &Table{Name: PodTable}
	tb.Add("c", Jump("no-such-chain"))
	b, err := Encode(&Ruleset{Tables: []*Table{tb}})
	if err != nil {
		t.Fatal(err)
	}
	n := testnet.NewNS(t, "nftbatch")
	err = Program(n.FD, b)
	var nerr *nlsend.NetlinkError
	if !errors.As(err, &nerr) || nerr.Errno != unix.ENOENT || nerr.Type != unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWRULE {
		t.Fatalf("Program = %v, want ENOENT on a NEWRULE", err)
	}
	if out := testnet.NftList(t, n, PodTable); !strings.HasPrefix(out, "error:") {
		t.Errorf("a refused transaction left its table:\n%s", out)
	}
}

// TestGenerationMovesWithEveryCommit: the generation changes when anyone
// changes the ruleset, and not otherwise.
func TestGenerationMovesWithEveryCommit(t *testing.T) {
	testnet.RequireRoot(t)
	n := testnet.NewNS(t, "nftgen")
	g0, err := Generation(n.FD)
	if err != nil {
		t.Fatal(err)
	}
	if g, _ := Generation(n.FD); g != g0 {
		t.Fatalf("generation moved from %d to %d with no change", g0, g)
	}
	if err := Apply(n.FD, sample(false)); err != nil {
		t.Fatal(err)
	}
	g1, _ := Generation(n.FD)
	testnet.Nft(t, n, "add", "table", "inet", "someone-else")
	g2, _ := Generation(n.FD)
	if g1 == g0 || g2 == g1 {
		t.Errorf("generations %d, %d, %d: want a change with each commit", g0, g1, g2)
	}
}
