package testnet

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// PodProcess runs a process inside n in a cgroup whose path carries the pod
// UID the way kubelet's cgroupfs driver names it (kubepods/besteffort/
// pod<uid>/<container>), so a /proc scan can find the pod's netns. The
// process and the cgroups go at cleanup.
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
}
