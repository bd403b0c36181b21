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

// Scanner walks a /proc tree.
type Scanner struct {
	Proc string // "/proc", or a test's copy
	// Host is the host netns; a process in it is never taken for a pod's.
	Host *os.File
}

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
	ents, err := os.ReadDir(s.Proc)
	if err != nil {
		return nil, err
	}
	tried := map[uint64]bool{} // netns inodes already checked
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		dir := filepath.Join(s.Proc, e.Name())
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		if err != nil || UIDFromCgroup(string(cg)) != uid {
			continue
		}
		f, err := os.Open(filepath.Join(dir, "ns", "net"))
		if err != nil {
			continue // the process exited, or is not ours to see
		}
		var st unix.Stat_t
		if unix.Fstat(int(f.Fd()), &st) != nil || tried[st.Ino] || (s.Host != nil && st.Dev == host.Dev && st.Ino == host.Ino) {
			f.Close()
			continue
		}
		tried[st.Ino] = true
		if netnsaddr.Holds(f, ips...) {
			return f, nil
		}
		f.Close()
	}
	return nil, fmt.Errorf("%w (uid %s, %v)", ErrNotFound, uid, ips)
}
