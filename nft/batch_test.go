package nft

import (
	"bytes"
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
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
	rs := sample(true)
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
