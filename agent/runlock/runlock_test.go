package runlock

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// flock is per open file, so a second Acquire in this process meets the
// first as another agent's would (integration tests run a second process).
func TestSecondHolderIsRefusedWithThePID(t *testing.T) {
	dir := t.TempDir()
	l, err := Acquire(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Acquire(dir)
	var held *HeldError
	if !errors.As(err, &held) || held.PID != os.Getpid() || !strings.Contains(err.Error(), dir) {
		t.Fatalf("second Acquire = %v, want HeldError naming pid %d", err, os.Getpid())
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	l2, err := Acquire(dir)
	if err != nil {
		t.Fatalf("Acquire after Release: %v", err)
	}
	l2.Release()
}

func TestSymlinkIsNotFollowed(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Symlink(target, filepath.Join(dir, Name)); err != nil {
		t.Fatal(err)
	}
	if _, err := Acquire(dir); err == nil {
		t.Fatal("Acquire went through a symlink")
	}
	if _, err := os.Stat(target); !os.IsNotExist(err) {
		t.Errorf("the symlink's target was created: %v", err)
	}
}
