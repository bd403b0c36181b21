package sockfile

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// stale leaves a socket file no one serves at path, as an agent that was
// killed does.
func stale(t *testing.T, path string) {
	t.Helper()
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
}

func TestListenTakesAStaleSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "ztunnel.sock")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	stale(t, path)
	l, err := Listen(path, 0o755, 0)
	if err != nil {
		t.Fatalf("a stale socket was not taken over: %v", err)
	}
	defer l.Close()
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v %v, want 0600", st.Mode(), err)
	}
}

// A socket another live process serves is never removed, whatever its
// type: Listen waits, then names the holder; the holder goes on serving.
func TestListenNeverTakesALiveSocket(t *testing.T) {
	for _, network := range []string{"unixpacket", "unix", "unixgram"} {
		t.Run(network, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ztunnel.sock")
			var closeHolder func() error
			if network == "unixgram" {
				c, err := net.ListenUnixgram(network, &net.UnixAddr{Name: path, Net: network})
				if err != nil {
					t.Fatal(err)
				}
				closeHolder = c.Close
			} else {
				holder, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
				if err != nil {
					t.Fatal(err)
				}
				closeHolder = holder.Close
			}
			defer closeHolder()
			start := time.Now()
			_, err := Listen(path, 0o755, 300*time.Millisecond)
			var inUse *InUseError
			if !errors.As(err, &inUse) {
				t.Fatalf("Listen over a live %s socket: %v, want an InUseError", network, err)
			}
			if time.Since(start) < 300*time.Millisecond {
				t.Errorf("gave up after %v, before the wait", time.Since(start))
			}
			if network != "unixgram" && !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
				t.Errorf("error does not name the holder (pid %d): %v", os.Getpid(), err)
			}
			if c, err := net.Dial(network, path); err != nil {
				t.Errorf("the holder's socket is gone: %v", err)
			} else {
				c.Close()
			}
		})
	}
}

// A holder that goes away while Listen waits (a rollout's old agent
// exiting) hands the path over.
func TestListenWaitsForTheHolderToGo(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	holder, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	holder.SetUnlinkOnClose(false) // it exits and leaves its file, as a killed process does
	time.AfterFunc(300*time.Millisecond, func() { holder.Close() })
	l, err := Listen(path, 0o755, 5*time.Second)
	if err != nil {
		t.Fatalf("Listen after the holder went: %v", err)
	}
	l.Close()
}
