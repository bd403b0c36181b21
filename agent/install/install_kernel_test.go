//go:build !unit

package install

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
)

func TestOwnerAndModeAreKept(t *testing.T) {
	testnet.RequireRoot(t)
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n.put(t, "10-calico.conflist", orig, 0o600)
	p := filepath.Join(n.conf, "10-calico.conflist")
	if err := os.Chown(p, 1234, 2345); err != nil {
		t.Fatal(err)
	}
	in := n.installer(t, Chained, "")
	if _, err := in.Install(); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 1234 || st.Gid != 2345 || st.Mode&0o7777 != 0o600 {
			t.Errorf("%s: owner %d:%d mode %o, want 1234:2345 600", when, st.Uid, st.Gid, st.Mode&0o7777)
		}
	}
	check("after install")
	if err := in.Uninstall(); err != nil {
		t.Fatal(err)
	}
	check("after uninstall")
}

func TestReadOnlyBinDirGivesAHint(t *testing.T) {
	testnet.RequireRoot(t)
	n := newNode(t)
	if err := syscall.Mount("tmpfs", n.bin, "tmpfs", syscall.MS_RDONLY, "size=1m"); err != nil {
		t.Skipf("cannot mount a read-only tmpfs here: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(n.bin, 0) })
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n.put(t, "10-calico.conflist", orig, 0o644)
	_, err := n.installer(t, Chained, "").Install()
	if err == nil || !strings.Contains(err.Error(), "read-only") || !strings.Contains(err.Error(), "/home/kubernetes/bin") {
		t.Fatalf("err = %v", err)
	}
	if !bytes.Equal(n.read(t, "10-calico.conflist"), orig) {
		t.Error("config was written although the binary could not be installed")
	}
}
