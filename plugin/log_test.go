package plugin

import (
	"encoding/json"
	"errors"
	"math"
	"testing"
	"time"
)

// The plugin's records are what the agent re-logs: JSON objects with
// slog's keys and level names, whatever the values.
func TestRecordsAreSlogShapedJSON(t *testing.T) {
	var r records
	at := time.Date(2026, 12, 4, 10, 0, 0, 5, time.UTC)
	r.add(at, levelWarn, "agent \"unreachable\"", "c1", "ns/p",
		[]any{"err", errors.New("dial: refused"), "ms", 1.25, "n", 3, "ok", true, "nan", math.NaN(), "mode", Error{Code: 7}, "lone"})
	r.add(at, levelDebug, "no pod", "c2", "", nil)
	recs := r.take()
	if len(recs) != 2 {
		t.Fatalf("%d records", len(recs))
	}
	var m map[string]any
	if err := json.Unmarshal(recs[0], &m); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, recs[0])
	}
	want := map[string]any{"time": "2026-12-04T10:00:00.000000005Z", "level": "WARN", "msg": `agent "unreachable"`, "plugin": "nftcni",
		"containerID": "c1", "pod": "ns/p", "err": "dial: refused", "ms": 1.25, "n": 3.0, "ok": true, "nan": "NaN", "!BADKEY": "lone"}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("%s = %#v, want %#v\n%s", k, m[k], v, recs[0])
		}
	}
	if _, ok := m["mode"].(string); !ok {
		t.Errorf("a value of another type is not written as text: %#v", m["mode"])
	}
	m = nil // a fresh map for the second record
	if err := json.Unmarshal(recs[1], &m); err != nil || m["level"] != "DEBUG" {
		t.Errorf("second record %s: %v", recs[1], err)
	}
	if _, ok := m["pod"]; ok {
		t.Errorf("pod written without one: %s", recs[1])
	}
}
