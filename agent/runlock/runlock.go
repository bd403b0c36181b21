// Package runlock makes one agent the owner of a run dir: an exclusive
// flock on <run dir>/agent.lock, taken before any socket is touched, so a
// second agent on the same dir stops with the first one's PID instead of
// replacing its live sockets (and removing them when it stops).
package runlock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Name is the lock file in the run dir.
const Name = "agent.lock"

// Lock is a held run dir lock; the kernel drops it when the process ends,
// however it ends.
type Lock struct{ f *os.File }

// HeldError is another process holding the lock.
type HeldError struct {
	Dir string
	PID int // 0: unknown
}

func (e *HeldError) Error() string {
	who := "another nftcni-agent"
	if e.PID > 0 {
		who = fmt.Sprintf("another nftcni-agent (pid %d)", e.PID)
	}
	return fmt.Sprintf("%s holds the run dir %s; its sockets are left as they are: stop it first, or give this agent its own --run-dir", who, e.Dir)
}

// Acquire takes the lock, creating the run dir (0750) and the lock file
// (0600, never through a symlink) as needed, and writes our PID into it.
func Acquire(dir string) (*Lock, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, Name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening the run dir lock %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			b := make([]byte, 32)
			n, _ := f.ReadAt(b, 0)
			pid, _ := strconv.Atoi(strings.TrimSpace(string(b[:n])))
			return nil, &HeldError{Dir: dir, PID: pid}
		}
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &Lock{f: f}, nil
}

// Release drops the lock. The file stays: removing it would let a third
// agent lock a new file while a second still waits on the old one.
func (l *Lock) Release() error { return l.f.Close() }
