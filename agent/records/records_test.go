package records

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/plugin/wire"
)

func rec(id string, mode wire.Mode) *Record {
	return &Record{Pod: wire.Pod{Namespace: "ns", Name: id, Attachment: wire.Attachment{ContainerID: "c-" + id, IfName: "eth0"}},
		UID: "uid-" + id, Decision: &enablement.Decision{Mode: mode}, NetnsDev: 4, NetnsIno: 4026532000}
}

func TestSaveReplaceDropLoad(t *testing.T) {
	run := t.TempDir()
	d, err := Open(run)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []*Record{rec("a", wire.ModeNone), rec("b", wire.ModeAmbient), rec("a", wire.ModeAmbient)} {
		if err := d.Save(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Drop(rec("b", wire.ModeNone).Pod.Attachment); err != nil {
		t.Fatal(err)
	}
	if err := d.Drop(rec("never", wire.ModeNone).Pod.Attachment); err != nil {
		t.Errorf("Drop of an attachment never recorded: %v", err)
	}
	got, bad, err := Read(run)
	if err != nil || len(bad) != 0 {
		t.Fatal(err, bad)
	}
	if len(got) != 1 || got[0].Pod.Name != "a" || got[0].Decision.Mode != wire.ModeAmbient || got[0].NetnsIno != 4026532000 {
		t.Fatalf("records %+v", got)
	}
	st, err := os.Stat(filepath.Join(run, DirName))
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("records dir mode: %v %v", st.Mode(), err)
	}
}

// A crash between write and rename leaves a temp file: the next agent
// removes it and the record it would have replaced is still the old one.
// An unreadable record is reported, and the others load.
func TestCrashLeftoversAndBadFiles(t *testing.T) {
	run := t.TempDir()
	d, err := Open(run)
	if err != nil {
		t.Fatal(err)
	}
	old := rec("a", wire.ModeAmbient)
	if err := d.Save(old); err != nil {
		t.Fatal(err)
	}
	path := d.path(old.Pod.Attachment)
	half := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+atomicfile.TempMarker+"0123")
	if err := os.WriteFile(half, []byte(`{"pod":{"namesp`), 0o600); err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(run, DirName, "broken.json")
	if err := os.WriteFile(broken, []byte(`{"pod":`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(run); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(half); !os.IsNotExist(err) {
		t.Errorf("temp file left after Open: %v", err)
	}
	got, bad, err := Read(run)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Decision.Mode != wire.ModeAmbient {
		t.Errorf("records %+v", got)
	}
	if len(bad) != 1 || !strings.Contains(bad[0].Error(), "broken.json") {
		t.Errorf("bad %v", bad)
	}
}

// The run dir is on the host: a symlink where a record goes is neither
// written through nor replaced.
func TestSaveRefusesASymlink(t *testing.T) {
	run := t.TempDir()
	d, err := Open(run)
	if err != nil {
		t.Fatal(err)
	}
	r := rec("a", wire.ModeAmbient)
	target := filepath.Join(run, "elsewhere")
	if err := os.WriteFile(target, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, d.path(r.Pod.Attachment)); err != nil {
		t.Fatal(err)
	}
	if err := d.Save(r); err == nil {
		t.Error("Save wrote over a symlink")
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Errorf("the symlink's target was written: %q", b)
	}
}

func TestReadWithoutDir(t *testing.T) {
	got, bad, err := Read(filepath.Join(t.TempDir(), "nothing"))
	if err != nil || len(got) != 0 || len(bad) != 0 {
		t.Errorf("Read of a run dir never used: %v %v %v", got, bad, err)
	}
}

// The plugin's marks (a tombstone per DEL, the runtime's GC list) name the
// attachments deleted while no agent ran; a mark left after they were
// read survives the clear.
func TestMarks(t *testing.T) {
	run := t.TempDir()
	d, err := Open(run)
	if err != nil {
		t.Fatal(err)
	}
	a, b, c := rec("a", wire.ModeAmbient).Pod.Attachment, rec("b", wire.ModeAmbient).Pod.Attachment, rec("c", wire.ModeAmbient).Pod.Attachment
	m, err := d.Marks()
	if err != nil || m.Deleted(a) {
		t.Fatalf("no marks: deleted %v, err %v", m.Deleted(a), err)
	}
	if err := os.WriteFile(wire.TombstonePath(run, a), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(run, DirName, wire.GCName), []byte(`{"valid":[{"containerID":"c-a","ifname":"eth0"},{"containerID":"c-b","ifname":"eth0"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if m, err = d.Marks(); err != nil {
		t.Fatal(err)
	}
	if !m.Deleted(a) || m.Deleted(b) || !m.Deleted(c) {
		t.Errorf("deleted a %v (tombstone), b %v (listed by the GC), c %v (not listed)", m.Deleted(a), m.Deleted(b), m.Deleted(c))
	}
	if recs, bad, err := d.Load(); len(recs) != 0 || len(bad) != 0 || err != nil {
		t.Errorf("marks read as records: %v %v %v", recs, bad, err)
	}
	// A DEL the plugin marks after the agent read the marks: kept.
	if err := os.WriteFile(wire.TombstonePath(run, b), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.ClearMarks(m); err != nil {
		t.Fatal(err)
	}
	if m, err = d.Marks(); err != nil || m.Deleted(a) || !m.Deleted(b) || m.Deleted(c) {
		t.Errorf("after the clear: a %v, b %v, c %v, err %v", m.Deleted(a), m.Deleted(b), m.Deleted(c), err)
	}

	// A GC list that cannot be read releases nothing, and goes.
	if err := os.WriteFile(filepath.Join(run, DirName, wire.GCName), []byte(`{"valid":`), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err = d.Marks()
	if err == nil || m == nil || m.Deleted(c) || !m.Deleted(b) {
		t.Fatalf("a torn GC list: err %v, marks %+v", err, m)
	}
	if err := d.ClearMarks(m); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(run, DirName)); len(ents) != 0 {
		t.Errorf("left after the clear: %v", ents)
	}
}
