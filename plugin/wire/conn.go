package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// maxFDs is how many descriptors one message may carry before the rest are
// refused; every message carries at most one.
const maxFDs = 4

// Conn is one plugin<->agent connection.
type Conn struct {
	uc *net.UnixConn
}

// NewConn wraps an accepted or dialled SOCK_SEQPACKET unix connection.
func NewConn(uc *net.UnixConn) *Conn { return &Conn{uc: uc} }

// Dial connects to the agent's socket within timeout and checks that the
// process listening there is root: a socket path is only as trustworthy as
// whoever bound it.
func Dial(path string, timeout time.Duration) (*Conn, error) {
	d := net.Dialer{Timeout: timeout}
	c, err := d.Dial("unixpacket", path)
	if err != nil {
		return nil, err
	}
	uc := c.(*net.UnixConn)
	if err := RequireRoot(uc); err != nil {
		uc.Close()
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	return NewConn(uc), nil
}

// RequireRoot checks the peer's credentials (SO_PEERCRED): uid 0 only.
func RequireRoot(uc *net.UnixConn) error {
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("reading peer credentials: %w", serr)
	}
	if cred.Uid != 0 {
		return fmt.Errorf("peer pid %d runs as uid %d, not root", cred.Pid, cred.Uid)
	}
	return nil
}

// SetDeadline bounds every following Send and Recv.
func (c *Conn) SetDeadline(t time.Time) error { return c.uc.SetDeadline(t) }

// Close closes the connection.
func (c *Conn) Close() error { return c.uc.Close() }

// Send writes one message, with fd attached when it is not nil.
func (c *Conn) Send(m *Message, fd *os.File) error {
	b, err := Encode(m)
	if err != nil {
		return err
	}
	var oob []byte
	if fd != nil {
		oob = unix.UnixRights(int(fd.Fd()))
	}
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("sending %s: %w", m.Kind, err)
	}
	return nil
}

// ErrTooLarge is returned for a message longer than MaxMessage.
var ErrTooLarge = errors.New("message exceeds the size limit")

// Recv reads one message and the fd that came with it, if any (the caller
// closes it). io.EOF means the peer closed. Extra descriptors are closed
// here, so a hostile peer cannot make us leak them.
func (c *Conn) Recv() (*Message, *os.File, error) {
	buf := make([]byte, MaxMessage+1)
	oob := make([]byte, unix.CmsgSpace(maxFDs*4))
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
	fds, perr := parseRights(oob[:oobn])
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	if n == 0 && oobn == 0 {
		return nil, nil, io.EOF
	}
	switch {
	case perr != nil:
		err = perr
	case flags&unix.MSG_TRUNC != 0 || n > MaxMessage:
		err = ErrTooLarge
	case flags&unix.MSG_CTRUNC != 0 || len(fds) > 1:
		err = fmt.Errorf("message carried more than one descriptor")
	}
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	m, err := Decode(buf[:n])
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	var f *os.File
	if len(fds) == 1 {
		f = os.NewFile(uintptr(fds[0]), "netns")
	}
	return m, f, nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("parsing control message: %w", err)
	}
	var fds []int
	var bad error
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			bad = fmt.Errorf("unexpected control message (level %d type %d)", msgs[i].Header.Level, msgs[i].Header.Type)
			continue
		}
		fds = append(fds, got...)
	}
	return fds, bad
}
