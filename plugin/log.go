package plugin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/tidwall/gjson"
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

// A record is one JSON object with the keys and levels of log/slog's JSON
// handler ("time", "level", "msg", then the attributes), which the agent
// re-logs at that level. It is written here rather than by log/slog: the
// plugin is exec'd for every pod sandbox, and log/slog's package inits
// (with log's and context's) cost each exec about 6 page faults, where a
// successful ADD logs nothing.
type level int

// The levels, numbered as slog's.
const (
	levelDebug level = -4
	levelInfo  level = 0
	levelWarn  level = 4
	levelError level = 8
)

func (l level) String() string {
	switch l {
	case levelDebug:
		return "DEBUG"
	case levelWarn:
		return "WARN"
	case levelError:
		return "ERROR"
	}
	return "INFO"
}

// records collects one invocation's log records (the plugin logs from its
// one goroutine).
type records struct {
	list []json.RawMessage
	lost int
}

// add records msg with the call's containerID and pod (when known) and
// args, key-value pairs as slog takes them: strings, errors, numbers,
// booleans; anything else is written as fmt prints it.
func (r *records) add(t time.Time, lvl level, msg, containerID, pod string, args []any) {
	b := append(make([]byte, 0, 256), `{"time":"`...)
	b = t.AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","level":"`...)
	b = append(b, lvl.String()...)
	b = append(b, `","msg":`...)
	b = gjson.AppendJSONString(b, msg)
	b = appendAttr(b, "plugin", "nftcni")
	b = appendAttr(b, "containerID", containerID)
	if pod != "" {
		b = appendAttr(b, "pod", pod)
	}
	for i := 0; i < len(args); i += 2 {
		if i+1 == len(args) {
			b = appendAttr(b, "!BADKEY", args[i]) // as slog writes a lone value
			break
		}
		b = appendAttr(b, fmt.Sprint(args[i]), args[i+1])
	}
	b = append(b, '}')
	if len(r.list) >= maxRecords {
		r.lost++
		return
	}
	r.list = append(r.list, b)
}

func appendAttr(b []byte, key string, v any) []byte {
	b = append(b, ',')
	b = gjson.AppendJSONString(b, key)
	b = append(b, ':')
	switch v := v.(type) {
	case string:
		return gjson.AppendJSONString(b, v)
	case error:
		return gjson.AppendJSONString(b, v.Error())
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return gjson.AppendJSONString(b, strconv.FormatFloat(v, 'f', -1, 64)) // JSON has no such number
		}
		return strconv.AppendFloat(b, v, 'f', -1, 64)
	case int:
		return strconv.AppendInt(b, int64(v), 10)
	case bool:
		return strconv.AppendBool(b, v)
	case nil:
		return append(b, "null"...)
	}
	return gjson.AppendJSONString(b, fmt.Sprint(v))
}

func (r *records) take() []json.RawMessage {
	out := r.list
	if r.lost > 0 {
		b, _ := json.Marshal(map[string]any{"level": "WARN", "msg": "log records dropped", "count": r.lost})
		out = append(out, b)
	}
	r.list, r.lost = nil, 0
	return out
}

// writeLogFile appends records to <dir>/plugin.log, rolling it once it is
// over maxLogBytes. Best effort: a plugin never fails for its log.
func writeLogFile(dir string, recs []json.RawMessage) {
	if len(recs) == 0 {
		return
	}
	// After a reboot the run dir (a tmpfs) is made by the agent, which may
	// not be back: the plugin's log is most wanted then.
	_ = os.MkdirAll(dir, 0o750)
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
