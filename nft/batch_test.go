package nft

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft/nlsend"
)

// headers lists the (type, flags) of each message in b.
func headers(t *testing.T, b []byte) [][2]uint16 {
	t.Helper()
	var out [][2]uint16
	for len(b) > 0 {
		l := int(binary.NativeEndian.Uint32(b))
		if l < 16 || l > len(b) {
			t.Fatalf("malformed message of length %d in %d bytes", l, len(b))
		}
		out = append(out, [2]uint16{binary.NativeEndian.Uint16(b[4:]), binary.NativeEndian.Uint16(b[6:])})
		b = b[(l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1):]
	}
	return out
}

// TestBatchAsksOneAckAndNoEcho: the encoded transaction asks the kernel for
// exactly one answer (on its last message), creates its table exclusively,
// and encodes the same ruleset to the same bytes every time.
func TestBatchAsksOneAckAndNoEcho(t *testing.T) {
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
	b, err := Encode(rs)
	if err != nil {
		t.Fatal(err)
	}
	hs := headers(t, b.Tables)
	if hs[0][0] != unix.NFNL_MSG_BATCH_BEGIN || hs[len(hs)-1][0] != unix.NFNL_MSG_BATCH_END {
		t.Fatalf("not framed by batch begin and end: %v", hs)
	}
	acks := 0
	for i, h := range hs {
		if h[1]&unix.NLM_F_ECHO != 0 {
			t.Errorf("message %d asks for an echo", i)
		}
		if h[1]&unix.NLM_F_ACK != 0 {
			acks++
			if i != len(hs)-2 {
				t.Errorf("message %d of %d asks for an ack; only the last before the batch end should", i, len(hs))
			}
		}
	}
	if acks != 1 {
		t.Errorf("%d acks asked, want 1", acks)
	}
	if hs[1][0] != newTable || hs[1][1]&unix.NLM_F_EXCL == 0 {
		t.Errorf("first message %#x flags %#x: want an exclusive table creation", hs[1][0], hs[1][1])
	}
	rh := headers(t, b.Routes)
	if len(rh) != 4 || rh[3][1]&unix.NLM_F_ACK == 0 || rh[0][1]&unix.NLM_F_ACK != 0 {
		t.Errorf("routes: %v, want 4 messages with an ack on the last only", rh)
	}
	again, err := Encode(rs)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again.Tables, b.Tables) || !bytes.Equal(again.Routes, b.Routes) || !bytes.Equal(again.Replace, b.Replace) {
		t.Error("the same ruleset encoded to different bytes")
	}
}

// TestProgramTwiceReplaces: a second Program of the same batch into a netns
// that has the table replaces it (one copy of every rule and one ip rule),
// Remove takes everything away, and a second Remove finds nothing to do.
func TestProgramTwiceReplaces(t *testing.T) {
	testnet.RequireRoot(t)
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
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
	removal, err := EncodeRemoval(PodCleanup())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := nlsend.Remove(n.FD, removal); err != nil {
			t.Fatalf("remove %d: %v", i+1, err)
		}
	}
	if out := nftList(t, n, PodTable); !strings.HasPrefix(out, "error:") {
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
	tb.add("c", Jump("no-such-chain"))
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
	if out := nftList(t, n, PodTable); !strings.HasPrefix(out, "error:") {
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
	if err := Apply(n.FD, Ambient(AmbientSpec{})); err != nil {
		t.Fatal(err)
	}
	g1, _ := Generation(n.FD)
	nftRun(t, n, "add", "table", "inet", "someone-else")
	g2, _ := Generation(n.FD)
	if g1 == g0 || g2 == g1 {
		t.Errorf("generations %d, %d, %d: want a change with each commit", g0, g1, g2)
	}
}
