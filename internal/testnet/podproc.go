package testnet

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// PodProcess runs a process inside n in a cgroup whose path carries the pod
// UID the way kubelet's cgroupfs driver names it (kubepods/besteffort/
// pod<uid>/<container>), so a /proc scan can find the pod's netns. It
// returns once the process is both in the cgroup and in n: `ip netns exec`
// enters the netns only after it starts, and a scan that runs before that
// sees a process of the pod in the host's netns. The process and the
// cgroups go at cleanup.
func PodProcess(t testing.TB, n *NS, uid string) {
	t.Helper()
	base := "/sys/fs/cgroup/pids" // cgroup v1 (this machine kind)
	if _, err := os.Stat(base); err != nil {
		base = "/sys/fs/cgroup" // cgroup v2
	}
	cg := filepath.Join(base, "kubepods", "besteffort", "pod"+uid, "ctr1")
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", n.Name, "sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		for d := cg; d != base; d = filepath.Dir(d) {
			_ = os.Remove(d) // only empty cgroups go; shared parents stay if in use
		}
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	var want unix.Stat_t
	if err := unix.Stat(n.Path, &want); err != nil {
		t.Fatal(err)
	}
	self := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "ns", "net")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		var got unix.Stat_t
		if unix.Stat(self, &got) == nil && got.Dev == want.Dev && got.Ino == want.Ino {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod process %d never entered netns %s", cmd.Process.Pid, n.Name)
		}
	}
}
