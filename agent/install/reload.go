package install

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// reloadName is created and removed in the conf dir to make runtimes
// reload it. No loader reads a file without a .conf, .conflist or .json
// extension, and atomicfile's temp names do not begin like this.
const reloadName = ".nftcni-reload"

// reloadRuntimes makes the runtime read the conf dir again after a
// drop-in was written or removed. containerd's CRI watches the conf dir
// alone and ignores Create events (internal/cri/server/cni_conf_syncer.go
// in containerd 2.x), so a file that changes in a network's drop-in dir is
// never seen until something else in the conf dir changes: a fresh
// drop-in would not run, and a removed one would still be called, its
// binary gone. Removing a file in the conf dir is an event it reloads on.
func (in *Installer) reloadRuntimes() {
	p := filepath.Join(in.cfg.ConfDir, reloadName)
	err := os.Remove(p) // one a crash left: its removal is the event
	if errors.Is(err, fs.ErrNotExist) {
		var f *os.File
		if f, err = os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW, 0o600); err == nil {
			f.Close()
			err = os.Remove(p)
		}
	}
	if err != nil {
		in.log.Warn("could not make the runtime reload the CNI conf dir after a drop-in changed; it will when the conf dir next changes", "path", p, "err", err)
	}
}
