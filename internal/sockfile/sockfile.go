// Package sockfile binds the agent's unix sockets (the plugin's and
// ztunnel's) at their paths on the host, carefully: it is the agent's half
// of package unixsock, kept apart so that the plugin does not link package
// net.
package sockfile

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
)

// Listen binds path: its dir is created with dirMode, a stale socket from
// an earlier agent is removed (anything else at the path is an error, never
// replaced), and the socket is made 0600. Callers also check every peer's
// credentials, so the moment between bind and chmod is safe.
func Listen(path string, dirMode fs.FileMode) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), dirMode); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket; not removing it", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket: %w", err)
		}
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}
