package nlsend

import (
	"encoding/binary"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
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

// TestCheckSocketsRefusesAnotherNetns: sockets handed over are used only
// when they are netlink sockets of the protocols asked for, made in the
// pod's netns.
func TestCheckSocketsRefusesAnotherNetns(t *testing.T) {
	testnet.RequireRoot(t)
	pod := newNetns(t)
	self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(self)
	protos := []int{unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE}
	in, err := Dial(pod, protos...)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(in)
	if err := CheckSockets(pod, in, protos); err != nil {
		t.Errorf("sockets made in the pod's netns: %v", err)
	}
	here, err := Dial(self, protos...)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(here)
	for name, tc := range map[string]struct {
		socks, protos []int
		want          string
	}{
		"another netns":     {here, protos, "another netns"},
		"protocols swapped": {in, []int{unix.NETLINK_ROUTE, unix.NETLINK_NETFILTER}, "want netlink protocol"},
		"one missing":       {in[:1], protos, "1 sockets, want 2"},
		"not netlink":       {[]int{int(os.Stdin.Fd()), in[1]}, protos, "socket 0"},
	} {
		if err := CheckSockets(pod, tc.socks, tc.protos); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: CheckSockets = %v, want an error saying %q", name, err, tc.want)
		}
	}
}

// TestDialHereComesBack: DialHere makes the sockets in the pod's netns on
// the caller's own thread, and that thread is back in its own netns after.
func TestDialHereComesBack(t *testing.T) {
	testnet.RequireRoot(t)
	pod := newNetns(t)
	runtime.LockOSThread() // the thread checked below is the one DialHere uses
	defer runtime.UnlockOSThread()
	before, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	protos := []int{unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE}
	socks, err := DialHere(pod, protos...)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(socks)
	if err := CheckSockets(pod, socks, protos); err != nil {
		t.Errorf("DialHere's sockets: %v", err)
	}
	if after, err := os.Readlink("/proc/thread-self/ns/net"); err != nil || after != before {
		t.Errorf("the thread is in %s after DialHere, was in %s (%v)", after, before, err)
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
