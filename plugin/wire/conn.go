package wire

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/unixsock"
)

// maxFDs is how many descriptors one message may carry before the rest are
// refused: a decision carries two sockets, any other message at most one
// netns.
const maxFDs = 4

// Conn is one plugin<->agent connection. The agent's end is an accepted
// connection served by Go's poller, one goroutine per connection. The
// plugin's end (Dial) is a plain blocking socket: the plugin has one
// conversation and nothing else to do meanwhile, and a thread asleep in
// recvmsg is woken by the kernel directly, where the poller's wake-up
// through epoll and the scheduler costs a freshly exec'd process about
// 0.1 ms per answer here.
type Conn struct {
	uc       PollConn        // the agent's end
	rc       syscall.RawConn // uc's descriptor, on the poller
	fd       int             // the plugin's end, when uc is nil
	deadline time.Time       // the plugin's end: SetDeadline's
}

// PollConn is the agent's end of a connection, an accepted *net.UnixConn.
// This package reads and writes it through its raw descriptor on the
// poller rather than through package net's methods: the plugin links this
// package, and package net's inits would cost each of its execs about 11
// page faults.
type PollConn interface {
	syscall.Conn
	SetDeadline(time.Time) error
	Close() error
}

// NewConn wraps an accepted SOCK_SEQPACKET unix connection.
func NewConn(uc PollConn) (*Conn, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &Conn{uc: uc, rc: rc}, nil
}

// Dial connects to the agent's socket within timeout and checks that the
// process listening there is root: a socket path is only as trustworthy as
// whoever bound it.
func Dial(path string, timeout time.Duration) (*Conn, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	c := &Conn{fd: fd}
	// A unix connect waits for room in the listener's backlog for as long
	// as the send timeout allows.
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		c.Close()
		return nil, err
	}
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		c.Close()
		return nil, fmt.Errorf("dial unixpacket %s: %w", path, os.NewSyscallError("connect", err))
	}
	if err := unixsock.PeerIsRoot(fd); err != nil {
		c.Close()
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	return c, nil
}

// SetDeadline bounds every following Send and Recv.
func (c *Conn) SetDeadline(t time.Time) error {
	if c.uc != nil {
		return c.uc.SetDeadline(t)
	}
	c.deadline = t
	return c.arm(unix.SO_SNDTIMEO)
}

// arm sets the blocking socket's timeout opt (SO_RCVTIMEO or SO_SNDTIMEO)
// to what is left until the deadline: the kernel's timeouts are per call,
// the deadline is for the whole conversation.
func (c *Conn) arm(opt int) error {
	if c.deadline.IsZero() {
		return nil
	}
	left := time.Until(c.deadline)
	if left <= 0 {
		return os.ErrDeadlineExceeded
	}
	tv := unix.NsecToTimeval(left.Nanoseconds())
	return unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, opt, &tv)
}

// Deadline is the plugin's end's deadline as SetDeadline set it, in Unix
// nanoseconds (0: none).
func (c *Conn) Deadline() int64 {
	if c.deadline.IsZero() {
		return 0
	}
	return c.deadline.UnixNano()
}

// Close closes the connection.
func (c *Conn) Close() error {
	if c.uc != nil {
		return c.uc.Close()
	}
	return unix.Close(c.fd)
}

// Send writes one message, with fd attached when it is not nil.
func (c *Conn) Send(m *Message, fd *os.File) error { return c.SendWith(m, fdsOf(fd)) }

// SendWith writes one message with fds attached (none when empty): the
// agent's decision carries the pod's netlink sockets.
func (c *Conn) SendWith(m *Message, fds []int) error {
	b, err := Encode(m)
	if err != nil {
		return err
	}
	return c.SendBytes(b, fds, m.Kind)
}

func fdsOf(f *os.File) []int {
	if f == nil {
		return nil
	}
	return []int{int(f.Fd())}
}

// SendBytes writes one encoded message of kind (for errors), with fds
// attached (none when empty).
func (c *Conn) SendBytes(b []byte, fds []int, kind Kind) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("%w: %s message of %d bytes, over the %d-byte limit", ErrTooLarge, kind, len(b), MaxMessage)
	}
	if len(fds) > maxFDs {
		return fmt.Errorf("%s message with %d descriptors exceeds the limit of %d", kind, len(fds), maxFDs)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	var err error
	if c.uc != nil {
		err = c.onPoller(c.rc.Write, func(fd int) error { return unix.Sendmsg(fd, b, oob, nil, unix.MSG_DONTWAIT) })
	} else if err = c.arm(unix.SO_SNDTIMEO); err == nil {
		err = retry(func() error { return unix.Sendmsg(c.fd, b, oob, nil, 0) })
	}
	if err != nil {
		return fmt.Errorf("sending %s: %w", kind, timeout(err))
	}
	return nil
}

// ErrTooLarge is returned for a message longer than MaxMessage.
var ErrTooLarge = errors.New("message exceeds the size limit")

// Recv reads one message and the fd that came with it, if any (the caller
// closes it). io.EOF means the peer closed. Extra descriptors are closed
// here, so a hostile peer cannot make us leak them.
func (c *Conn) Recv() (*Message, *os.File, error) {
	b, fds, err := c.RecvBytes()
	if err == nil && len(fds) > 1 {
		err = errors.New("message carried more than one descriptor")
	}
	var m *Message
	if err == nil {
		m, err = Decode(b)
	}
	if err != nil {
		CloseAll(fds)
		return nil, nil, err
	}
	var f *os.File
	if len(fds) == 1 {
		f = os.NewFile(uintptr(fds[0]), "netns")
	}
	return m, f, nil
}

// CloseAll closes descriptors RecvBytes handed over.
func CloseAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// RecvBytes is Recv without decoding the message, with every descriptor
// that came with it (at most maxFDs; the caller closes them). They stay
// plain descriptors: the plugin writes on its sockets with raw calls, and
// an os.File costs a syscall and a cleanup for each.
func (c *Conn) RecvBytes() ([]byte, []int, error) {
	size, err := c.nextSize()
	if err != nil {
		return nil, nil, err
	}
	buf := make([]byte, min(size, MaxMessage)+1) // +1: a longer message shows as truncated
	oob := make([]byte, unix.CmsgSpace(maxFDs*4))
	var n, oobn, flags int
	if c.uc != nil {
		err = c.onPoller(c.rc.Read, func(fd int) (err error) {
			n, oobn, flags, _, err = unix.Recvmsg(fd, buf, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
			return err
		})
	} else {
		err = retry(func() (err error) {
			n, oobn, flags, _, err = unix.Recvmsg(c.fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
			return err
		})
	}
	fds, perr := unixsock.Rights(oob[:oobn])
	if err != nil {
		CloseAll(fds)
		return nil, nil, timeout(err)
	}
	if n == 0 && oobn == 0 {
		return nil, nil, io.EOF
	}
	switch {
	case perr != nil:
		err = perr
	case flags&unix.MSG_TRUNC != 0 || n > MaxMessage:
		err = ErrTooLarge
	case flags&unix.MSG_CTRUNC != 0:
		err = fmt.Errorf("message carried more than %d descriptors", maxFDs)
	}
	if err != nil {
		CloseAll(fds)
		return nil, nil, err
	}
	return buf[:n], fds, nil
}

// nextSize waits for the next message (within the deadline) and returns
// its length without reading it, so a buffer of that size is allocated
// rather than one of MaxMessage: in the freshly exec'd plugin a 64 KiB
// buffer costs its page faults.
func (c *Conn) nextSize() (int, error) {
	peek := func(fd int, flags int) (int, error) {
		var b [1]byte
		n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_PEEK|unix.MSG_TRUNC|flags)
		return n, err
	}
	if c.uc == nil {
		if err := c.arm(unix.SO_RCVTIMEO); err != nil {
			return 0, err
		}
		var n int
		err := retry(func() (err error) { n, err = peek(c.fd, 0); return err })
		return n, timeout(err)
	}
	var n int
	err := c.onPoller(c.rc.Read, func(fd int) (err error) { n, err = peek(fd, unix.MSG_DONTWAIT); return err })
	return n, err
}

// onPoller runs a non-blocking socket call on the agent's end through
// dir (its RawConn's Read or Write), which parks the goroutine on the
// poller until the socket is ready or the deadline passes.
func (c *Conn) onPoller(dir func(func(uintptr) bool) error, call func(fd int) error) error {
	var err error
	if perr := dir(func(fd uintptr) bool {
		err = retry(func() error { return call(int(fd)) })
		return !errors.Is(err, unix.EAGAIN)
	}); perr != nil {
		return perr
	}
	return err
}

// retry repeats a blocking socket call the Go runtime's signals interrupt.
func retry(f func() error) error {
	for {
		if err := f(); !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// timeout turns a blocking socket's expired timeout into the error a
// deadline gives on the agent's end.
func timeout(err error) error {
	if errors.Is(err, unix.EAGAIN) {
		return os.ErrDeadlineExceeded
	}
	return err
}
