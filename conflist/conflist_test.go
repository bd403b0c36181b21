package conflist

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/internal/atomicfile"
)

var update = flag.Bool("update", false, "rewrite golden files")

const ptype = "nftcni"

// testEntry is what the agent renders with default values.
var testEntry = []byte(`{
  "type": "nftcni",
  "capabilities": { "io.kubernetes.cri.pod-annotations": true },
  "plugin_log_level": "info",
  "cni_agent_run_dir": "/var/run/nftcni",
  "exclude_namespaces": ["kube-system"],
  "pod_namespace": "istio-system",
  "status_requires_agent": false
}`)

func corpus(t testing.TB) map[string][]byte {
	t.Helper()
	files, err := filepath.Glob("testdata/corpus/*")
	if err != nil || len(files) == 0 {
		t.Fatalf("no corpus: %v", err)
	}
	out := map[string][]byte{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[f] = b
	}
	return out
}

func install(t *testing.T, path string, data []byte) []byte {
	t.Helper()
	c, err := Parse(path, data)
	if err != nil {
		t.Fatalf("corpus file does not parse: %v", err)
	}
	if err := CheckChainable(c); err != nil {
		t.Fatal(err)
	}
	if c.Kind == Single {
		out, err := FromSingle(c, "", ptype, testEntry)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	out, err := Insert(data, ptype, testEntry)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCorpusGolden installs into every real primary config and compares with
// the golden file, then checks the properties that must hold for every one.
func TestCorpusGolden(t *testing.T) {
	for path, orig := range corpus(t) {
		t.Run(filepath.Base(path), func(t *testing.T) {
			out := install(t, path, orig)
			golden := filepath.Join("testdata", "golden", filepath.Base(path)+".installed")
			if *update {
				if err := os.MkdirAll(filepath.Dir(golden), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(golden, out, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test ./conflist -update)", err)
			}
			if !bytes.Equal(out, want) {
				t.Errorf("install output differs from %s:\n%s", golden, out)
			}
			c, err := Parse(strings.TrimSuffix(path, filepath.Ext(path))+".conflist", out)
			if err != nil {
				t.Fatalf("installed file does not parse: %v", err)
			}
			if !HasEntry(out, ptype, testEntry) {
				t.Fatal("installed file does not hold exactly our entry")
			}
			if c.Types[len(c.Types)-1] != ptype {
				t.Errorf("our entry is not last: %v", c.Types)
			}
			orig0, _ := Parse(path, orig)
			if c.CNIVersion != orig0.CNIVersion || c.Name != orig0.Name {
				t.Errorf("name/cniVersion changed: %q/%q -> %q/%q", orig0.Name, orig0.CNIVersion, c.Name, c.CNIVersion)
			}
			again := install(t, path, out)
			if orig0.Kind == List && !bytes.Equal(again, out) {
				t.Error("installing twice is not byte-identical")
			}
			back, n, err := RemoveEntries(out, ptype)
			if err != nil || n != 1 {
				t.Fatalf("remove: n=%d err=%v", n, err)
			}
			if orig0.Kind == List && !bytes.Equal(back, orig) {
				t.Errorf("uninstall is not byte-identical to the original:\n%s", back)
			}
		})
	}
}

func TestInsertReplacesStaleAndDuplicateEntries(t *testing.T) {
	doc := []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"nftcni","plugin_log_level":"debug"},{"type":"bridge"},{"type":"nftcni"}]}`)
	out, err := Insert(doc, ptype, testEntry)
	if err != nil {
		t.Fatal(err)
	}
	if got := gjson.GetBytes(out, "plugins.#.type").String(); got != `["bridge","nftcni"]` {
		t.Fatalf("types after insert = %s", got)
	}
	if !HasEntry(out, ptype, testEntry) {
		t.Fatal("entry content not ours")
	}
}

func TestHandEditedEntryIsNotValid(t *testing.T) {
	out := install(t, "testdata/corpus/10-calico.conflist", corpus(t)["testdata/corpus/10-calico.conflist"])
	edited := bytes.Replace(out, []byte(`"plugin_log_level": "info"`), []byte(`"plugin_log_level": "debug"`), 1)
	if bytes.Equal(edited, out) {
		t.Fatal("test did not edit the entry")
	}
	if HasEntry(edited, ptype, testEntry) {
		t.Fatal("a hand-edited entry counts as valid (istio#55913)")
	}
	fixed, err := Insert(edited, ptype, testEntry)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fixed, out) {
		t.Errorf("re-insert after edit differs from a clean install:\n%s", fixed)
	}
	// Reformatting our entry without changing it is not an edit.
	reformatted := bytes.Replace(out, []byte(`"plugin_log_level": "info"`), []byte(`"plugin_log_level":"info"`), 1)
	if !HasEntry(reformatted, ptype, testEntry) {
		t.Error("whitespace-only change counted as an edit")
	}
}

func TestParseRejectsMalformed(t *testing.T) {
	huge := append([]byte(`{"name":"x","plugins":[{"type":"a","pad":"`), bytes.Repeat([]byte("x"), MaxFileSize)...)
	huge = append(huge, `"}]}`...)
	cases := map[string]struct {
		name, data, want string
	}{
		"zero-byte":        {"a.conflist", "", "empty"},
		"truncated":        {"a.conflist", `{"name":"x","plugins":[{"type":"bridge"`, "not valid JSON"},
		"not object":       {"a.conflist", `[1,2]`, "not a JSON object"},
		"plugins object":   {"a.conflist", `{"name":"x","plugins":{"type":"a"}}`, `"plugins" is an object`},
		"plugins string":   {"a.conflist", `{"name":"x","plugins":"a"}`, `"plugins" is a string`},
		"empty plugins":    {"a.conflist", `{"name":"x","plugins":[]}`, "empty"},
		"plugin not obj":   {"a.conflist", `{"name":"x","plugins":[3]}`, "plugins[0] is a number"},
		"type not string":  {"a.conflist", `{"name":"x","plugins":[{"type":3}]}`, `no string "type"`},
		"name not string":  {"a.conflist", `{"name":1,"plugins":[{"type":"a"}]}`, `no string "name"`},
		"version number":   {"a.conflist", `{"name":"x","cniVersion":1,"plugins":[{"type":"a"}]}`, `"cniVersion" is a number`},
		"conf no type":     {"a.conf", `{"name":"x"}`, `no string "type"`},
		"duplicate key":    {"a.conflist", `{"name":"x","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}`, `"plugins" appears twice`},
		"dup plugin key":   {"a.conflist", `{"name":"x","plugins":[{"type":"a","type":"nftcni"}]}`, `key "type" appears twice`},
		"huge":             {"a.conflist", string(huge), "larger than"},
		"conflist no list": {"a.conflist", `{"name":"x","type":"bridge"}`, `"plugins" is missing`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Parse("/etc/cni/net.d/"+tc.name, []byte(tc.data))
			if err == nil {
				t.Fatal("accepted")
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "/etc/cni/net.d/"+tc.name) {
				t.Errorf("error %q does not name the file and %q", err, tc.want)
			}
		})
	}
}

func TestChainingStartsAt030AndFromSingleKeepsTheVersion(t *testing.T) {
	for _, v := range []string{"", "0.1.0", "0.2.0"} {
		c, err := Parse("x.conf", []byte(`{"cniVersion":"`+v+`","name":"n","type":"bridge"}`))
		if err != nil {
			t.Fatal(err)
		}
		if err := CheckChainable(c); err == nil || !strings.Contains(err.Error(), "predates plugin chaining") {
			t.Errorf("cniVersion %q: err = %v", v, err)
		}
	}
	c, _ := Parse("x.conf", []byte(`{"cniVersion":"0.3.0","name":"n","type":"bridge"}`))
	out, err := FromSingle(c, "", ptype, testEntry)
	if err != nil {
		t.Fatal(err)
	}
	if v := gjson.GetBytes(out, "cniVersion").Str; v != "0.3.0" {
		t.Errorf("cniVersion became %q", v)
	}
}

func TestScanOrderAndSkips(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("05-broken.conflist", `{"name":`)
	write("10-b.json", `{"name":"json","plugins":[{"type":"bridge"}]}`)
	write("20-a.conf", `{"name":"conf","type":"bridge"}`)
	write("00-notes.txt", `not a config`)
	write(".10-x.conflist"+atomicfile.TempMarker+"abc", `{"name":`)
	write("01-ours.conflist", `{"name":"ours","plugins":[{"type":"nftcni"}]}`)
	valid, skipped, err := Scan(dir, func(n string) bool { return n == "01-ours.conflist" })
	if err != nil {
		t.Fatal(err)
	}
	if len(valid) != 2 || filepath.Base(valid[0].Path) != "10-b.json" || valid[0].Kind != List || valid[1].Kind != Single {
		t.Fatalf("valid = %+v", valid)
	}
	if len(skipped) != 1 || filepath.Base(skipped[0].Path) != "05-broken.conflist" {
		t.Fatalf("skipped = %+v", skipped)
	}
	if _, _, err := Primary(t.TempDir(), nil); !errors.Is(err, ErrNoConfig) {
		t.Errorf("empty dir: %v", err)
	}
}

// A temporary file of a write in progress is never a config a runtime
// would load.
func TestTempNamesAreNeverLoaded(t *testing.T) {
	for _, base := range []string{"10-a.conflist", "10-a.conf", "10-a.json"} {
		if name := "." + base + atomicfile.TempMarker + "aaaa"; Loadable(name) {
			t.Errorf("%s would be loaded by a runtime", name)
		}
	}
}
