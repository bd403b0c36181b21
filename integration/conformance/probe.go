package conformance

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/testnet"
)

// Fates a probe can have besides landing on a listener.
const (
	Refused  = "refused"   // a TCP reset answered the connect
	NoAnswer = "no-answer" // dropped, unroutable or timed out: nothing came back
)

// Probe is one connection attempt (or datagram, or stray segment).
type Probe struct {
	Name  string // says what it is; the same in both twins
	From  string // "pod", "node" or "sideN"
	Proto string // "tcp", "udp" or "invalid" (a FIN|ACK of no connection)
	Dst   netip.AddrPort
	Src   netip.Addr // bind to this source; zero: the kernel's choice
	UID   uint32     // the socket's owner (fsuid when it is made)
	GID   uint32
	Mark  uint32 // SO_MARK
}

// registry pairs what the listeners saw with the probes that sent it.
type registry struct {
	mu    sync.Mutex
	fates map[string]string
	wait  map[string]chan struct{}
}

func newRegistry() *registry {
	return &registry{fates: map[string]string{}, wait: map[string]chan struct{}{}}
}

func (r *registry) ch(token string) chan struct{} {
	c, ok := r.wait[token]
	if !ok {
		c = make(chan struct{})
		r.wait[token] = c
	}
	return c
}

func (r *registry) put(token, fate string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.fates[token]; dup {
		r.fates[token] += " + " + fate // landed twice: shows as a difference
		return
	}
	r.fates[token] = fate
	close(r.ch(token))
}

// get waits up to d for token's fate.
func (r *registry) get(token string, d time.Duration) (string, bool) {
	r.mu.Lock()
	c := r.ch(token)
	r.mu.Unlock()
	select {
	case <-c:
	case <-time.After(d):
		return "", false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fates[token], true
}

// inNetns runs f on a thread inside the netns behind fd, with the given
// file-system uid and gid, so that the sockets f makes are owned by them
// (nftables' skuid/skgid and iptables' owner match read them).
func inNetns(fd int, uid, gid uint32, f func() error) error {
	runtime.LockOSThread()
	self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(self)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	unix.Setfsgid(int(gid))
	unix.Setfsuid(int(uid))
	ferr := f()
	unix.Setfsuid(0)
	unix.Setfsgid(0)
	if err := unix.Setns(self, unix.CLONE_NEWNET); err != nil {
		// The thread stays locked and dies with this goroutine.
		return errors.Join(ferr, err)
	}
	runtime.UnlockOSThread()
	return ferr
}

func control(f func(fd int) error) func(string, string, syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = f(int(fd)) }); err != nil {
			return err
		}
		return serr
	}
}

// listenTCP accepts on [::]:port (both families; IP_TRANSPARENT so TPROXY
// can hand it connections) and records each connection's fate.
func (tw *Twin) listenTCP(t testing.TB, n *testnet.NS, label string, port uint16) {
	t.Helper()
	var ln net.Listener
	err := inNetns(n.FD, 0, 0, func() error {
		lc := net.ListenConfig{Control: control(func(fd int) error {
			_ = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
			return unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		})}
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", fmt.Sprintf("[::]:%d", port))
		return err
	})
	if err != nil {
		t.Fatalf("listening on %s:%d: %v", label, port, err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go tw.accepted(label, port, c.(*net.TCPConn))
		}
	}()
}

func (tw *Twin) accepted(label string, port uint16, c *net.TCPConn) {
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	token, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	local := c.LocalAddr().(*net.TCPAddr).AddrPort()
	remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
	dst := netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	if od, err := testnet.OriginalDst(c); err == nil && od.IsValid() {
		dst = od
	}
	tw.reg.put(strings.TrimSpace(token), fmt.Sprintf("%s:%d dst=%s src=%s", label, port, dst, remote.Addr().Unmap()))
}

func (tw *Twin) listenUDP(t testing.TB, n *testnet.NS, label string, port uint16) {
	t.Helper()
	var pc net.PacketConn
	err := inNetns(n.FD, 0, 0, func() error {
		var err error
		pc, err = net.ListenPacket("udp", fmt.Sprintf("[::]:%d", port))
		return err
	})
	if err != nil {
		t.Fatalf("listening on udp %s:%d: %v", label, port, err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 256)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			src := from.(*net.UDPAddr).AddrPort().Addr().Unmap()
			tw.reg.put(strings.TrimSpace(string(buf[:n])), fmt.Sprintf("udp %s:%d src=%s", label, port, src))
		}
	}()
}

// netnsOf names the netns a probe starts in.
func (tw *Twin) netnsOf(from string) (*testnet.NS, error) {
	switch {
	case from == "pod":
		return tw.Pod, nil
	case from == "node":
		return tw.Node, nil
	case strings.HasPrefix(from, "side"):
		var i int
		if _, err := fmt.Sscanf(from, "side%d", &i); err == nil && i < len(tw.Sides) {
			return tw.Sides[i], nil
		}
	}
	return nil, fmt.Errorf("no netns %q", from)
}

// Timeouts: a probe that gets no answer in these is NoAnswer.
const (
	connectTimeout = 700 * time.Millisecond
	landTimeout    = 1500 * time.Millisecond
	udpTimeout     = 400 * time.Millisecond
)

// Run sends one probe and returns its fate.
func (tw *Twin) Run(p Probe, token string) string {
	n, err := tw.netnsOf(p.From)
	if err != nil {
		return "error: " + err.Error()
	}
	switch p.Proto {
	case "tcp", "udp":
		return tw.dial(n, p, token)
	case "invalid":
		return stray(n, p)
	}
	return "error: unknown protocol " + p.Proto
}

func (tw *Twin) dial(n *testnet.NS, p Probe, token string) string {
	var c net.Conn
	err := inNetns(n.FD, p.UID, p.GID, func() error {
		d := net.Dialer{Timeout: connectTimeout, Control: control(func(fd int) error {
			if p.Mark != 0 {
				return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(p.Mark))
			}
			return nil
		})}
		if p.Src.IsValid() {
			if p.Proto == "udp" {
				d.LocalAddr = &net.UDPAddr{IP: p.Src.AsSlice()}
			} else {
				d.LocalAddr = &net.TCPAddr{IP: p.Src.AsSlice()}
			}
		}
		var err error
		c, err = d.Dial(p.Proto, p.Dst.String())
		return err
	})
	switch {
	case errors.Is(err, unix.ECONNREFUSED):
		return Refused
	case errors.Is(err, unix.EADDRNOTAVAIL):
		return "cannot bind " + p.Src.String()
	case err != nil:
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, unix.EHOSTUNREACH) || errors.Is(err, unix.ENETUNREACH) {
			return NoAnswer
		}
		return "error: " + err.Error()
	}
	defer c.Close()
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte(token + "\n")); err != nil {
		if p.Proto == "udp" {
			return NoAnswer
		}
		return "error: " + err.Error()
	}
	wait := landTimeout
	if p.Proto == "udp" {
		wait = udpTimeout
	}
	if f, ok := tw.reg.get(token, wait); ok {
		return f
	}
	if p.Proto == "udp" {
		return NoAnswer
	}
	return "connected, seen by no listener"
}

// stray sends a TCP FIN|ACK that belongs to no connection (conntrack
// calls it invalid) and reports what came back: a reset from the pod, or
// nothing (dropped).
func stray(n *testnet.NS, p Probe) string {
	v6 := p.Dst.Addr().Is6()
	src := NodeIP4
	if v6 {
		src = NodeIP6
	}
	sport := uint16(40000 + rand.IntN(20000))
	var got string
	err := inNetns(n.FD, 0, 0, func() error {
		fam := unix.AF_INET
		if v6 {
			fam = unix.AF_INET6
		}
		fd, err := unix.Socket(fam, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		seg := make([]byte, 20)
		binary.BigEndian.PutUint16(seg[0:], sport)
		binary.BigEndian.PutUint16(seg[2:], p.Dst.Port())
		binary.BigEndian.PutUint32(seg[4:], rand.Uint32())
		binary.BigEndian.PutUint32(seg[8:], rand.Uint32())
		seg[12] = 5 << 4
		seg[13] = 0x11 // FIN|ACK
		binary.BigEndian.PutUint16(seg[14:], 1024)
		var to unix.Sockaddr
		if v6 {
			// The kernel fills in the checksum at this offset.
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_CHECKSUM, 16); err != nil {
				return err
			}
			to = &unix.SockaddrInet6{Addr: p.Dst.Addr().As16()}
		} else {
			binary.BigEndian.PutUint16(seg[16:], tcpChecksum(src, p.Dst.Addr(), seg))
			to = &unix.SockaddrInet4{Addr: p.Dst.Addr().As4()}
		}
		if err := unix.Sendto(fd, seg, 0, to); err != nil {
			return err
		}
		deadline := time.Now().Add(udpTimeout)
		buf := make([]byte, 1500)
		for time.Now().Before(deadline) {
			tv := unix.NsecToTimeval(time.Until(deadline).Nanoseconds())
			_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			m, _, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				break
			}
			tcp := buf[:m]
			if !v6 { // IPv4 raw sockets deliver the IP header too
				if m < 20 {
					continue
				}
				tcp = buf[int(buf[0]&0xf)*4 : m]
			}
			if len(tcp) < 14 || binary.BigEndian.Uint16(tcp[0:]) != p.Dst.Port() || binary.BigEndian.Uint16(tcp[2:]) != sport {
				continue
			}
			got = "answered " + tcpFlags(tcp[13])
			return nil
		}
		got = NoAnswer
		return nil
	})
	if err != nil {
		return "error: " + err.Error()
	}
	return got
}

func tcpChecksum(src, dst netip.Addr, seg []byte) uint16 {
	s4, d4 := src.As4(), dst.As4()
	pseudo := append(append(append([]byte{}, s4[:]...), d4[:]...), 0, unix.IPPROTO_TCP, byte(len(seg)>>8), byte(len(seg)))
	var sum uint32
	for _, b := range [][]byte{pseudo, seg} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

func tcpFlags(f byte) string {
	var out []string
	for i, n := range []string{"FIN", "SYN", "RST", "PSH", "ACK", "URG"} {
		if f&(1<<i) != 0 {
			out = append(out, n)
		}
	}
	return strings.Join(out, "|")
}
