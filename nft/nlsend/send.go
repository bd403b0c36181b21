// Package nlsend writes netlink batches that were encoded elsewhere into a
// network namespace: one socket per protocol made inside the netns, one
// send and one ack per batch, every error the kernel reports returned with
// its extended-ack text.
//
// It imports nothing but golang.org/x/sys/unix on purpose. The CNI plugin
// is exec'd for every pod sandbox and its start-up follows its page faults
// and package inits: the encoders (google/nftables, mdlayher/netlink,
// vishvananda/netlink, all used by package nft, which makes the batches)
// would cost every exec about 75 page faults before main runs. The plugin
// links this package and wire, never nft.
package nlsend

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// Batch is a pod ruleset as the kernel takes it (package nft's Encode
// makes it): the nf_tables transaction and the policy routes.
type Batch struct {
	// Tables is the nf_tables transaction, batch begin to batch end, with
	// one ack asked of its last message and each table created
	// exclusively.
	Tables []byte `json:"tables"`
	// Replace goes right after the batch begin of Tables when the tables
	// exist: per table an add (a no-op on an existing one) and a delete.
	Replace []byte `json:"replace,omitempty"`
	// Routes are the rtnetlink messages of the ruleset's policy routes.
	Routes []byte `json:"routes,omitempty"`
}

// Removal undoes a ruleset: one nf_tables transaction per table, so one
// already gone cannot stop another's removal, and the route deletions.
type Removal struct {
	Tables [][]byte `json:"tables"`
	Routes []byte   `json:"routes,omitempty"`
}

// Program writes b into the netns behind fd: the nf_tables transaction in
// one send with one ack and, when the table is already there (EEXIST),
// once more as an atomic replace; then the policy routes in one send with
// one ack. This is the whole cost of programming a pod.
func Program(fd int, b *Batch) error {
	return onSockets(fd, Protos(b), func(socks []int) error { return ProgramOn(socks, b) })
}

// onSockets runs f on sockets of protos made in the netns behind fd, and
// closes them.
func onSockets(fd int, protos []int, f func(socks []int) error) error {
	socks, err := Dial(fd, protos...)
	if err != nil {
		return err
	}
	defer CloseAll(socks)
	return f(socks)
}

// Protos are the netlink protocols b is written on, one socket each, in
// the order ProgramOn takes the sockets.
func Protos(b *Batch) []int {
	if len(b.Routes) > 0 {
		return []int{unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE}
	}
	return []int{unix.NETLINK_NETFILTER}
}

// ProgramOn is Program on sockets made in the pod's netns already, by
// Dial with Protos(b), in this process or in another that handed them
// over: the agent hands them to its plugin with the decision.
func ProgramOn(socks []int, b *Batch) error {
	var onExists []byte
	if len(b.Replace) > 0 {
		onExists = SpliceReplace(b.Tables, b.Replace)
	}
	return sendOn(socks, b.Tables, onExists, b.Routes)
}

// Send writes an nf_tables transaction into the netns behind fd (and, if
// that fails with EEXIST and onExists is set, that one instead), then the
// policy routes: one send and one ack each, on sockets made in the netns.
func Send(fd int, tables, onExists, routes []byte) error {
	return onSockets(fd, Protos(&Batch{Routes: routes}), func(socks []int) error { return sendOn(socks, tables, onExists, routes) })
}

func sendOn(socks []int, tables, onExists, routes []byte) error {
	if want := len(Protos(&Batch{Routes: routes})); len(socks) != want {
		return fmt.Errorf("%d netlink sockets for a batch that needs %d", len(socks), want)
	}
	err := talk(socks[0], tables, nil)
	if errors.Is(err, unix.EEXIST) && onExists != nil {
		err = talk(socks[0], onExists, nil)
	}
	if err != nil {
		return fmt.Errorf("nf_tables transaction: %w", err)
	}
	if len(routes) > 0 {
		if err := talk(socks[1], routes, ruleExists); err != nil {
			return fmt.Errorf("policy routes: %w", err)
		}
	}
	return nil
}

// CheckSockets makes sure socks are netlink sockets of protos, in that
// order, made in the netns behind fd: sockets from another process are
// written to only once they are known to reach the pod's netns and no
// other (the host's, say).
func CheckSockets(fd int, socks []int, protos []int) error {
	if len(socks) != len(protos) {
		return fmt.Errorf("%d sockets, want %d", len(socks), len(protos))
	}
	var want unix.Stat_t
	if err := unix.Fstat(fd, &want); err != nil {
		return fmt.Errorf("the pod's netns: %w", err)
	}
	for i, s := range socks {
		domain, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_DOMAIN)
		if err != nil {
			return fmt.Errorf("socket %d: %w", i, err)
		}
		proto, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_PROTOCOL)
		if err != nil {
			return fmt.Errorf("socket %d: %w", i, err)
		}
		if domain != unix.AF_NETLINK || proto != protos[i] {
			return fmt.Errorf("socket %d is of family %d protocol %d, want netlink protocol %d", i, domain, proto, protos[i])
		}
		ns, err := unix.IoctlRetInt(s, unix.SIOCGSKNS)
		if err != nil {
			return fmt.Errorf("socket %d: its netns: %w", i, err)
		}
		var have unix.Stat_t
		err = unix.Fstat(ns, &have)
		unix.Close(ns)
		if err != nil {
			return fmt.Errorf("socket %d: its netns: %w", i, err)
		}
		if have.Dev != want.Dev || have.Ino != want.Ino {
			return fmt.Errorf("socket %d was made in another netns (inode %d, the pod's is %d)", i, have.Ino, want.Ino)
		}
	}
	return nil
}

// Remove deletes what r names; whatever is already gone is not an error.
func Remove(fd int, r *Removal) error {
	return onSockets(fd, RemovalProtos(r), func(socks []int) error { return RemoveOn(socks, r) })
}

// RemovalProtos are the protocols of the sockets RemoveOn takes for r.
func RemovalProtos(r *Removal) []int { return Protos(&Batch{Routes: r.Routes}) }

// RemoveOn is Remove on sockets made in the netns already (Dial with
// RemovalProtos). The last close of an nf_tables socket that deleted
// something waits for the kernel to destroy it (an RCU grace period):
// a caller with someone waiting on it can close them afterwards.
func RemoveOn(socks []int, r *Removal) error {
	var errs []error
	for _, t := range r.Tables {
		// A batch that fails is aborted, and nf_tables' abort waits for
		// an RCU grace period before it answers (5 ms here): the delete
		// of a table that is not there (a pod outside the mesh) would
		// pay it. A get of the table does not.
		if there, err := tableThere(socks[0], t); err != nil || !there {
			if err != nil {
				errs = append(errs, fmt.Errorf("looking for a table: %w", err))
			}
			continue
		}
		if err := talk(socks[0], t, gone); err != nil {
			errs = append(errs, fmt.Errorf("deleting a table: %w", err))
		}
	}
	if len(r.Routes) > 0 {
		if err := talk(socks[1], r.Routes, gone); err != nil {
			errs = append(errs, fmt.Errorf("deleting policy routes: %w", err))
		}
	}
	return errors.Join(errs...)
}

// tableThere asks whether the table that batch deletes exists: batch's
// table delete message sent alone as a get of the same table.
func tableThere(s int, batch []byte) (bool, error) {
	const del, get = unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_DELTABLE, unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETTABLE
	for b := batch; len(b) >= unix.SizeofNlMsghdr; {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return false, errors.New("malformed removal batch")
		}
		if binary.NativeEndian.Uint16(b[4:]) == del {
			q := append([]byte(nil), b[:l]...)
			binary.NativeEndian.PutUint16(q[4:], get)
			binary.NativeEndian.PutUint16(q[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)
			absent := false
			err := talk(s, q, func(_ uint16, errno unix.Errno) bool {
				absent = errno == unix.ENOENT
				return absent
			})
			return !absent, err
		}
		b = b[min(nlmAlign(l), len(b)):]
	}
	return false, errors.New("removal batch deletes no table")
}

// SpliceReplace puts the replace messages right after the batch begin of
// tables.
func SpliceReplace(tables, replace []byte) []byte {
	begin := int(binary.NativeEndian.Uint32(tables))
	out := make([]byte, 0, len(tables)+len(replace))
	out = append(out, tables[:begin]...)
	out = append(out, replace...)
	return append(out, tables[begin:]...)
}

// ruleExists accepts an identical `ip rule` already in place (re-ADD).
func ruleExists(typ uint16, errno unix.Errno) bool {
	return errno == unix.EEXIST && typ == unix.RTM_NEWRULE
}

// gone accepts deleting what is not there.
func gone(typ uint16, errno unix.Errno) bool {
	return errno == unix.ENOENT || errno == unix.ESRCH || typ == unix.RTM_DELADDR && errno == unix.EADDRNOTAVAIL
}

// Dial opens one netlink socket per protocol inside the netns behind fd,
// entering it once for all of them; CloseAll closes them.
func Dial(fd int, protos ...int) ([]int, error) { return dialVia(InNetns, fd, protos) }

// InNetns runs f on a thread inside the netns behind fd (sockets made
// there stay there; /proc/thread-self shows that netns), on a goroutine
// of its own. If the thread could not switch back it stays locked, so the
// Go runtime retires it with the goroutine rather than run other work in
// the pod's netns.
func InNetns(fd int, f func() error) error {
	done := make(chan error, 1)
	go func() { done <- inNetnsHere(fd, f) }()
	return <-done
}

// DialHere is Dial on the calling goroutine's own thread: no goroutine is
// started and none is waited for, so no other thread is woken. If the
// thread cannot switch back, the error says so and the calling goroutine
// stays locked to it, in the pod's netns, until it ends: it can still
// work on descriptors it holds, and the Go runtime makes new threads from
// a clean one, never from a locked thread.
func DialHere(fd int, protos ...int) ([]int, error) { return dialVia(inNetnsHere, fd, protos) }

// dialVia opens the sockets inside the netns behind fd, entered by enter.
func dialVia(enter func(fd int, f func() error) error, fd int, protos []int) ([]int, error) {
	var socks []int
	err := enter(fd, func() error {
		var err error
		socks, err = openSockets(protos)
		return err
	})
	if err != nil {
		CloseAll(socks)
		return nil, err
	}
	return socks, nil
}

// inNetnsHere runs f on this goroutine's thread, locked to it, inside the
// netns behind fd, and switches back. It unlocks the thread only once the
// thread is back in its own netns.
func inNetnsHere(fd int, f func() error) error {
	runtime.LockOSThread()
	self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("opening this thread's netns: %w", err)
	}
	defer unix.Close(self)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering the pod's netns: %w", err)
	}
	ferr := f()
	if serr := unix.Setns(self, unix.CLONE_NEWNET); serr != nil {
		return fmt.Errorf("leaving the pod's netns: %w", serr) // still locked
	}
	runtime.UnlockOSThread()
	return ferr
}

func openSockets(protos []int) ([]int, error) {
	var socks []int
	for _, p := range protos {
		s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, p)
		if err != nil {
			CloseAll(socks)
			return nil, fmt.Errorf("netlink socket: %w", err)
		}
		socks = append(socks, s)
		// Errors come back with the kernel's explanation and without a
		// copy of the (possibly long) message that failed.
		_ = unix.SetsockoptInt(s, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
		_ = unix.SetsockoptInt(s, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
		// The kernel answers before sendto returns; this only bounds a
		// message that never gets its ack.
		_ = unix.SetsockoptTimeval(s, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 2})
	}
	return socks, nil
}

func CloseAll(socks []int) {
	for _, s := range socks {
		unix.Close(s)
	}
}

// NetlinkError is an error the kernel answered a message with.
type NetlinkError struct {
	Errno unix.Errno
	// Type is the message type that failed (e.g. NFT_MSG_NEWRULE).
	Type uint16
	// Msg is the kernel's extended ack message, when it gave one.
	Msg string
}

func (e *NetlinkError) Error() string {
	s := fmt.Sprintf("%s (message type %#x)", e.Errno.Error(), e.Type)
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

func (e *NetlinkError) Unwrap() error { return e.Errno }

// talk sends msgs in one sendto and reads the answers until the one ack
// asked for (the message flagged NLM_F_ACK) or an error that accept does
// not take: every error is reported before that ack, in message order.
func talk(s int, msgs []byte, accept func(typ uint16, errno unix.Errno) bool) error {
	ackSeq, types, err := scan(msgs)
	if err != nil {
		return err
	}
	if len(msgs) > defaultSndbuf/2 {
		// A batch larger than the socket's send buffer (a ruleset with
		// thousands of ranges) goes in one datagram all the same, as nft
		// sends it: the buffer is raised to fit (SO_SNDBUFFORCE, root).
		// The kernel doubles what it is given for its own bookkeeping.
		if err := unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, len(msgs)); err != nil {
			return fmt.Errorf("raising the netlink send buffer to %d bytes: %w", len(msgs), err)
		}
	}
	if err := unix.Sendto(s, msgs, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("sendto: %w", err)
	}
	// Answers are small (NETLINK_CAP_ACK: an error quotes only the failed
	// message's header), so a small buffer on the stack takes the usual
	// one; a larger datagram is measured first and read whole.
	var small [512]byte
	for {
		buf := small[:]
		n, _, err := unix.Recvfrom(s, buf, unix.MSG_PEEK|unix.MSG_TRUNC)
		if err == nil && n > len(buf) {
			buf = make([]byte, n)
		}
		if err == nil {
			n, _, err = unix.Recvfrom(s, buf, 0)
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("waiting for the kernel's ack: %w", err)
		}
		for b := buf[:n]; len(b) >= unix.SizeofNlMsghdr; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.SizeofNlMsghdr || l > len(b) {
				return errors.New("malformed netlink answer")
			}
			m := b[:l]
			b = b[min(nlmAlign(l), len(b)):]
			if binary.NativeEndian.Uint16(m[4:]) != unix.NLMSG_ERROR || l < unix.SizeofNlMsghdr+4+unix.SizeofNlMsghdr {
				continue // nothing else is asked for
			}
			errno := unix.Errno(-int32(binary.NativeEndian.Uint32(m[16:])))
			seq := binary.NativeEndian.Uint32(m[20+8:])
			if errno != 0 && (accept == nil || !accept(types.of(seq), errno)) {
				return &NetlinkError{Errno: errno, Type: types.of(seq), Msg: extAck(m)}
			}
			if seq == ackSeq {
				return nil
			}
		}
	}
}

// defaultSndbuf is the kernel's default socket send buffer
// (net.core.wmem_default); batches under half of it need no raise.
const defaultSndbuf = 212992

// scan reads the headers of msgs: the sequence number of the message that
// asks for an ack, and every message's type by sequence number.
func scan(msgs []byte) (uint32, msgTypes, error) {
	var types msgTypes
	var ack uint32
	found := false
	for b := msgs; len(b) > 0; {
		if len(b) < unix.SizeofNlMsghdr {
			return 0, nil, errors.New("truncated netlink batch")
		}
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return 0, nil, errors.New("malformed netlink batch")
		}
		seq := binary.NativeEndian.Uint32(b[8:])
		types = append(types, msgType{seq, binary.NativeEndian.Uint16(b[4:])})
		if binary.NativeEndian.Uint16(b[6:])&unix.NLM_F_ACK != 0 {
			ack, found = seq, true
		}
		b = b[min(nlmAlign(l), len(b)):]
	}
	if !found {
		return 0, nil, errors.New("netlink batch asks for no ack")
	}
	return ack, types, nil
}

// msgTypes is each message's type by sequence number, in batch order.
type msgTypes []msgType

type msgType struct {
	seq uint32
	typ uint16
}

func (t msgTypes) of(seq uint32) uint16 {
	for _, m := range t {
		if m.seq == seq {
			return m.typ
		}
	}
	return 0
}

func nlmAlign(l int) int { return (l + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// extAck returns the NLMSGERR_ATTR_MSG text of an error answer, if any.
func extAck(m []byte) string {
	if binary.NativeEndian.Uint16(m[6:])&unix.NLM_F_ACK_TLVS == 0 {
		return ""
	}
	off := unix.SizeofNlMsghdr + 4 + unix.SizeofNlMsghdr // header, errno, the request's header (capped)
	if binary.NativeEndian.Uint16(m[6:])&unix.NLM_F_CAPPED == 0 {
		off = unix.SizeofNlMsghdr + 4 + int(binary.NativeEndian.Uint32(m[20:]))
	}
	for off+4 <= len(m) {
		l := int(binary.NativeEndian.Uint16(m[off:]))
		typ := binary.NativeEndian.Uint16(m[off+2:])
		if l < 4 || off+l > len(m) {
			break
		}
		if typ == unix.NLMSGERR_ATTR_MSG {
			return strings.TrimRight(string(m[off+4:off+l]), "\x00")
		}
		off += (l + 3) &^ 3
	}
	return ""
}
