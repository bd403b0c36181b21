package integration

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/testnet"
)

// execClock times runs of chosen binaries from their exec to their exit on
// the kernel's clock, through the kernel's process events connector
// (linux/cn_proc.h): what a chained plugin costs inside a runtime that does
// not let the benchmark wrap its exec, as timedExec does for libcni.
// x/sys has no types for the connector; the few fields read are below.
type execClock struct {
	fd    int
	names map[string]bool // binary base names to time
	stop  atomic.Bool
	done  chan struct{}

	mu      sync.Mutex
	changed *sync.Cond
	running map[uint32]execRun // by tgid, from exec
	runs    []execRun          // finished
	lost    int                // datagrams the kernel dropped (ENOBUFS)
}

// execRun is one run of a binary, both ends on CLOCK_MONOTONIC.
type execRun struct {
	name       string
	exec, exit int64
}

// The connector's constants (linux/connector.h, linux/cn_proc.h).
const (
	cnIdxProc         = 1
	cnValProc         = 1
	procCnMcastListen = 1
	procCnMcastIgnore = 2
	procEventExec     = 0x00000002
	procEventExit     = 0x80000000
	cnMsgLen          = 20 // struct cn_msg without its data
)

// newExecClock starts listening; it stops when tb ends.
func newExecClock(tb testing.TB, names ...string) *execClock {
	tb.Helper()
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_CONNECTOR)
	if err != nil {
		tb.Fatalf("process events connector: %v", err)
	}
	c := &execClock{fd: fd, names: map[string]bool{}, done: make(chan struct{}), running: map[uint32]execRun{}}
	c.changed = sync.NewCond(&c.mu)
	for _, n := range names {
		c.names[n] = true
	}
	// Every exec and exit on the machine comes here: room for bursts, and
	// a read timeout so the reader sees stop.
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
	tv := unix.NsecToTimeval(int64(100 * time.Millisecond))
	err = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err == nil {
		err = unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: cnIdxProc})
	}
	if err == nil {
		err = c.control(procCnMcastListen)
	}
	if err != nil {
		unix.Close(fd)
		tb.Fatalf("process events connector: %v", err)
	}
	go c.read()
	tb.Cleanup(func() {
		_ = c.control(procCnMcastIgnore)
		c.stop.Store(true)
		<-c.done
		unix.Close(fd)
	})
	return c
}

// control sends the connector a listen or ignore request.
func (c *execClock) control(op uint32) error {
	ne := binary.NativeEndian
	m := make([]byte, unix.SizeofNlMsghdr+cnMsgLen+4)
	ne.PutUint32(m[0:], uint32(len(m)))
	ne.PutUint16(m[4:], unix.NLMSG_DONE)
	ne.PutUint32(m[12:], uint32(os.Getpid()))
	cn := m[unix.SizeofNlMsghdr:]
	ne.PutUint32(cn[0:], cnIdxProc)
	ne.PutUint32(cn[4:], cnValProc)
	ne.PutUint16(cn[16:], 4)
	ne.PutUint32(cn[cnMsgLen:], op)
	return unix.Sendto(c.fd, m, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

func (c *execClock) read() {
	defer close(c.done)
	ne := binary.NativeEndian
	buf := make([]byte, 64<<10)
	for !c.stop.Load() {
		n, err := unix.Read(c.fd, buf)
		if errors.Is(err, unix.ENOBUFS) {
			c.mu.Lock()
			c.lost++
			c.mu.Unlock()
			continue
		}
		if err != nil { // the read timeout, or the socket is done
			continue
		}
		// One proc_event per datagram: what, cpu, timestamp_ns, then the
		// event's pid and tgid.
		ev := buf[min(n, unix.SizeofNlMsghdr+cnMsgLen):n]
		if len(ev) < 24 {
			continue
		}
		what, ts, pid, tgid := ne.Uint32(ev), int64(ne.Uint64(ev[8:])), ne.Uint32(ev[16:]), ne.Uint32(ev[20:])
		switch {
		case what == procEventExec:
			// The plugin lives milliseconds; its exe link is there now.
			// A binary replaced since (an agent reinstalling its plugin)
			// reads "<path> (deleted)".
			exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", tgid))
			name := filepath.Base(strings.TrimSuffix(exe, " (deleted)"))
			if err == nil && c.names[name] {
				c.mu.Lock()
				c.running[tgid] = execRun{name: name, exec: ts}
				c.mu.Unlock()
			}
		case what == procEventExit && pid == tgid:
			c.mu.Lock()
			if r, ok := c.running[tgid]; ok {
				delete(c.running, tgid)
				r.exit = ts
				c.runs = append(c.runs, r)
				c.changed.Broadcast()
			}
			c.mu.Unlock()
		}
	}
}

// monotonic is now on the clock the kernel stamps events with.
func monotonic() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// run returns how long the one run of name that exec'd between from and
// to (monotonic) took, waiting up to wait for its exit event if it is
// still on its way, and forgets every run that ended before to.
func (c *execClock) run(name string, from, to int64, wait time.Duration) (time.Duration, error) {
	deadline := time.Now().Add(wait)
	timer := time.AfterFunc(wait, func() { c.mu.Lock(); c.changed.Broadcast(); c.mu.Unlock() })
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		var found []execRun
		kept := c.runs[:0]
		for _, r := range c.runs {
			if r.name == name && r.exec >= from && r.exec <= to {
				found = append(found, r)
			} else if r.exit > to {
				kept = append(kept, r)
			}
		}
		c.runs = kept
		switch {
		case len(found) == 1:
			return time.Duration(found[0].exit - found[0].exec), nil
		case len(found) > 1:
			return 0, fmt.Errorf("%d runs of %s in one call", len(found), name)
		case time.Now().After(deadline):
			return 0, fmt.Errorf("no run of %s seen (%d event datagrams lost)", name, c.lost)
		}
		c.changed.Wait()
	}
}

func TestExecClockTimesARun(t *testing.T) {
	testnet.RequireRoot(t)
	dir := t.TempDir()
	sleeper := filepath.Join(dir, "sleeper")
	copyFile(t, "/bin/sleep", sleeper)
	c := newExecClock(t, "sleeper")
	from := monotonic()
	if err := exec.Command(sleeper, "0.05").Run(); err != nil {
		t.Fatal(err)
	}
	to := monotonic()
	took, err := c.run("sleeper", from, to, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if took < 50*time.Millisecond || took > time.Duration(to-from) {
		t.Fatalf("sleeper 0.05 took %v by the exec clock; the call around it took %v", took, time.Duration(to-from))
	}
	if _, err := c.run("sleeper", from, to, 100*time.Millisecond); err == nil {
		t.Fatal("the same run was returned twice")
	}
}
