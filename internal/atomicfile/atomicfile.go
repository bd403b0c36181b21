// Package atomicfile writes files on the host the one careful way: a
// temporary file in the same directory (O_EXCL|O_NOFOLLOW, a name no
// runtime loads) renamed over the target, so a crash at any instant leaves
// the old content or the new, never half; never through a symlink, never
// replacing one. The installer's conflists and binaries, the policy
// snapshot and the pods' records all go through it.
package atomicfile

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nftcni/nftcni/internal/faults"
	"golang.org/x/sys/unix"
)

// TempMarker is part of every temporary file name we create. Its extension is
// never one a runtime loads, so a half-written file is never read as config.
const TempMarker = ".nftcni-tmp-"

// ErrSymlink is returned when a write would go to a symlink: we never write
// through one, and never silently replace one either.
var ErrSymlink = errors.New("refusing to write through a symlink")

// FileMeta is what a rewrite keeps from the file it replaces.
type FileMeta struct {
	Mode     fs.FileMode
	UID, GID int
}

// Stat returns the mode and owner of path without following a final symlink;
// fs.ErrNotExist when it is absent, ErrSymlink when it is a symlink.
func Stat(path string) (FileMeta, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return FileMeta{}, &fs.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return FileMeta{}, fmt.Errorf("%s: %w", path, ErrSymlink)
	}
	return FileMeta{Mode: fs.FileMode(st.Mode & 0o7777), UID: int(st.Uid), GID: int(st.Gid)}, nil
}

// WriteFile replaces path atomically: the data goes to a temporary file in the
// same directory (opened O_EXCL|O_NOFOLLOW, with a name no runtime loads), gets
// the given mode and owner, is fsynced, and is renamed over path; then the
// directory is fsynced. A crash at any instant leaves either the old or the
// new content at path. If path is a symlink nothing is written.
// A nil meta means mode 0644 owned by the caller.
func WriteFile(path string, data []byte, meta *FileMeta) error {
	return write(path, data, meta, true)
}

// Replace is WriteFile without the fsyncs, for state that need not outlive
// a machine crash (a crash restarts every pod anyway) but must never be
// seen half-written: each write costs a rename, not a disk flush.
func Replace(path string, data []byte, mode fs.FileMode) error {
	return write(path, data, &FileMeta{Mode: mode, UID: os.Geteuid(), GID: os.Getegid()}, false)
}

func write(path string, data []byte, meta *FileMeta, durable bool) error {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &fs.PathError{Op: "open dir", Path: dir, Err: err}
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return fmt.Errorf("%s: %w", path, ErrSymlink)
	}
	tmp := "." + base + TempMarker + randHex()
	fd, err := unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &fs.PathError{Op: "create", Path: filepath.Join(dir, tmp), Err: err}
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, tmp))
	ok := false
	defer func() {
		if !ok {
			f.Close()
			unix.Unlinkat(dfd, tmp, 0)
		}
	}()
	mode := fs.FileMode(0o644)
	if meta != nil {
		mode = meta.Mode
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if meta != nil && (meta.UID != os.Geteuid() || meta.GID != os.Getegid()) {
		if err := f.Chown(meta.UID, meta.GID); err != nil {
			return err
		}
	}
	if err := f.Chmod(mode); err != nil { // after chown, which may clear setuid bits
		return err
	}
	if durable {
		if err := f.Sync(); err != nil {
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	faults.PointIn(faults.Renaming, dir)
	if err := unix.Renameat(dfd, tmp, dfd, base); err != nil {
		return &fs.PathError{Op: "rename", Path: path, Err: err}
	}
	ok = true
	if !durable {
		return nil
	}
	return unix.Fsync(dfd)
}

// Rename moves old to new within one directory tree without following a
// final symlink at new, then fsyncs new's directory.
func Rename(oldPath, newPath string) error {
	if _, err := Stat(newPath); errors.Is(err, ErrSymlink) {
		return err
	}
	if err := os.Rename(oldPath, newPath); err != nil {
		return err
	}
	return syncDir(filepath.Dir(newPath))
}

// RemoveFile deletes path; a path already gone is not an error.
func RemoveFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return syncDir(filepath.Dir(path))
}

// staleAfter is how old a temp file must be before RemoveStaleTemps takes it
// for a crashed writer's leftover rather than another writer's work in progress
// (two agents overlap during a rolling upgrade).
const staleAfter = 30 * time.Second

// RemoveStaleTemps deletes temporary files a crashed writer left in dir.
func RemoveStaleTemps(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	for _, e := range ents {
		if !strings.Contains(e.Name(), TempMarker) || !e.Type().IsRegular() {
			continue
		}
		if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > staleAfter {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
