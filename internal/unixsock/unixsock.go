// Package unixsock is the root-only SOCK_SEQPACKET plumbing the plugin's
// socket and ztunnel's share: checking a peer's credentials and reading the
// descriptors a message carries. The plugin links it, so it imports neither
// package net (its inits cost every exec of the plugin about 11 page faults)
// nor anything of the agent; binding the sockets is package sockfile's.
package unixsock

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// RequireRoot checks the peer's credentials (SO_PEERCRED) of a connection
// (an accepted *net.UnixConn): uid 0 only.
func RequireRoot(uc syscall.Conn) error { return RequireUID(uc, 0) }

// RequireUID checks that the peer runs as uid (tests that run unprivileged
// serve their own uid; the agent serves only root).
func RequireUID(uc syscall.Conn, uid uint32) error {
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = peerIs(int(fd), uid) }); err != nil {
		return err
	}
	return serr
}

// PeerIsRoot is RequireRoot on a raw socket descriptor.
func PeerIsRoot(fd int) error { return peerIs(fd, 0) }

func peerIs(fd int, uid uint32) error {
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return fmt.Errorf("reading peer credentials: %w", err)
	}
	if cred.Uid != uid {
		if uid == 0 {
			return fmt.Errorf("peer pid %d runs as uid %d, not root", cred.Pid, cred.Uid)
		}
		return fmt.Errorf("peer pid %d runs as uid %d, not %d", cred.Pid, cred.Uid, uid)
	}
	return nil
}

// Rights returns every descriptor the control messages in oob carry (the
// caller owns and must close them), and an error for anything else found
// there; the descriptors are returned even then, so they can be closed.
func Rights(oob []byte) ([]int, error) {
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
