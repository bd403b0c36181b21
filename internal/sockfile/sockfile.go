// Package sockfile binds the agent's unix sockets (the plugin's and
// ztunnel's) at their paths on the host, carefully: it is the agent's half
// of package unixsock, kept apart so that the plugin does not link package
// net.
package sockfile

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// InUseError is a socket path another live process serves.
type InUseError struct {
	Path string
	// Holder names it: "pid N (comm)" when the kernel says who, else what
	// answered.
	Holder string
}

func (e *InUseError) Error() string {
	return fmt.Sprintf("%s is served by a live process (%s): not taking it over; stop that process, or give this agent another path", e.Path, e.Holder)
}

// Listen binds path: its dir is created with dirMode, a stale socket from
// an earlier agent is removed, and the socket is made 0600. A socket some
// live process still serves (istio-cni's agent during a rollout, another
// agent with another run dir) is never removed: Listen waits up to wait
// for it to go, then fails with an *InUseError naming the process.
// Anything else at the path is an error, never replaced. Callers also
// check every peer's credentials, so the moment between bind and chmod is
// safe.
func Listen(path string, dirMode fs.FileMode, wait time.Duration) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), dirMode); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(wait)
	for {
		st, err := os.Lstat(path)
		if err != nil {
			break // nothing there
		}
		if st.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket; not removing it", path)
		}
		holder, live := served(path)
		if !live {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("removing stale socket: %w", err)
			}
			break
		}
		if time.Now().After(deadline) {
			return nil, &InUseError{Path: path, Holder: holder}
		}
		time.Sleep(100 * time.Millisecond)
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// served says whether a process listens on the socket at path, and who:
// only a refused connect (no listener bound) makes it stale. A socket of
// another type answers EPROTOTYPE, which means someone is bound there.
func served(path string) (string, bool) {
	for _, typ := range []int{unix.SOCK_SEQPACKET, unix.SOCK_STREAM, unix.SOCK_DGRAM} {
		fd, err := unix.Socket(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return err.Error(), true
		}
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		switch {
		case err == nil || errors.Is(err, unix.EAGAIN): // EAGAIN: a full backlog, still a listener
			who := "a listener"
			if cred, cerr := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED); cerr == nil && cred.Pid > 0 {
				who = fmt.Sprintf("pid %d", cred.Pid)
				if comm, rerr := os.ReadFile(fmt.Sprintf("/proc/%d/comm", cred.Pid)); rerr == nil {
					who += " (" + strings.TrimSpace(string(comm)) + ")"
				}
			}
			unix.Close(fd)
			return who, true
		case errors.Is(err, unix.EPROTOTYPE):
			unix.Close(fd)
			continue // another type: try it
		case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, unix.ENOENT):
			unix.Close(fd)
			return "", false
		default:
			unix.Close(fd)
			return err.Error(), true // cannot tell: keep it
		}
	}
	return "a socket of an unknown type", true
}
