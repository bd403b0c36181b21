package install

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/templates"
)

// Uninstall removes everything any mode may have added, so it also cleans up
// after a mode switch: our entry from every list in the conf dir (restoring a
// converted .conf from its backup), our owned and standalone files, our
// drop-in files, and then the plugin binary. Config goes before the binary so
// that no runtime is left with a config naming a missing plugin. Things
// already gone are not errors.
func (in *Installer) Uninstall() error {
	in.mu.Lock()
	defer in.mu.Unlock()
	err := errors.Join(in.removeConfig(""), in.removeBinaries())
	in.written = map[string][32]byte{}
	return err
}

// RemoveOtherModes clears what other modes left behind (after the operator
// switched mode), so the plugin never runs twice in one chain.
func (in *Installer) RemoveOtherModes() error {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.removeConfig(in.cfg.Mode)
}

// removeConfig removes the artifacts of every mode except keep.
func (in *Installer) removeConfig(keep Mode) error {
	var errs []error
	if keep != Owned {
		errs = append(errs, in.removeOwnFile(in.ownedName()), in.removeOwnFile(DefaultOwnedName))
	}
	if keep != Standalone {
		errs = append(errs, in.removeOwnFile(in.standaloneName()), in.removeOwnFile(DefaultStandaloneName))
	}
	if keep != DropIn {
		errs = append(errs, in.removeDropIns())
	}
	if keep != Chained {
		errs = append(errs, in.removeChainedEntries())
	}
	return errors.Join(errs...)
}

// removeOwnFile deletes one of our own files, but only if it still carries
// our entry: a file of that name written by someone else stays.
func (in *Installer) removeOwnFile(name string) error {
	p := filepath.Join(in.cfg.ConfDir, name)
	data, err := conflist.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if len(conflist.Entries(data, templates.PluginType)) == 0 {
		return nil
	}
	in.log.Info("removing nftcni config", "path", p)
	delete(in.written, p)
	return atomicfile.RemoveFile(p)
}

func (in *Installer) removeDropIns() error {
	ents, err := os.ReadDir(in.cfg.ConfDir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	var errs []error
	removed := false
	defer func() {
		if removed {
			in.reloadRuntimes()
		}
	}()
	for _, e := range ents {
		if !e.IsDir() { // a symlinked dir is not a dir here and is left alone
			continue
		}
		dir := filepath.Join(in.cfg.ConfDir, e.Name())
		p := filepath.Join(dir, DropInFileName)
		data, err := conflist.ReadFile(p)
		if err != nil || gjson.GetBytes(data, "type").Str != templates.PluginType {
			continue
		}
		in.log.Info("removing nftcni drop-in", "path", p)
		errs = append(errs, atomicfile.RemoveFile(p))
		removed = true
		_ = os.Remove(dir) // only succeeds when empty: the dir was ours alone
	}
	return errors.Join(errs...)
}

// removeChainedEntries takes our entry out of every list in the conf dir.
// A list we made from a single-plugin .conf is replaced by its backup.
func (in *Installer) removeChainedEntries() error {
	var errs []error
	restored := map[string]bool{}
	ents, err := os.ReadDir(in.cfg.ConfDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, e := range ents { // backups first: they decide what a converted list becomes
		if !strings.HasSuffix(e.Name(), BackupSuffix) || !e.Type().IsRegular() {
			continue
		}
		if err := in.restoreBackup(filepath.Join(in.cfg.ConfDir, e.Name()), restored); err != nil {
			errs = append(errs, err)
		}
	}
	valid, _, err := conflist.Scan(in.cfg.ConfDir, in.ours)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, c := range valid {
		if c.Kind != conflist.List || restored[c.Path] || len(conflist.Entries(c.Data, templates.PluginType)) == 0 {
			continue
		}
		out, _, err := conflist.RemoveEntries(c.Data, templates.PluginType)
		if err == nil && !gjson.GetBytes(out, "plugins.0").Exists() {
			err = fmt.Errorf("%s holds only nftcni; leaving it for an operator to delete", c.Path)
		}
		if err == nil {
			var meta atomicfile.FileMeta
			if meta, err = atomicfile.Stat(c.Path); err == nil {
				err = atomicfile.WriteFile(c.Path, out, &meta)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("removing nftcni from %s: %w", c.Path, err))
			continue
		}
		delete(in.written, c.Path)
		in.log.Info("removed nftcni entry", "path", c.Path)
	}
	return errors.Join(errs...)
}

// restoreBackup puts X.conf back from X.conf.nftcni-orig and deletes the
// X.conflist we made from it. If the primary has since written a new X.conf,
// that newer file wins and the backup is dropped.
func (in *Installer) restoreBackup(backup string, restored map[string]bool) error {
	orig := strings.TrimSuffix(backup, BackupSuffix)
	list := strings.TrimSuffix(orig, filepath.Ext(orig)) + ".conflist"
	if data, err := conflist.ReadFile(list); err == nil && len(conflist.Entries(data, templates.PluginType)) > 0 {
		restored[list] = true
		// Restore first: for a moment both exist and X.conf sorts first, which
		// is a valid state without nftcni.
		if err := in.putBack(backup, orig); err != nil {
			return err
		}
		delete(in.written, list)
		in.log.Info("restored converted config", "path", orig, "removed", list)
		return atomicfile.RemoveFile(list)
	}
	return in.putBack(backup, orig)
}

func (in *Installer) putBack(backup, orig string) error {
	if _, err := os.Lstat(orig); err == nil {
		return atomicfile.RemoveFile(backup) // a newer original exists
	}
	return atomicfile.Rename(backup, orig)
}

func (in *Installer) removeBinaries() error {
	if in.binary == nil && len(in.cfg.BinDirs) == 0 {
		return nil
	}
	var errs []error
	for _, dir := range in.cfg.BinDirs {
		p := filepath.Join(dir, templates.PluginType)
		if st, err := os.Lstat(p); err == nil && st.Mode().IsRegular() {
			in.log.Info("removing plugin binary", "path", p)
			errs = append(errs, atomicfile.RemoveFile(p))
		}
	}
	return errors.Join(errs...)
}
