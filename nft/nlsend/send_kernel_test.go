//go:build !unit

package nlsend

import (
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
	"golang.org/x/sys/unix"
)

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
