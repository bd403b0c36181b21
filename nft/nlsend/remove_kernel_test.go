//go:build !unit

package nlsend_test

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
)

// TestTableThereAsksWithAGet: the get made from a removal's table delete
// tells a table that is there from one that is not. RemoveOn sends the
// delete only then: a failed delete aborts its batch, and nf_tables'
// abort waits for an RCU grace period before it answers.
func TestTableThereAsksWithAGet(t *testing.T) {
	testnet.RequireRoot(t)
	n := testnet.NewNS(t, "nlsend")
	removal, err := nft.EncodeRemoval(capture.PodCleanup())
	if err != nil {
		t.Fatal(err)
	}
	socks, err := nlsend.Dial(n.FD, unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatal(err)
	}
	defer nlsend.CloseAll(socks)
	there := func() bool {
		t.Helper()
		ok, err := nlsend.TableThere(socks[0], removal.Tables[0])
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if there() {
		t.Fatal("a fresh netns has our table")
	}
	b, err := nft.Encode(capture.Ambient(capture.AmbientSpec{DNSCapture: true}))
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Program(n.FD, b); err != nil {
		t.Fatal(err)
	}
	if !there() {
		t.Fatal("the table just programmed is not there")
	}
	if err := nlsend.RemoveOn(socks[:1], &nlsend.Removal{Tables: removal.Tables}); err != nil {
		t.Fatal(err)
	}
	if there() {
		t.Fatal("the table is still there after RemoveOn")
	}
	if _, err := nlsend.TableThere(socks[0], removal.Tables[0][:8]); err == nil {
		t.Error("a truncated batch passed for one with a table delete")
	}
}
