package wire

import (
	"encoding/binary"
	"encoding/hex"
	"hash/fnv"
	"path/filepath"
)

// A DEL (or GC) the plugin carries out without the agent leaves a mark in
// the agent's records dir (<run dir>/pods), so that a restarted agent
// releases the attachment — ztunnel never gets it again, no verification
// pass puts its rules back — rather than restore it from its record.
const (
	RecordsDir = "pods"
	// GCName lists the attachments the runtime still has, as its GC while
	// no agent ran gave them: every other recorded one is gone.
	GCName = "runtime-gc.valid"
)

// TombstoneName is the file that marks a's DEL. FNV, not the records'
// SHA-256: package hash/fnv costs the plugin's exec nothing at start.
func TombstoneName(a Attachment) string {
	h := fnv.New64a()
	h.Write([]byte(a.ContainerID + "/" + a.IfName))
	return "deleted-" + hex.EncodeToString(binary.BigEndian.AppendUint64(nil, h.Sum64())) + ".mark"
}

// TombstonePath is a's mark under runDir.
func TombstonePath(runDir string, a Attachment) string {
	return filepath.Join(runDir, RecordsDir, TombstoneName(a))
}

// GCList is what GCName holds.
type GCList struct {
	Valid []Attachment `json:"valid"`
}
