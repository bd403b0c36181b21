package integration

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
)

// timedExec is libcni's own plugin runner, timing each plugin's exec: what
// a chained plugin adds to an ADD, without the other plugins' noise.
type timedExec struct {
	invoke.DefaultExec
	mu    sync.Mutex
	times map[string][]time.Duration // by plugin binary name
}

// newTimedExec passes the plugins' stderr to stderr (nil: os.Stderr).
func newTimedExec(stderr io.Writer) *timedExec {
	if stderr == nil {
		stderr = os.Stderr
	}
	return &timedExec{DefaultExec: invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: stderr}, PluginDecoder: version.PluginDecoder{}},
		times: map[string][]time.Duration{}}
}

func (e *timedExec) ExecPlugin(ctx context.Context, path string, stdin []byte, env []string) ([]byte, error) {
	start := time.Now()
	out, err := e.DefaultExec.ExecPlugin(ctx, path, stdin, env)
	took := time.Since(start)
	e.mu.Lock()
	e.times[filepath.Base(path)] = append(e.times[filepath.Base(path)], took)
	e.mu.Unlock()
	return out, err
}

// last is the latest exec time of plugin.
func (e *timedExec) last(plugin string) time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	t := e.times[plugin]
	if len(t) == 0 {
		return 0
	}
	return t[len(t)-1]
}
