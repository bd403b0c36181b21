// Package records keeps the agent's record of the pods it knows: one small
// JSON file per pod attachment under <run dir>/pods. A restarted agent
// reads them to find every pod's netns again, give ztunnel a full snapshot
// and re-check each pod's rules, so no pod loses capture across a restart.
// One file per attachment keeps each ADD's write small whatever the number
// of pods.
package records

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/plugin/wire"
)

// DirName is the records' dir under the run dir.
const DirName = wire.RecordsDir

// Record is what the agent keeps on disk about one pod attachment.
type Record struct {
	Pod wire.Pod `json:"pod"`
	UID string   `json:"uid"`
	// Decision is what the pod got; mode none: known, not enrolled.
	Decision *enablement.Decision `json:"decision"`
	// NetnsDev and NetnsIno identify the netns Pod.Netns named when the pod
	// was recorded, so a restarted agent tells the pod's netns from a
	// reused path by one stat instead of entering each netns.
	NetnsDev uint64 `json:"netnsDev,omitempty"`
	NetnsIno uint64 `json:"netnsIno,omitempty"`
}

// Dir is the records of one run dir.
type Dir struct{ dir string }

// Open makes the records dir (mode 0700) and removes the temp files a
// crash left behind.
func Open(runDir string) (*Dir, error) {
	d := &Dir{dir: filepath.Join(runDir, DirName)}
	if err := os.MkdirAll(d.dir, 0o700); err != nil {
		return nil, err
	}
	// The run dir's lock is held: no other writer is midway.
	tmps, _ := filepath.Glob(filepath.Join(d.dir, "*"+atomicfile.TempMarker+"*"))
	for _, t := range tmps {
		_ = os.Remove(t)
	}
	return d, nil
}

func (d *Dir) path(a wire.Attachment) string {
	sum := sha256.Sum256([]byte(a.ContainerID + "/" + a.IfName))
	return filepath.Join(d.dir, hex.EncodeToString(sum[:12])+".json")
}

// Save writes r in place of the attachment's record: a process crash
// leaves the old file or the new one, never through a symlink. It is not
// fsynced, because a machine crash restarts every pod anyway.
func (d *Dir) Save(r *Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if err := atomicfile.Replace(d.path(r.Pod.Attachment), b, 0o600); err != nil {
		return fmt.Errorf("recording pod %s: %w", r.Pod.Key(), err)
	}
	return nil
}

// Drop removes the attachment's record; none is fine.
func (d *Dir) Drop(a wire.Attachment) error {
	if err := os.Remove(d.path(a)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Load reads every record; bad lists the files that could not be read.
func (d *Dir) Load() (recs []Record, bad []error, err error) { return read(d.dir) }

// Read reads the records under runDir without changing anything (for
// inspect, which may run beside the agent).
func Read(runDir string) (recs []Record, bad []error, err error) {
	return read(filepath.Join(runDir, DirName))
}

func read(dir string) (recs []Record, bad []error, err error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	for _, e := range ents {
		if filepath.Ext(e.Name()) != ".json" {
			continue
		}
		p := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(p)
		var r Record
		if err == nil {
			err = json.Unmarshal(b, &r)
		}
		if err == nil && r.Pod.ContainerID == "" {
			err = errors.New("no attachment")
		}
		if err != nil {
			bad = append(bad, fmt.Errorf("%s: %w", p, err))
			continue
		}
		recs = append(recs, r)
	}
	return recs, bad, nil
}

// Marks are what the plugin left while no agent ran: a tombstone for each
// DEL it carried out itself, and the runtime's list of live attachments
// from a GC (package wire).
type Marks struct {
	deleted map[string]bool
	gc      map[wire.Attachment]bool // nil: no GC ran
	files   []string                 // what to remove once acted on
}

// Deleted says whether the runtime deleted a while no agent ran.
func (m *Marks) Deleted(a wire.Attachment) bool {
	return m.deleted[wire.TombstoneName(a)] || (m.gc != nil && !m.gc[a])
}

// takenGC is where Marks moves the GC list before reading it, so that a
// list the plugin leaves meanwhile is a new file, never cleared unread.
const takenGC = wire.GCName + ".taken"

// Marks reads the plugin's marks. An unreadable GC list is an error, with
// the marks read without it: the agent releases no pod on a guess.
func (d *Dir) Marks() (*Marks, error) {
	m := &Marks{deleted: map[string]bool{}}
	if err := os.Rename(filepath.Join(d.dir, wire.GCName), filepath.Join(d.dir, takenGC)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	ents, err := os.ReadDir(d.dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if filepath.Ext(e.Name()) == ".mark" {
			m.deleted[e.Name()] = true
			m.files = append(m.files, e.Name())
		}
	}
	b, err := os.ReadFile(filepath.Join(d.dir, takenGC))
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return m, err
	default:
		m.files = append(m.files, takenGC)
		var l wire.GCList
		if err := json.Unmarshal(b, &l); err != nil {
			return m, fmt.Errorf("the GC list the plugin left: %w", err)
		}
		m.gc = map[wire.Attachment]bool{}
		for _, a := range l.Valid {
			m.gc[a] = true
		}
	}
	return m, nil
}

// ClearMarks removes the marks m read, once the agent has acted on them;
// a mark the plugin left since stays for the next start.
func (d *Dir) ClearMarks(m *Marks) error {
	var errs []error
	for _, name := range m.files {
		if err := os.Remove(filepath.Join(d.dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
