package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestWriteFileRefusesSymlinks(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "10-x.conflist")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(link, []byte("{}"), nil); !errors.Is(err, ErrSymlink) {
		t.Fatalf("err = %v", err)
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Error("wrote through the symlink")
	}
	if _, err := Stat(link); !errors.Is(err, ErrSymlink) {
		t.Errorf("Stat: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("left files behind: %v", ents)
	}
}

func TestWriteFileSetsModeAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a.conflist")
	if err := WriteFile(p, []byte(`{"a":1}`), &FileMeta{Mode: 0o640, UID: os.Geteuid(), GID: os.Getegid()}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil || st.Mode().Perm() != 0o640 {
		t.Fatalf("mode %v err %v", st.Mode(), err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("temp file left: %v", ents)
	}
}

func TestStaleTempsGo(t *testing.T) {
	dir := t.TempDir()
	fresh := filepath.Join(dir, ".10-a.conflist"+TempMarker+"aaaa")
	stale := filepath.Join(dir, ".10-a.conflist"+TempMarker+"bbbb")
	for _, p := range []string{fresh, stale} {
		if err := os.WriteFile(p, []byte(`{"half":`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if err := RemoveStaleTemps(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Error("stale temp file kept")
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Error("a fresh temp file (another writer's work in progress) was removed")
	}
	if !strings.HasPrefix(filepath.Base(fresh), ".") {
		t.Error("temp files should be hidden")
	}
}
