//go:build !unit

package procscan

import (
	"errors"
	"net/netip"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/testnet"
)

// A process in a pod-named cgroup inside a pod netns is found; the same
// UID with the wrong IP, and the host netns, are not.
func TestFind(t *testing.T) {
	testnet.RequireRoot(t)
	const uid = "6b1e0d2a-1111-4222-8333-944455556666"
	p := testnet.NewPair(t, 31)
	testnet.PodProcess(t, p.Pod, uid)
	host, err := os.Open(p.Node.Path) // stands in for the host netns
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	s := &Scanner{Proc: "/proc", Host: host}
	f, err := s.Find(uid, []netip.Addr{p.PodIP4})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var got, want unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &got); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(p.Pod.Path, &want); err != nil {
		t.Fatal(err)
	}
	if got.Ino != want.Ino {
		t.Errorf("found netns inode %d, want the pod's %d", got.Ino, want.Ino)
	}
	if _, err := s.Find(uid, []netip.Addr{netip.MustParseAddr("10.1.2.3")}); !errors.Is(err, ErrNotFound) {
		t.Errorf("wrong IP: %v", err)
	}
	// The pod's process in the "host" netns must never be taken.
	s.Host, _ = os.Open(p.Pod.Path)
	defer s.Host.Close()
	if _, err := s.Find(uid, []netip.Addr{p.PodIP4}); !errors.Is(err, ErrNotFound) {
		t.Errorf("host netns accepted: %v", err)
	}
}

// A pod whose process started after the walk that serves Finds is found
// all the same: a miss walks /proc again. One walk serves many pods.
func TestFindAfterTheWalk(t *testing.T) {
	testnet.RequireRoot(t)
	const first, later = "6b1e0d2a-1111-4222-8333-944455550001", "6b1e0d2a-1111-4222-8333-944455550002"
	p := testnet.NewPair(t, 32)
	testnet.PodProcess(t, p.Pod, first)
	s := &Scanner{Proc: "/proc"}
	f, err := s.Find(first, []netip.Addr{p.PodIP4})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	walked := s.indexed
	q := testnet.NewPair(t, 33)
	testnet.PodProcess(t, q.Pod, later)
	f, err = s.Find(later, []netip.Addr{q.PodIP4})
	if err != nil {
		t.Fatalf("a pod started after the walk: %v", err)
	}
	f.Close()
	if !s.indexed.After(walked) {
		t.Error("the miss did not walk /proc again")
	}
	walked = s.indexed
	if f, err = s.Find(first, []netip.Addr{p.PodIP4}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !s.indexed.Equal(walked) {
		t.Error("a pod in a second-old walk made another walk")
	}
}
