//go:build !unit

package events

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/nftcni/nftcni/internal/testnet"
)

// Even when the socket's mode lets anyone connect, a non-root peer is cut
// off before any request is read.
func TestNonRootPeerRefused(t *testing.T) {
	testnet.RequireRoot(t)
	dir, err := os.MkdirTemp("", "nftcni-events")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	hs := serve(t, &fake{}, dir)
	for _, p := range []string{dir, filepath.Dir(hs.path), hs.path} {
		if err := os.Chmod(p, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	// The test binary sits in a root-only build dir: run a copy nobody can read.
	self, err := os.ReadFile("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "client")
	if err := os.WriteFile(exe, self, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), "NFTCNI_TEST_DIAL="+hs.path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("running the client as nobody: %v\n%s", err, out)
	}
	// Connected (the mode allowed it), then cut off: either its send hit
	// the closed socket or its read did.
	if o := string(out); !strings.HasPrefix(o, "reply: <nil>") && !strings.HasPrefix(o, "send:") {
		t.Errorf("non-root client was not cut off after connecting: %s", out)
	}
	if got := testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("connect", "rejected")); got != 1 {
		t.Errorf("rejected connections counted: %v", got)
	}
}
