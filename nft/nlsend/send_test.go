package nlsend

import (
	"encoding/binary"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// msg is one netlink header and payload as the kernel reads them.
func msg(typ, flags uint16, seq uint32, payload int) []byte {
	l := unix.SizeofNlMsghdr + payload
	b := make([]byte, (l+3)&^3)
	binary.NativeEndian.PutUint32(b, uint32(l))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	return b
}

// TestScanFindsTheOneAck: scan names the message that asks for the ack and
// every message's type by sequence number, and refuses a batch that would
// leave talk waiting for an answer that never comes.
func TestScanFindsTheOneAck(t *testing.T) {
	var b []byte
	b = append(b, msg(unix.NFNL_MSG_BATCH_BEGIN, 0, 1, 4)...)
	b = append(b, msg(0xa00, unix.NLM_F_ACK, 2, 5)...) // an unaligned payload: the next is at 4-byte alignment
	b = append(b, msg(unix.NFNL_MSG_BATCH_END, 0, 3, 4)...)
	ack, types, err := scan(b)
	if err != nil || ack != 2 || types.of(1) != unix.NFNL_MSG_BATCH_BEGIN || types.of(2) != 0xa00 || types.of(3) != unix.NFNL_MSG_BATCH_END || types.of(4) != 0 {
		t.Fatalf("scan = %d %v %v, want the ack on 2 and three types", ack, types, err)
	}
	tooLong := msg(0xa00, unix.NLM_F_ACK, 1, 0)
	binary.NativeEndian.PutUint32(tooLong, 64) // says 64 bytes, has 16
	for name, tc := range map[string]struct {
		b    []byte
		want string
	}{
		"no ack":      {msg(unix.NFNL_MSG_BATCH_BEGIN, 0, 1, 4), "asks for no ack"},
		"truncated":   {b[:10], "truncated"},
		"too long":    {tooLong, "malformed"},
		"length zero": {make([]byte, 16), "malformed"},
	} {
		if _, _, err := scan(tc.b); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: scan = %v, want an error saying %q", name, err, tc.want)
		}
	}
}

// TestSpliceReplaceGoesAfterTheBatchBegin: the replace messages sit between
// the batch begin and the first message of the transaction.
func TestSpliceReplaceGoesAfterTheBatchBegin(t *testing.T) {
	begin, add, end := msg(unix.NFNL_MSG_BATCH_BEGIN, 0, 1, 4), msg(0xa00, unix.NLM_F_ACK, 2, 4), msg(unix.NFNL_MSG_BATCH_END, 0, 3, 4)
	del := msg(0xa02, 0, 9, 4)
	tables := append(append(append([]byte{}, begin...), add...), end...)
	got := SpliceReplace(tables, del)
	want := append(append(append(append([]byte{}, begin...), del...), add...), end...)
	if string(got) != string(want) {
		t.Errorf("SpliceReplace put the replace elsewhere:\n%x\nwant\n%x", got, want)
	}
	if _, types, err := scan(got); err != nil || types.of(9) != 0xa02 {
		t.Errorf("the spliced batch does not scan: %v %v", types, err)
	}
}

// newNetns makes an unnamed netns that lives as long as the returned fd:
// a thread unshares into it and ends with its goroutine, still locked.
func newNetns(t *testing.T) int {
	t.Helper()
	type res struct {
		fd  int
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- res{-1, err}
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		ch <- res{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { unix.Close(r.fd) })
	return r.fd
}
