// Package testnet builds throw-away network topologies for tests: network
// namespaces joined by veth pairs, listeners and dialers inside them, and the
// original destination of a redirected connection. Everything it creates is
// removed by t.Cleanup, also when the test fails. Tests only: it runs `ip`.
package testnet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// RequireRoot skips a test that needs root (network namespaces, mounts,
// another UID) when not root, and under -short: `make unit` runs the
// tests that need neither.
func RequireRoot(t testing.TB) {
	t.Helper()
	switch {
	case os.Geteuid() != 0:
		t.Skip("needs root for network namespaces")
	case testing.Short():
		t.Skip("needs root and network namespaces: not a unit test (-short)")
	}
}

// NS is a named network namespace under /var/run/netns.
type NS struct {
	Name string
	Path string
	// FD is an open fd of the namespace (what the plugin hands the agent).
	FD int
}

// NewNS creates a namespace with lo up, removed at cleanup.
func NewNS(t testing.TB, prefix string) *NS {
	t.Helper()
	RequireRoot(t)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := prefix + "-" + hex.EncodeToString(b)
	IP(t, "netns", "add", name)
	n := &NS{Name: name, Path: "/var/run/netns/" + name}
	fd, err := unix.Open(n.Path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	n.FD = fd
	t.Cleanup(func() {
		unix.Close(fd)
		_ = exec.Command("ip", "netns", "del", name).Run()
	})
	IP(t, "-n", name, "link", "set", "lo", "up")
	// No duplicate address detection on interfaces made later: a tentative
	// link-local address silently delays the first IPv6 packets by seconds.
	if out, err := exec.Command("ip", "netns", "exec", name, "sysctl", "-qw",
		"net.ipv6.conf.default.accept_dad=0", "net.ipv6.conf.all.accept_dad=0").CombinedOutput(); err != nil {
		t.Fatalf("sysctl in %s: %v\n%s", name, err, out)
	}
	return n
}

// FreePort is a TCP port on 127.0.0.1 nothing listens on right now.
//
// The port is drawn below the kernel's ephemeral range (32768 and up by
// default), not asked of the kernel with port 0: a port it hands out that
// way is free again once closed, and any outgoing connection of a test
// running beside this one may take it before the server binds it (etcd
// failed to start that way).
func FreePort(t testing.TB) int {
	t.Helper()
	for range 1000 {
		port := 20000 + mrand.IntN(12000)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue // taken
		}
		l.Close()
		return port
	}
	t.Fatal("no free port in 20000-31999")
	return 0
}

// Cached is where a tool the Makefile builds from the Go module proxy lives:
// $env when set, else ~/.cache/nftcni/<rel> (the Makefile's default).
func Cached(env, rel string) string {
	if p := os.Getenv(env); p != "" {
		return p
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "nftcni", rel)
}

// IP runs the ip command (tests only).
func IP(t testing.TB, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// Pair is a "node" namespace and a "pod" namespace joined by a veth pair,
// with IPv4 and IPv6 addresses and default routes from the pod to the node.
type Pair struct {
	Node, Pod       *NS
	NodeIP4, PodIP4 netip.Addr
	NodeIP6, PodIP6 netip.Addr
	NodeIfc, PodIfc string
}

// NewPair builds node <-> pod on 10.77.x.0/24 and fd77:x::/64.
func NewPair(t testing.TB, subnet int) *Pair {
	t.Helper()
	p := &Pair{
		Node: NewNS(t, "nftnode"), Pod: NewNS(t, "nftpod"),
		NodeIP4: netip.MustParseAddr(fmt.Sprintf("10.77.%d.1", subnet)), PodIP4: netip.MustParseAddr(fmt.Sprintf("10.77.%d.2", subnet)),
		NodeIP6: netip.MustParseAddr(fmt.Sprintf("fd77:%x::1", subnet)), PodIP6: netip.MustParseAddr(fmt.Sprintf("fd77:%x::2", subnet)),
		NodeIfc: "veth-pod", PodIfc: "eth0",
	}
	IP(t, "-n", p.Node.Name, "link", "add", p.NodeIfc, "type", "veth", "peer", "name", p.PodIfc, "netns", p.Pod.Name)
	for _, c := range [][]string{
		{"-n", p.Node.Name, "addr", "add", p.NodeIP4.String() + "/24", "dev", p.NodeIfc},
		{"-n", p.Node.Name, "addr", "add", p.NodeIP6.String() + "/64", "dev", p.NodeIfc, "nodad"},
		{"-n", p.Node.Name, "link", "set", p.NodeIfc, "up"},
		{"-n", p.Pod.Name, "addr", "add", p.PodIP4.String() + "/24", "dev", p.PodIfc},
		{"-n", p.Pod.Name, "addr", "add", p.PodIP6.String() + "/64", "dev", p.PodIfc, "nodad"},
		{"-n", p.Pod.Name, "link", "set", p.PodIfc, "up"},
		{"-n", p.Pod.Name, "route", "add", "default", "via", p.NodeIP4.String()},
		{"-n", p.Pod.Name, "-6", "route", "add", "default", "via", p.NodeIP6.String()},
	} {
		IP(t, c...)
	}
	// Static neighbours: IPv6 neighbour discovery on a brand-new veth pair
	// loses the first packets here (a connect then waits a 1 s SYN retry).
	nodeMAC, podMAC := MAC(t, p.Node, p.NodeIfc), MAC(t, p.Pod, p.PodIfc)
	for _, c := range [][]string{
		{"-n", p.Node.Name, "neigh", "replace", p.PodIP4.String(), "lladdr", podMAC, "dev", p.NodeIfc, "nud", "permanent"},
		{"-n", p.Node.Name, "neigh", "replace", p.PodIP6.String(), "lladdr", podMAC, "dev", p.NodeIfc, "nud", "permanent"},
		{"-n", p.Pod.Name, "neigh", "replace", p.NodeIP4.String(), "lladdr", nodeMAC, "dev", p.PodIfc, "nud", "permanent"},
		{"-n", p.Pod.Name, "neigh", "replace", p.NodeIP6.String(), "lladdr", nodeMAC, "dev", p.PodIfc, "nud", "permanent"},
	} {
		IP(t, c...)
	}
	return p
}

// MAC is the hardware address of interface ifc in netns n.
func MAC(t testing.TB, n *NS, ifc string) string {
	t.Helper()
	out, err := exec.Command("ip", "-n", n.Name, "-br", "link", "show", "dev", ifc).CombinedOutput()
	f := strings.Fields(string(out))
	if err != nil || len(f) < 3 {
		t.Fatalf("reading MAC of %s in %s: %v %s", ifc, n.Name, err, out)
	}
	return f[2]
}

// In runs f inside the namespace (sockets made there stay there).
func (n *NS) In(t testing.TB, f func() error) {
	t.Helper()
	if err := ns.WithNetNSPath(n.Path, func(ns.NetNS) error { return f() }); err != nil {
		t.Fatal(err)
	}
}

// Listen opens a TCP listener in the namespace; transparent sets
// IP_TRANSPARENT (needed to accept TPROXY'd connections).
func (n *NS) Listen(t testing.TB, addr string, transparent bool) net.Listener {
	t.Helper()
	var ln net.Listener
	n.In(t, func() error {
		lc := net.ListenConfig{}
		if transparent {
			lc.Control = sockopt(func(fd int) error {
				if err := unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1); err != nil {
					return err
				}
				_ = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1) // v6 sockets only
				return nil
			})
		}
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", addr)
		return err
	})
	t.Cleanup(func() { ln.Close() })
	return ln
}

// ListenUDP opens a UDP socket in the namespace.
func (n *NS) ListenUDP(t testing.TB, addr string) net.PacketConn {
	t.Helper()
	var pc net.PacketConn
	n.In(t, func() error {
		var err error
		pc, err = net.ListenPacket("udp", addr)
		return err
	})
	t.Cleanup(func() { pc.Close() })
	return pc
}

// DialOpts tunes Dial.
type DialOpts struct {
	Mark   uint32     // SO_MARK
	Source netip.Addr // bind to this source address
}

// Dial connects from inside the namespace and writes a line, so the
// accepting side sees data.
func (n *NS) Dial(t testing.TB, network, addr string, o DialOpts) (net.Conn, error) {
	t.Helper()
	var c net.Conn
	var derr error
	n.In(t, func() error {
		d := net.Dialer{Timeout: 2 * time.Second}
		if o.Mark != 0 {
			d.Control = sockopt(func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(o.Mark)) })
		}
		if o.Source.IsValid() {
			if strings.HasPrefix(network, "udp") {
				d.LocalAddr = &net.UDPAddr{IP: o.Source.AsSlice()}
			} else {
				d.LocalAddr = &net.TCPAddr{IP: o.Source.AsSlice()}
			}
		}
		c, derr = d.Dial(network, addr)
		return nil
	})
	if derr != nil {
		return nil, derr
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("hello\n")); err != nil {
		return nil, err
	}
	return c, nil
}

// Accepted is a connection a listener took, with where the client meant to go.
type Accepted struct {
	Local, Remote netip.AddrPort
	// OrigDst is SO_ORIGINAL_DST (a NAT redirect's target); invalid if none.
	OrigDst netip.AddrPort
}

// Accept waits (bounded) for one connection on ln and reads the client's line.
func Accept(t testing.TB, ln net.Listener, wait time.Duration) (*Accepted, error) {
	t.Helper()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() { c, err := ln.Accept(); ch <- res{c, err} }()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, r.err
		}
		defer r.c.Close()
		_ = r.c.SetReadDeadline(time.Now().Add(2 * time.Second))
		buf := make([]byte, 6)
		if _, err := r.c.Read(buf); err != nil {
			return nil, fmt.Errorf("reading from accepted conn: %w", err)
		}
		a := &Accepted{
			Local:  r.c.LocalAddr().(*net.TCPAddr).AddrPort(),
			Remote: r.c.RemoteAddr().(*net.TCPAddr).AddrPort(),
		}
		a.Local = netip.AddrPortFrom(a.Local.Addr().Unmap(), a.Local.Port())
		a.Remote = netip.AddrPortFrom(a.Remote.Addr().Unmap(), a.Remote.Port())
		a.OrigDst, _ = OriginalDst(r.c.(*net.TCPConn))
		return a, nil
	case <-time.After(wait):
		// Unblock the Accept goroutine: the caller's listener stays usable
		// for nothing after this, which is fine for a failed expectation.
		return nil, errors.New("no connection arrived")
	}
}

// OriginalDst reads SO_ORIGINAL_DST (IPv4) or IP6T_SO_ORIGINAL_DST (IPv6).
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var gerr error
	_ = raw.Control(func(fd uintptr) {
		var sa [28]byte
		l := uint32(len(sa))
		for _, level := range []int{unix.SOL_IP, unix.SOL_IPV6} {
			l = uint32(len(sa))
			_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), 80, uintptr(unsafe.Pointer(&sa[0])), uintptr(unsafe.Pointer(&l)), 0)
			if e != 0 {
				gerr = e
				continue
			}
			port := uint16(sa[2])<<8 | uint16(sa[3])
			switch int(sa[0]) | int(sa[1])<<8 {
			case unix.AF_INET:
				out, gerr = netip.AddrPortFrom(netip.AddrFrom4([4]byte(sa[4:8])), port), nil
			case unix.AF_INET6:
				out, gerr = netip.AddrPortFrom(netip.AddrFrom16([16]byte(sa[8:24])).Unmap(), port), nil
			}
			return
		}
	})
	return out, gerr
}

func sockopt(f func(fd int) error) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = f(int(fd)) }); err != nil {
			return err
		}
		return serr
	}
}
