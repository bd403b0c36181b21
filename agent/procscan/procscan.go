// Package procscan finds the network namespace of a pod that is already
// running, for pods the agent never saw an ADD for (they started before
// it): the pod UID is read from each process's cgroup path, the process's
// netns is opened, and it is accepted only if it holds one of the pod's
// addresses and is not the host's (istio#55139).
//
// cgroup paths carry the UID in every layout kubelet makes: cgroup v1 and
// v2, the cgroupfs driver (".../kubepods/besteffort/pod<uid>/<container>")
// and the systemd driver (".../kubepods-besteffort-pod<uid with _>.slice/
// cri-containerd-<id>.scope" or "crio-<id>.scope").
package procscan

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nftcni/nftcni/internal/netnsaddr"
	"golang.org/x/sys/unix"
)

// ErrNotFound: no process of the pod runs in a netns holding its IPs.
var ErrNotFound = errors.New("no netns found for the pod")

var podUID = regexp.MustCompile(`pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})`)

// UIDFromCgroup returns the pod UID in a /proc/<pid>/cgroup file's text,
// or "".
func UIDFromCgroup(text string) string {
	for _, line := range strings.Split(text, "\n") {
		// hierarchy-ID:controllers:path
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || !strings.Contains(parts[2], "kubepods") {
			continue
		}
		if m := podUID.FindStringSubmatch(parts[2]); m != nil {
			return strings.ReplaceAll(m[1], "_", "-")
		}
	}
	return ""
}

// Scanner walks a /proc tree. One walk indexes every pod's processes by
// pod UID, and serves the Finds that follow for up to a second: at a
// start that adopts hundreds of pods, a walk per pod (reading every
// process's cgroup file each time) was the whole cost of the handover.
// A pod not in the index, or whose indexed processes are gone, is looked
// for in a fresh walk; a candidate's cgroup is read again before its netns
// is taken, so a PID reused since the walk is never mistaken for the pod.
type Scanner struct {
	Proc string // "/proc", or a test's copy
	// Host is the host netns; a process in it is never taken for a pod's.
	Host *os.File

	mu      sync.Mutex
	index   map[string][]string // pod UID -> /proc/<pid> dirs
	indexed time.Time           // when the walk that made index began
}

// indexMaxAge is how long one walk of /proc serves Finds.
const indexMaxAge = time.Second

// Find returns an open descriptor of the pod's netns.
func (s *Scanner) Find(uid string, ips []netip.Addr) (*os.File, error) {
	if uid == "" || len(ips) == 0 {
		return nil, fmt.Errorf("%w: need the pod's UID and an address", ErrNotFound)
	}
	var host unix.Stat_t
	if s.Host != nil {
		if err := unix.Fstat(int(s.Host.Fd()), &host); err != nil {
			return nil, err
		}
	}
	asked := time.Now()
	dirs, fresh, err := s.processes(uid, time.Time{})
	if err != nil {
		return nil, err
	}
	if f := s.netnsOf(uid, ips, dirs, &host, map[uint64]bool{}); f != nil {
		return f, nil
	}
	if !fresh { // the pod may have started since the walk
		if dirs, _, err = s.processes(uid, asked); err != nil {
			return nil, err
		}
		if f := s.netnsOf(uid, ips, dirs, &host, map[uint64]bool{}); f != nil {
			return f, nil
		}
	}
	return nil, fmt.Errorf("%w (uid %s, %v)", ErrNotFound, uid, ips)
}

// processes is the pod's /proc/<pid> dirs from a walk that began after
// notBefore and is less than indexMaxAge old, walking again if there is
// none; fresh says whether this call walked.
func (s *Scanner) processes(uid string, notBefore time.Time) (dirs []string, fresh bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.index == nil || s.indexed.Before(notBefore) || time.Since(s.indexed) > indexMaxAge {
		began := time.Now()
		index, err := s.walk()
		if err != nil {
			return nil, false, err
		}
		s.index, s.indexed, fresh = index, began, true
	}
	return s.index[uid], fresh, nil
}

// walk reads every process's cgroup once and indexes pods' processes.
func (s *Scanner) walk() (map[string][]string, error) {
	ents, err := os.ReadDir(s.Proc)
	if err != nil {
		return nil, err
	}
	index := map[string][]string{}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		dir := filepath.Join(s.Proc, e.Name())
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		if err != nil {
			continue
		}
		if uid := UIDFromCgroup(string(cg)); uid != "" {
			index[uid] = append(index[uid], dir)
		}
	}
	return index, nil
}

// netnsOf opens the netns of the first of dirs that is still the pod's
// process, is not the host's netns, and holds one of ips; tried holds the
// netns inodes already checked.
func (s *Scanner) netnsOf(uid string, ips []netip.Addr, dirs []string, host *unix.Stat_t, tried map[uint64]bool) *os.File {
	for _, dir := range dirs {
		f, err := os.Open(filepath.Join(dir, "ns", "net"))
		if err != nil {
			continue // the process exited, or is not ours to see
		}
		// Still the pod's: the PID was not reused since the walk.
		if cg, err := os.ReadFile(filepath.Join(dir, "cgroup")); err != nil || UIDFromCgroup(string(cg)) != uid {
			f.Close()
			continue
		}
		var st unix.Stat_t
		if unix.Fstat(int(f.Fd()), &st) != nil || tried[st.Ino] || (s.Host != nil && st.Dev == host.Dev && st.Ino == host.Ino) {
			f.Close()
			continue
		}
		tried[st.Ino] = true
		if netnsaddr.Holds(f, ips...) {
			return f
		}
		f.Close()
	}
	return nil
}
