package plugin

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/plugin/wire"
)

// The plugin may never write to stdout (that is the CNI result), and the
// runtime rarely shows stderr. So each invocation buffers its log records
// and, at the end, sends them to the agent (which logs them with its own)
// or, when the agent cannot be reached, appends them to a small rolling
// file in the run dir.
const (
	maxRecords  = 256
	maxLogBytes = 1 << 20 // plugin.log rolls to plugin.log.1 past this
)

// records collects what a JSON slog handler writes: one record per Write.
type records struct {
	mu   sync.Mutex
	list []json.RawMessage
	lost int
}

func (r *records) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.list) >= maxRecords {
		r.lost++
		return len(p), nil
	}
	r.list = append(r.list, json.RawMessage(bytes.TrimSpace(bytes.Clone(p))))
	return len(p), nil
}

func (r *records) take() []json.RawMessage {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.list
	if r.lost > 0 {
		b, _ := json.Marshal(map[string]any{"level": "WARN", "msg": "log records dropped", "count": r.lost})
		out = append(out, b)
	}
	r.list, r.lost = nil, 0
	return out
}

func newLogger(level slog.Level, w io.Writer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})).With("plugin", "nftcni")
}

// writeLogFile appends records to <dir>/plugin.log, rolling it once it is
// over maxLogBytes. Best effort: a plugin never fails for its log.
func writeLogFile(dir string, recs []json.RawMessage) {
	if len(recs) == 0 {
		return
	}
	path := filepath.Join(dir, wire.LogName)
	if st, err := os.Lstat(path); err == nil && st.Size() > maxLogBytes {
		_ = os.Rename(path, path+".1")
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	var buf bytes.Buffer
	for _, r := range recs {
		buf.Write(r)
		buf.WriteByte('\n')
	}
	_, _ = f.Write(buf.Bytes())
}
