// Package faults lets the project's fault-injection suite (make chaos) kill
// the agent at a named point of its work: between the record and
// ztunnel's ack, between the ack and the plugin's answer, midway through a
// file's atomic write. A point is armed only by NFTCNI_FAULT_POINT in the
// agent's environment, read once at start ("name" or "name@n": the n-th
// time the point is reached, default the first); unarmed, as in every
// production run, a point costs a string comparison against "".
package faults

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
)

// EnvPoint arms a point.
const EnvPoint = "NFTCNI_FAULT_POINT"

// The points the agent has.
const (
	// Recorded: an ADD's record is written, ztunnel's ack not yet read.
	Recorded = "enrol.recorded"
	// Acked: ztunnel acked an ADD's pod, the plugin is not yet answered.
	Acked = "enrol.acked"
	// Outcome: the plugin reported its rules in place, the agent has not
	// yet taken the pod as enrolled.
	Outcome = "enrol.outcome"
	// Renaming: a file's new content is in its temporary file, not yet
	// renamed over it (package atomicfile); PointIn names the dir.
	Renaming = "atomicfile.renaming"
)

var (
	armed  string
	nth    int64 = 1
	counts atomic.Int64
)

func init() {
	spec := os.Getenv(EnvPoint)
	if spec == "" {
		return
	}
	name, n, ok := strings.Cut(spec, "@")
	if ok {
		if v, err := strconv.ParseInt(n, 10, 64); err == nil && v > 0 {
			nth = v
		}
	}
	armed = name
}

// PointIn is Point for name in dir: "name:<dir's base name>" (the records
// dir's is "atomicfile.renaming:pods").
func PointIn(name, dir string) {
	if armed == "" {
		return
	}
	Point(name + ":" + filepath.Base(filepath.Clean(dir)))
}

// Point kills the process with SIGKILL, as the kernel's OOM killer or a
// node's power loss would, if this point is armed and reached for the
// n-th time.
func Point(name string) {
	if armed == "" || armed != name {
		return
	}
	if counts.Add(1) == nth {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}
