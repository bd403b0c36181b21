package install

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/templates"
)

const corpusDir = "../../conflist/testdata/corpus"

// syncBuf collects log output from the installer's goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type node struct {
	conf, bin, plugin string
	logs              *syncBuf
}

// newNode makes a throw-away host layout: a conf dir, a bin dir and a fake
// plugin binary to install.
func newNode(t testing.TB) *node {
	t.Helper()
	root := t.TempDir()
	n := &node{conf: filepath.Join(root, "net.d"), bin: filepath.Join(root, "bin"), plugin: filepath.Join(root, "nftcni-src"), logs: &syncBuf{}}
	for _, d := range []string{n.conf, n.bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(n.plugin, []byte("#!/bin/true\nplugin v1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *node) installer(t testing.TB, mode Mode, confName string) *Installer {
	t.Helper()
	vals := templates.Values{LogLevel: "info", AgentRunDir: "/var/run/nftcni", ExcludeNamespaces: []string{"kube-system"}}
	entry, err := templates.PluginEntry(vals)
	if err != nil {
		t.Fatal(err)
	}
	sa, err := templates.Standalone(vals, "1.0.0", "nftcni")
	if err != nil {
		t.Fatal(err)
	}
	in, err := New(Config{
		ConfDir: n.conf, BinDirs: []string{n.bin}, PluginBinary: n.plugin, ConfName: confName,
		Mode: mode, Entry: entry, Standalone: sa,
		Log: slog.New(slog.NewTextHandler(n.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatal(err)
	}
	return in
}

func (n *node) put(t *testing.T, name string, data []byte, mode fs.FileMode) {
	t.Helper()
	p := filepath.Join(n.conf, name)
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

func (n *node) read(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.conf, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// snapshot maps every path under dir to its content and mode.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		st, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if d.IsDir() {
			out[rel+"/"] = st.Mode().String()
			return nil
		}
		b, _ := os.ReadFile(p)
		out[rel] = st.Mode().String() + " " + string(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sameTree(t *testing.T, what string, want, got map[string]string) {
	t.Helper()
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		if want[k] != got[k] {
			t.Errorf("%s: %s differs:\nwant %q\n got %q", what, k, want[k], got[k])
		}
	}
}

func TestChainedInstallAndUninstallOverCorpus(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(corpusDir, "*"))
	if len(files) < 12 {
		t.Fatalf("corpus has %d files", len(files))
	}
	for _, f := range files {
		name := filepath.Base(f)
		t.Run(name, func(t *testing.T) {
			n := newNode(t)
			orig, _ := os.ReadFile(f)
			n.put(t, name, orig, 0o640)
			before := snapshot(t, n.conf)
			in := n.installer(t, Chained, "")
			res, err := in.Install()
			if err != nil {
				t.Fatal(err)
			}
			list := strings.TrimSuffix(name, filepath.Ext(name)) + ".conflist"
			if filepath.Base(res.Config) != list {
				t.Fatalf("config = %s, want %s", res.Config, list)
			}
			got := n.read(t, list)
			if !conflist.HasEntry(got, templates.PluginType, in.cfg.Entry) {
				t.Fatalf("no valid entry in %s:\n%s", list, got)
			}
			if st, _ := os.Stat(filepath.Join(n.conf, list)); st.Mode().Perm() != 0o640 {
				t.Errorf("mode %v, want the original 0640", st.Mode().Perm())
			}
			if filepath.Ext(name) != ".conflist" {
				if _, err := os.Stat(filepath.Join(n.conf, name)); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("converted %s still present: it would sort first and bypass nftcni", name)
				}
				if _, err := os.Stat(filepath.Join(n.conf, name+BackupSuffix)); err != nil {
					t.Errorf("no backup of the converted file: %v", err)
				}
			}
			if b, err := os.ReadFile(filepath.Join(n.bin, "nftcni")); err != nil || !strings.Contains(string(b), "plugin v1") {
				t.Errorf("plugin binary not installed: %v", err)
			}
			res2, err := in.Install()
			if err != nil || len(res2.Wrote) != 0 {
				t.Errorf("second install wrote %v (err %v), want nothing", res2.Wrote, err)
			}
			if err := in.Uninstall(); err != nil {
				t.Fatal(err)
			}
			sameTree(t, "after uninstall", before, snapshot(t, n.conf))
			if _, err := os.Stat(filepath.Join(n.bin, "nftcni")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("binary left behind: %v", err)
			}
			if err := in.Uninstall(); err != nil {
				t.Errorf("second uninstall: %v", err)
			}
		})
	}
}

func TestHandEditedEntryIsRewritten(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n.put(t, "10-calico.conflist", orig, 0o644)
	in := n.installer(t, Chained, "")
	if _, err := in.Install(); err != nil {
		t.Fatal(err)
	}
	good := n.read(t, "10-calico.conflist")
	n.put(t, "10-calico.conflist", bytes.Replace(good, []byte(`"/var/run/nftcni"`), []byte(`"/tmp/elsewhere"`), 1), 0o644)
	res, err := in.Install()
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Wrote) != 1 || !res.Reverted {
		t.Errorf("edited entry: wrote %v reverted %v", res.Wrote, res.Reverted)
	}
	if got := n.read(t, "10-calico.conflist"); !bytes.Equal(got, good) {
		t.Errorf("repaired file differs from the first install:\n%s", got)
	}
}

func TestMalformedPrimaryIsNeverOverwritten(t *testing.T) {
	cases := map[string]string{
		"zero-byte":       "",
		"truncated":       `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"calico"`,
		"plugins-object":  `{"cniVersion":"1.0.0","name":"k8s","plugins":{"type":"calico"}}`,
		"type-not-string": `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":42}]}`,
	}
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			for _, pinned := range []string{"", "10-calico.conflist"} {
				n := newNode(t)
				n.put(t, "10-calico.conflist", []byte(data), 0o644)
				_, err := n.installer(t, Chained, pinned).Install()
				if err == nil || !strings.Contains(err.Error(), filepath.Join(n.conf, "10-calico.conflist")) {
					t.Errorf("pinned=%q: error %v does not name the file", pinned, err)
				}
				if got := n.read(t, "10-calico.conflist"); string(got) != data {
					t.Errorf("pinned=%q: malformed file was rewritten to %q", pinned, got)
				}
			}
		})
	}
}

func TestInvalidFileIsSkippedAndReported(t *testing.T) {
	n := newNode(t)
	n.put(t, "05-broken.conflist", []byte(`{"name":`), 0o644)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-flannel.conflist"))
	n.put(t, "10-flannel.conflist", orig, 0o644)
	res, err := n.installer(t, Chained, "").Install()
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(res.Config) != "10-flannel.conflist" || len(res.Skipped) != 1 || filepath.Base(res.Skipped[0].Path) != "05-broken.conflist" {
		t.Errorf("config %s skipped %v", res.Config, res.Skipped)
	}
	if string(n.read(t, "05-broken.conflist")) != `{"name":` {
		t.Error("broken file was touched")
	}
}

func TestSymlinkedPrimaryIsNotWrittenThrough(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	target := filepath.Join(filepath.Dir(n.conf), "real.conflist")
	if err := os.WriteFile(target, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(n.conf, "10-calico.conflist")); err != nil {
		t.Fatal(err)
	}
	_, err := n.installer(t, Chained, "").Install()
	if !errors.Is(err, atomicfile.ErrSymlink) {
		t.Fatalf("err = %v, want ErrSymlink", err)
	}
	if b, _ := os.ReadFile(target); !bytes.Equal(b, orig) {
		t.Error("symlink target was modified")
	}
	if st, _ := os.Lstat(filepath.Join(n.conf, "10-calico.conflist")); st.Mode()&fs.ModeSymlink == 0 {
		t.Error("symlink was replaced")
	}
}

func TestPinnedConfName(t *testing.T) {
	n := newNode(t)
	a, _ := os.ReadFile(filepath.Join(corpusDir, "05-cilium.conflist"))
	b, _ := os.ReadFile(filepath.Join(corpusDir, "10-bridge.conf"))
	n.put(t, "05-cilium.conflist", a, 0o644)
	n.put(t, "10-bridge.conf", b, 0o644)
	in := n.installer(t, Chained, "10-bridge.conf")
	res, err := in.Install()
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(res.Config) != "10-bridge.conflist" || !bytes.Equal(n.read(t, "05-cilium.conflist"), a) {
		t.Fatalf("config %s; cilium file touched?", res.Config)
	}
	// After conversion the pinned .conf is gone; its .conflist is found.
	if res, err = in.Install(); err != nil || len(res.Wrote) != 0 {
		t.Fatalf("second pass: wrote %v err %v", res.Wrote, err)
	}
}

func TestModes(t *testing.T) {
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	for _, tc := range []struct {
		mode Mode
		file string
	}{
		{Owned, DefaultOwnedName},
		{Standalone, DefaultStandaloneName},
		{DropIn, "k8s-pod-network/" + DropInFileName},
	} {
		t.Run(string(tc.mode), func(t *testing.T) {
			n := newNode(t)
			n.put(t, "10-calico.conflist", orig, 0o644)
			before := snapshot(t, n.conf)
			// Start from a chained install, as after a mode switch.
			chained := n.installer(t, Chained, "")
			if _, err := chained.Install(); err != nil {
				t.Fatal(err)
			}
			in := n.installer(t, tc.mode, "")
			if err := in.RemoveOtherModes(); err != nil {
				t.Fatal(err)
			}
			res, err := in.Install()
			if err != nil {
				t.Fatal(err)
			}
			if got := n.read(t, "10-calico.conflist"); !bytes.Equal(got, orig) {
				t.Errorf("primary file changed in %s mode:\n%s", tc.mode, got)
			}
			ours := n.read(t, tc.file)
			if res.Config != filepath.Join(n.conf, tc.file) {
				t.Errorf("config = %s", res.Config)
			}
			switch tc.mode {
			case Owned:
				if !conflist.HasEntry(ours, templates.PluginType, in.cfg.Entry) {
					t.Errorf("owned file lacks our entry:\n%s", ours)
				}
				back, _, _ := conflist.RemoveEntries(ours, templates.PluginType)
				if !bytes.Equal(back, orig) {
					t.Errorf("owned file is not the primary plus our entry")
				}
			case Standalone:
				if gjson.GetBytes(ours, "plugins.0.type").Str != "nftcni" || gjson.GetBytes(ours, "cniVersion").Str != "1.0.0" {
					t.Errorf("standalone file:\n%s", ours)
				}
			case DropIn:
				if !conflist.SameJSON(ours, in.cfg.Entry) {
					t.Errorf("drop-in file:\n%s", ours)
				}
			}
			if err := in.Uninstall(); err != nil {
				t.Fatal(err)
			}
			sameTree(t, "after uninstall", before, snapshot(t, n.conf))
		})
	}
}

func TestOwnedFollowsPrimaryRewrite(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n.put(t, "10-calico.conflist", orig, 0o644)
	in := n.installer(t, Owned, "")
	if _, err := in.Install(); err != nil {
		t.Fatal(err)
	}
	changed := bytes.Replace(orig, []byte(`"mtu": 0`), []byte(`"mtu": 1400`), 1)
	n.put(t, "10-calico.conflist", changed, 0o644)
	if _, err := in.Install(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(n.read(t, DefaultOwnedName)), `"mtu": 1400`) {
		t.Error("owned copy did not follow the primary's change")
	}
}

// TestReadersNeverSeeAPartialFile reads the conflist continuously while the
// installer writes it hundreds of times: every read must be a whole, valid
// file (old or new), because every write is a rename of a complete file.
func TestReadersNeverSeeAPartialFile(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-aws.conflist"))
	n.put(t, "10-aws.conflist", orig, 0o644)
	in := n.installer(t, Chained, "")
	stop := make(chan struct{})
	var reads, bad int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			b, err := os.ReadFile(filepath.Join(n.conf, "10-aws.conflist"))
			reads++
			if err != nil || !gjson.ValidBytes(b) || len(b) == 0 {
				bad++
			}
		}
	}()
	for i := 0; i < 300; i++ {
		if _, err := in.Install(); err != nil {
			t.Fatal(err)
		}
		if err := in.Uninstall(); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	if bad > 0 || reads < 100 {
		t.Errorf("%d of %d reads saw a missing or partial file", bad, reads)
	}
}

func fastLoop() LoopConfig {
	lc := DefaultLoopConfig()
	lc.Debounce, lc.MaxDebounce = 10*time.Millisecond, 50*time.Millisecond
	lc.RetryBackoff = 50 * time.Millisecond
	lc.RepairRate, lc.RepairBurst = 50, 20
	return lc
}

// runLoop starts in.Run and returns a stop function that waits for it.
func runLoop(t *testing.T, in *Installer, m *Metrics, st *State) func() {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- in.Run(ctx, fastLoop(), m, st) }()
	stop := func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not stop")
		}
	}
	t.Cleanup(stop)
	return stop
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func validInstall(n *node, name string, entry []byte) bool {
	b, err := os.ReadFile(filepath.Join(n.conf, name))
	return err == nil && conflist.HasEntry(b, templates.PluginType, entry)
}

func TestRunWaitsForPrimaryThenInstalls(t *testing.T) {
	n := newNode(t)
	in := n.installer(t, Chained, "")
	st := &State{}
	runLoop(t, in, nil, st)
	time.Sleep(100 * time.Millisecond)
	if err := st.Ready(); err == nil || !strings.Contains(err.Error(), "no valid CNI network configuration") {
		t.Fatalf("ready without a primary config: %v", err)
	}
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-flannel.conflist"))
	n.put(t, "10-flannel.conflist", orig, 0o644)
	waitFor(t, "install after the primary appeared", func() bool { return validInstall(n, "10-flannel.conflist", in.cfg.Entry) })
	waitFor(t, "ready", func() bool { return st.Ready() == nil })
}

func TestRunRepairsBinaryAndConfig(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n.put(t, "10-calico.conflist", orig, 0o644)
	in := n.installer(t, Chained, "")
	m := NewMetrics(nil)
	runLoop(t, in, m, nil)
	waitFor(t, "install", func() bool { return validInstall(n, "10-calico.conflist", in.cfg.Entry) })

	bin := filepath.Join(n.bin, "nftcni")
	if err := os.Remove(bin); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "binary reinstalled after delete", func() bool { _, err := os.Stat(bin); return err == nil })
	if err := os.WriteFile(bin, []byte("tampered"), 0o755); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "binary replaced after change", func() bool {
		b, _ := os.ReadFile(bin)
		return strings.Contains(string(b), "plugin v1")
	})

	// The primary CNI restarts and rewrites its file, dropping our entry.
	n.put(t, "10-calico.conflist", orig, 0o644)
	waitFor(t, "config repaired", func() bool { return validInstall(n, "10-calico.conflist", in.cfg.Entry) })
	// The loop counts the repair just after its write lands, so wait for it.
	waitFor(t, "repair counted", func() bool { return testutil.ToFloat64(m.Repairs) >= 1 })
	if got := testutil.ToFloat64(m.Ready); got != 1 {
		t.Errorf("ready metric = %v", got)
	}
}

// TestFightWithAnotherWriter has another writer rewrite the primary file 100
// times in a burst, the way a crash-looping primary CNI does (os.WriteFile:
// truncate and write in place, so we also see half-written states). The end
// state must be valid with our entry exactly once, and the fight warning
// must name the file.
func TestFightWithAnotherWriter(t *testing.T) {
	n := newNode(t)
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "05-cilium.conflist"))
	n.put(t, "05-cilium.conflist", orig, 0o644)
	in := n.installer(t, Chained, "")
	runLoop(t, in, nil, nil)
	waitFor(t, "install", func() bool { return validInstall(n, "05-cilium.conflist", in.cfg.Entry) })
	p := filepath.Join(n.conf, "05-cilium.conflist")
	for i := 0; i < 100; i++ {
		if err := os.WriteFile(p, orig, 0o644); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	waitFor(t, "final repair", func() bool { return validInstall(n, "05-cilium.conflist", in.cfg.Entry) })
	b := n.read(t, "05-cilium.conflist")
	if c, err := conflist.Parse(p, b); err != nil || len(conflist.Entries(b, templates.PluginType)) != 1 {
		t.Fatalf("end state: %v\n%s", err, b)
	} else if c.Types[0] != "cilium-cni" {
		t.Errorf("primary plugin lost: %v", c.Types)
	}
	logs := n.logs.String()
	if !strings.Contains(logs, "another component keeps reverting") || !strings.Contains(logs, p) || !strings.Contains(logs, "cni.exclusive=false") {
		t.Errorf("no fight warning naming %s with the Cilium hint in logs:\n%s", p, logs)
	}
}

// fakePlugin puts a plugin of type typ in the node's bin dir that answers
// CNI VERSION with versions, as libcni's invoke asks it.
func (n *node) fakePlugin(t *testing.T, typ string, versions ...string) {
	t.Helper()
	list := `"` + strings.Join(versions, `","`) + `"`
	script := "#!/bin/sh\n[ \"$CNI_COMMAND\" = VERSION ] || exit 1\ncat >/dev/null\n" +
		`echo '{"cniVersion":"` + versions[len(versions)-1] + `","supportedVersions":[` + list + `]}'` + "\n"
	if err := os.WriteFile(filepath.Join(n.bin, typ), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

// The CNI project's README example: a single-plugin .conf at 0.2.0, which
// predates chaining. It is converted at the lowest version its plugin
// reports at or above 0.3.0, and uninstall gives the original bytes back.
const cniReadmeConf = `{
	"cniVersion": "0.2.0",
	"name": "mynet",
	"type": "bridge",
	"bridge": "cni0",
	"isGateway": true,
	"ipMasq": true,
	"ipam": {
		"type": "host-local",
		"subnet": "10.22.0.0/16",
		"routes": [
			{ "dst": "0.0.0.0/0" }
		]
	}
}
`

func TestConfOlderThanChainingIsConvertedAtAVersionItsPluginSpeaks(t *testing.T) {
	for _, mode := range []Mode{Chained, Owned} {
		t.Run(string(mode), func(t *testing.T) {
			n := newNode(t)
			n.fakePlugin(t, "bridge", "0.1.0", "0.2.0", "0.3.1", "0.4.0") // no 0.3.0: the answer must come from the plugin
			n.put(t, "10-mynet.conf", []byte(cniReadmeConf), 0o644)
			before := snapshot(t, n.conf)
			in := n.installer(t, mode, "")
			res, err := in.Install()
			if err != nil {
				t.Fatal(err)
			}
			got := n.read(t, filepath.Base(res.Config))
			if v := gjson.GetBytes(got, "cniVersion").Str; v != "0.3.1" {
				t.Errorf("converted at cniVersion %q, want 0.3.1 (the lowest the plugin speaks at or above 0.3.0):\n%s", v, got)
			}
			if orig := gjson.GetBytes(got, "plugins.0"); orig.Get("bridge").Str != "cni0" || orig.Get("ipam.subnet").Str != "10.22.0.0/16" {
				t.Errorf("the original plugin object is not the list's first:\n%s", got)
			}
			if !conflist.HasEntry(got, templates.PluginType, in.cfg.Entry) {
				t.Errorf("no nftcni entry:\n%s", got)
			}
			if mode == Chained && !strings.Contains(n.logs.String(), "converted-to=0.3.1") {
				t.Errorf("conversion not logged with its versions:\n%s", n.logs)
			}
			if res2, err := in.Install(); err != nil || len(res2.Wrote) != 0 {
				t.Errorf("second install wrote %v (err %v), want nothing", res2.Wrote, err)
			}
			if err := in.Uninstall(); err != nil {
				t.Fatal(err)
			}
			sameTree(t, "after uninstall", before, snapshot(t, n.conf))
		})
	}
}

func TestConfOlderThanChainingIsRefusedWhenItsPluginCannotChain(t *testing.T) {
	for _, tc := range []struct {
		name     string
		versions []string // nil: no plugin binary
		want     string
	}{
		{"plugin speaks only old versions", []string{"0.1.0", "0.2.0"}, "speaks only [0.1.0 0.2.0]"},
		{"plugin missing", nil, "cannot ask it"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			if tc.versions != nil {
				n.fakePlugin(t, "bridge", tc.versions...)
			}
			n.put(t, "10-mynet.conf", []byte(cniReadmeConf), 0o644)
			before := snapshot(t, n.conf)
			_, err := n.installer(t, Chained, "").Install()
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "predates plugin chaining") {
				t.Fatalf("install: %v, want an error saying %q", err, tc.want)
			}
			sameTree(t, "after a refused install", before, snapshot(t, n.conf))
		})
	}
}

// A node where istio-cni ran: its entry in the primary conflist and its
// binary. nftcni's entry replaces Istio's in one write (every other byte
// the primary's), and Istio's binary goes after it.
func TestTakesOverFromIstioCNI(t *testing.T) {
	n := newNode(t)
	orig, err := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	istioEntry := []byte(`{"type":"istio-cni","log_level":"info","cni_event_address":"/var/run/istio-cni/pluginevent.sock",` +
		`"ambient_enabled":true,"exclude_namespaces":["kube-system"],"kubernetes":{"kubeconfig":"/etc/cni/net.d/ZZZ-istio-cni-kubeconfig","cni_bin_dir":"/opt/cni/bin"}}`)
	withIstio, err := conflist.Insert(orig, IstioPluginType, istioEntry)
	if err != nil {
		t.Fatal(err)
	}
	n.put(t, "10-calico.conflist", withIstio, 0o644)
	if err := os.WriteFile(filepath.Join(n.bin, IstioPluginType), []byte("istio-cni"), 0o755); err != nil {
		t.Fatal(err)
	}
	in := n.installer(t, Chained, "")
	if _, err := in.Install(); err != nil {
		t.Fatal(err)
	}
	got := n.read(t, "10-calico.conflist")
	if len(conflist.Entries(got, IstioPluginType)) != 0 || !conflist.HasEntry(got, templates.PluginType, in.cfg.Entry) {
		t.Fatalf("after the takeover:\n%s", got)
	}
	want, err := conflist.Insert(orig, templates.PluginType, in.cfg.Entry)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("not the primary's bytes with nftcni's entry:\n got %s\nwant %s", got, want)
	}
	if _, err := os.Stat(filepath.Join(n.bin, IstioPluginType)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("istio-cni's binary still there: %v", err)
	}
	if !strings.Contains(n.logs.String(), "took over from istio-cni") {
		t.Errorf("the takeover is not logged:\n%s", n.logs)
	}
	if res, err := in.Install(); err != nil || len(res.Wrote) != 0 {
		t.Errorf("second install wrote %v (err %v)", res.Wrote, err)
	}
	// Uninstall leaves the primary's own bytes: istio-cni's installer puts
	// its entry back when it starts again.
	if err := in.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if got := n.read(t, "10-calico.conflist"); !bytes.Equal(got, orig) {
		t.Errorf("after uninstall:\n%s", got)
	}
}

// TestDropInNeedsAList: runtimes read drop-ins only for a .conflist
// primary (libcni's NetworkConfFromFile; a single-plugin .conf is read by
// ConfFromFile, which has no drop-ins). Drop-in mode over a .conf must not
// report an install that no runtime would load: it fails, saying why, and
// writes nothing. Over a .conflist, libcni loads our entry from the
// drop-in, last in the list.
func TestDropInNeedsAList(t *testing.T) {
	conf, _ := os.ReadFile(filepath.Join(corpusDir, "10-bridge.conf"))
	n := newNode(t)
	n.put(t, "10-bridge.conf", conf, 0o644)
	before := snapshot(t, n.conf)
	_, err := n.installer(t, DropIn, "").Install()
	if err == nil || !strings.Contains(err.Error(), ".conflist") {
		t.Errorf("drop-in over a single-plugin .conf: %v, want an error saying runtimes read drop-ins only for a .conflist", err)
	}
	sameTree(t, "after a refused drop-in install", before, snapshot(t, n.conf))

	list, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n = newNode(t)
	n.put(t, "10-calico.conflist", list, 0o644)
	if _, err := n.installer(t, DropIn, "").Install(); err != nil {
		t.Fatal(err)
	}
	loaded, err := libcni.NetworkConfFromFile(filepath.Join(n.conf, "10-calico.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	if last := loaded.Plugins[len(loaded.Plugins)-1]; last.Network.Type != templates.PluginType {
		t.Errorf("libcni loads %s last, want our drop-in's %s", last.Network.Type, templates.PluginType)
	}
}

// TestDropInNeedsARuntimeThatReadsThem: on a runtime that Kubernetes
// reports as one that reads no drop-ins (containerd before 2.1, whose
// libcni predates them; TestCRIEveryInstallMode shows 1.6 does not run
// one), drop-in mode writes nothing and says why; a runtime that reads
// them, or one it cannot judge, gets the drop-in.
func TestDropInNeedsARuntimeThatReadsThem(t *testing.T) {
	list, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	for _, c := range []struct {
		runtime string
		refused bool
	}{
		{"containerd://1.6.20", true},
		{"containerd://1.7.27", true},
		{"containerd://v2.0.5", true},
		{"containerd://2.1.0", false},
		{"containerd://2.4.2", false},
		{"containerd://3.0.0-beta.1", false},
		{"cri-o://1.33.0", false}, // cannot judge: the drop-in goes in
		{"containerd://unknown", false},
		{"", false},
	} {
		n := newNode(t)
		n.put(t, "10-calico.conflist", list, 0o644)
		before := snapshot(t, n.conf)
		in := n.installer(t, DropIn, "")
		in.SetRuntime(c.runtime)
		_, err := in.Install()
		switch {
		case c.refused && (err == nil || !strings.Contains(err.Error(), c.runtime) || !strings.Contains(err.Error(), "owned")):
			t.Errorf("%q: %v, want a refusal naming the runtime and the mode to use", c.runtime, err)
		case c.refused:
			sameTree(t, "after a refused drop-in install on "+c.runtime, before, snapshot(t, n.conf))
		case err != nil:
			t.Errorf("%q: %v, want the drop-in written", c.runtime, err)
		}
	}
}

// TestDropInMakesTheRuntimeReload: a drop-in written or removed in a
// network's dir that already exists (someone else's drop-in is there) is
// followed by an event in the conf dir that containerd reloads on: it
// watches the conf dir alone and ignores Create and Chmod events
// (TestCRIEveryInstallMode shows the pod that is not captured, and the pod
// that cannot start after an uninstall, without it).
func TestDropInMakesTheRuntimeReload(t *testing.T) {
	list, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	n := newNode(t)
	n.put(t, "10-calico.conflist", list, 0o644)
	if err := os.Mkdir(filepath.Join(n.conf, "k8s-pod-network"), 0o755); err != nil {
		t.Fatal(err)
	}
	n.put(t, "k8s-pod-network/10-other.conf", []byte(`{"type": "tuning"}`), 0o644)
	n.put(t, reloadName, nil, 0o600) // one a crash left
	in := n.installer(t, DropIn, "")
	for _, step := range []struct {
		name string
		do   func() error
	}{
		{"install", func() error { _, err := in.Install(); return err }},
		{"uninstall", in.Uninstall},
	} {
		w, err := fsnotify.NewWatcher()
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Add(n.conf); err != nil {
			t.Fatal(err)
		}
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		reload := false
		for drained := false; !drained; {
			select {
			case ev := <-w.Events:
				reload = reload || !(ev.Has(fsnotify.Create) || ev.Has(fsnotify.Chmod))
			case <-time.After(100 * time.Millisecond):
				drained = true
			}
		}
		w.Close()
		if !reload {
			t.Errorf("%s of a drop-in: no event in the conf dir that containerd reloads on", step.name)
		}
		if _, err := os.Lstat(filepath.Join(n.conf, reloadName)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s left %s: %v", step.name, reloadName, err)
		}
	}
	if _, err := os.Stat(filepath.Join(n.conf, "k8s-pod-network", "10-other.conf")); err != nil {
		t.Errorf("someone else's drop-in: %v", err)
	}
}

// TestTakesOverFromIstioInEveryMode: whatever istio-cni left — its entry in
// the primary's file, its own list 02-istio-cni.conflist (which sorts
// before ours) and its binary — is gone once ours is in place, in chained,
// owned and drop-in modes; the rest of the primary's bytes stay as they
// were. A config that still names istio-cni (an Istio network of its own)
// keeps the binary; standalone mode leaves Istio's files alone.
func TestTakesOverFromIstioInEveryMode(t *testing.T) {
	orig, _ := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	istioEntry := []byte(`{"type": "istio-cni", "cni_agent_run_dir": "/var/run/istio-cni"}`)
	withIstio, err := conflist.Insert(orig, IstioPluginType, istioEntry)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []Mode{Chained, Owned, DropIn, Standalone} {
		t.Run(string(mode), func(t *testing.T) {
			n := newNode(t)
			n.put(t, "10-calico.conflist", withIstio, 0o644)
			n.put(t, IstioOwnedName, withIstio, 0o600)
			istioBin := filepath.Join(n.bin, IstioPluginType)
			if err := os.WriteFile(istioBin, []byte("istio"), 0o755); err != nil {
				t.Fatal(err)
			}
			if _, err := n.installer(t, mode, "").Install(); err != nil {
				t.Fatal(err)
			}
			_, ownedErr := os.Stat(filepath.Join(n.conf, IstioOwnedName))
			_, binErr := os.Stat(istioBin)
			primary := n.read(t, "10-calico.conflist")
			if mode == Standalone {
				if ownedErr != nil || binErr != nil || !bytes.Equal(primary, withIstio) {
					t.Errorf("standalone mode touched Istio's files: %v %v", ownedErr, binErr)
				}
				return
			}
			if !os.IsNotExist(ownedErr) || !os.IsNotExist(binErr) {
				t.Errorf("Istio's own list (%v) or binary (%v) is left", ownedErr, binErr)
			}
			if len(conflist.Entries(primary, IstioPluginType)) != 0 {
				t.Errorf("istio-cni's entry is left in the primary:\n%s", primary)
			}
			if mode != Chained && !bytes.Equal(primary, orig) {
				t.Errorf("the primary is not its own bytes without Istio's entry:\n%s", primary)
			}
		})
	}
	// Another config naming istio-cni keeps its binary.
	n := newNode(t)
	n.put(t, "10-calico.conflist", withIstio, 0o644)
	n.put(t, "99-istio-net.conflist", []byte(`{"cniVersion":"1.0.0","name":"istio-cni","plugins":[{"type":"istio-cni"}]}`), 0o644)
	istioBin := filepath.Join(n.bin, IstioPluginType)
	_ = os.WriteFile(istioBin, []byte("istio"), 0o755)
	if _, err := n.installer(t, Owned, "").Install(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(istioBin); err != nil {
		t.Errorf("istio-cni's binary went while a config still names it: %v", err)
	}
}
