// Package integration runs the built nftcni binaries the way a node runs
// them: as processes, configured by flags and env vars, killed by signals.
package integration

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/integration/conformance"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/internal/testnet"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "nftcni-integration-bin")
	if err != nil {
		panic(err)
	}
	binDir = dir
	// Built as `make build` does, so what the tests exec is what ships:
	// the plugin with the Makefile's PLUGIN_GOEXPERIMENT, and the Go
	// baselines the benchmarks hold it against built the same way.
	if err := buildBinaries(dir); err != nil {
		fmt.Fprintf(os.Stderr, "building binaries: %v\n", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	conformance.Suite.Print(os.Stdout, "live:")
	os.Exit(code)
}

// buildBinaries builds what the tests exec and installs it into dir.
func buildBinaries(dir string) error {
	staging, err := os.MkdirTemp("", "nftcni-integration-build")
	if err != nil {
		return err
	}
	defer os.RemoveAll(staging)
	exp := "nogreenteagc" // the Makefile's PLUGIN_GOEXPERIMENT, when the toolchain knows it
	probe := exec.Command("go", "env", "GOEXPERIMENT")
	probe.Env = append(os.Environ(), "GOEXPERIMENT="+exp)
	if probe.Run() != nil {
		exp = ""
	}
	for _, b := range []struct {
		experiment string
		pkgs       []string
	}{
		{exp, []string{"../plugin/cmd/nftcni", "./cmd/nullplugin", "./cmd/askplugin", "./cmd/hello", "./cmd/ztunnel-gate"}}, // the plugin and its benchmark baselines
		{"", []string{"../agent/cmd/nftcni-agent", "./cmd/nodeapp", "./cmd/ztunnel-stub"}},
	} {
		build := exec.Command("go", append([]string{"build", "-trimpath", "-ldflags", "-s -w", "-o", staging + "/"}, b.pkgs...)...)
		build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOEXPERIMENT="+b.experiment)
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v\n%s", b.pkgs, err, out)
		}
	}
	return installDir(staging, dir)
}

// installDir writes a copy of every file in from into to, as a node's
// binaries are installed (the agent writes its plugin; packages and image
// layers write theirs). Here a binary exec'd from pages it was written
// through runs 0.1-0.2 ms faster than one whose pages came in through
// exec's own page faults, as the Go linker's output renamed into place
// does (measured: 1.41 against 1.54 ms for the same bytes, and the copy
// as slow once its pages are dropped): every binary a benchmark compares
// must come the same way.
func installDir(from, to string) error {
	ents, err := os.ReadDir(from)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := installFile(filepath.Join(from, e.Name()), filepath.Join(to, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func installFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

type host struct {
	conf, bin, run, zsock string
	// netns stands in for the host netns (the probe SNAT table goes there),
	// so no test touches the machine's own.
	netns *testnet.NS
	orig  []byte
	// env is added to the agent's environment.
	env []string
}

const primary = "10-calico.conflist"

func newHost(t testing.TB) *host {
	t.Helper()
	root := t.TempDir()
	testnet.RequireRoot(t)
	h := &host{conf: filepath.Join(root, "net.d"), bin: filepath.Join(root, "bin"), run: filepath.Join(root, "run"),
		zsock: filepath.Join(root, "ztunnel", "ztunnel.sock"), netns: testnet.NewNS(t, "nfthost")}
	for _, d := range []string{h.conf, h.bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var err error
	if h.orig, err = os.ReadFile("../conflist/testdata/corpus/" + primary); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(h.path(), h.orig, 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

func (h *host) path() string { return filepath.Join(h.conf, primary) }

// agent builds an nftcni-agent command configured through env-var twins.
func (h *host) agent(args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(binDir, "nftcni-agent"), args...)
	cmd.Env = append(os.Environ(),
		"CNI_CONF_DIR="+h.conf, "CNI_BIN_DIR="+h.bin, "CNI_AGENT_RUN_DIR="+h.run,
		"ZTUNNEL_UDS_ADDRESS="+h.zsock, "HOST_NETNS="+h.netns.Path,
		"PLUGIN_BINARY="+filepath.Join(binDir, "nftcni"), "LOG_LEVEL=info")
	if p := os.Getenv("NFTCNI_AGENT_GOMAXPROCS"); p != "" {
		// Benchmarks: the agent's Ps as the chart sets them (agent.maxProcs).
		cmd.Env = append(cmd.Env, "GOMAXPROCS="+p)
	}
	cmd.Env = append(cmd.Env, h.env...)
	return cmd
}

func (h *host) entries(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile(h.path())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conflist.Parse(h.path(), b); err != nil {
		t.Fatalf("primary config is not valid: %v\n%s", err, b)
	}
	return len(conflist.Entries(b, "nftcni"))
}

func run(t *testing.T, cmd *exec.Cmd) string {
	t.Helper()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, out)
	}
	return string(out)
}

func TestInstallOnceAndUninstall(t *testing.T) {
	h := newHost(t)
	run(t, h.agent("install", "--once"))
	if n := h.entries(t); n != 1 {
		t.Fatalf("%d entries after install", n)
	}
	installed, _ := os.ReadFile(h.path())
	out := run(t, exec.Command("sh", "-c", "CNI_COMMAND=VERSION "+filepath.Join(h.bin, "nftcni")+" </dev/null"))
	if !strings.Contains(out, `"supportedVersions"`) {
		t.Errorf("installed plugin does not answer VERSION: %s", out)
	}
	// A flag wins over its env twin: this conf dir does not exist, so it must fail.
	if out, err := h.agent("install", "--once", "--cni-conf-dir", filepath.Join(h.conf, "missing")).CombinedOutput(); err == nil {
		t.Errorf("flag did not override env: %s", out)
	}
	run(t, h.agent("install", "--once"))
	if again, _ := os.ReadFile(h.path()); !bytes.Equal(again, installed) {
		t.Error("second install changed the file")
	}
	run(t, h.agent("uninstall"))
	if got, _ := os.ReadFile(h.path()); !bytes.Equal(got, h.orig) {
		t.Errorf("uninstall did not restore the original bytes:\n%s", got)
	}
	if _, err := os.Stat(filepath.Join(h.bin, "nftcni")); err == nil {
		t.Error("plugin binary left after uninstall")
	}
}

func TestUnknownModeIsAClearError(t *testing.T) {
	h := newHost(t)
	out, err := h.agent("install", "--once", "--mode", "sideways").CombinedOutput()
	if err == nil || !strings.Contains(string(out), `unknown install mode "sideways"`) {
		t.Errorf("err %v, output %s", err, out)
	}
	if got, _ := os.ReadFile(h.path()); !bytes.Equal(got, h.orig) {
		t.Error("config touched on a usage error")
	}
}

// agentLog collects an agent's stderr for as long as it runs.
type agentLog struct {
	mu   sync.Mutex
	b    bytes.Buffer
	done chan struct{} // closed at EOF: the agent has exited
}

func (l *agentLog) add(line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.WriteString(line + "\n")
}

func (l *agentLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// stop sends SIGTERM and waits for the agent to exit, its log read to the end.
func (l *agentLog) stop(t testing.TB, cmd *exec.Cmd) error {
	t.Helper()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-l.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("agent did not exit within 30 s of SIGTERM:\n%s", l)
	}
	return cmd.Wait()
}

// startAgent runs `nftcni-agent run` and returns it with its health address
// and its log.
func startAgent(t testing.TB, h *host, extra ...string) (*exec.Cmd, string, *agentLog) {
	t.Helper()
	args := append([]string{"run", "--health-addr", "127.0.0.1:0", "--monitoring-port", "0"}, extra...)
	cmd := h.agent(args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
	logs := &agentLog{done: make(chan struct{})}
	addrRe := regexp.MustCompile(`serving /healthz and /readyz" addr=(\S+)`)
	sc := bufio.NewScanner(stderr)
	addr := ""
	for addr == "" && sc.Scan() {
		logs.add(sc.Text())
		if m := addrRe.FindStringSubmatch(sc.Text()); m != nil {
			addr = m[1]
		}
	}
	if addr == "" {
		t.Fatalf("agent did not report its health address:\n%s", logs)
	}
	go func() {
		defer close(logs.done)
		for sc.Scan() {
			logs.add(sc.Text())
		}
		_, _ = io.Copy(io.Discard, stderr) // past an over-long line: keep the agent unblocked
	}()
	return cmd, addr, logs
}

func waitReady(t testing.TB, addr string) { t.Helper(); waitReadyEvery(t, addr, 20*time.Millisecond) }

// waitReadyEvery is waitReady polling every interval.
func waitReadyEvery(t testing.TB, addr string, every time.Duration) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		time.Sleep(every)
	}
	t.Fatal("agent never became ready")
}

// Off Kubernetes, --on-exit auto (the default) keeps the install, as for a
// restart; --on-exit uninstall restores the original bytes.
func TestRunKeepsInstallOnRestartAndUninstallsWhenAsked(t *testing.T) {
	h := newHost(t)
	cmd, addr, logs := startAgent(t, h)
	waitReady(t, addr)
	if n := h.entries(t); n != 1 {
		t.Fatalf("%d entries while running", n)
	}
	if err := logs.stop(t, cmd); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	if n := h.entries(t); n != 1 {
		t.Errorf("--on-exit auto off Kubernetes: %d entries after SIGTERM, want 1", n)
	}
	if !strings.Contains(logs.String(), "not on Kubernetes, keeping the plugin") {
		t.Errorf("no exit decision logged:\n%s", logs)
	}

	cmd, addr, logs = startAgent(t, h, "--on-exit", "uninstall")
	waitReady(t, addr)
	if err := logs.stop(t, cmd); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	if got, _ := os.ReadFile(h.path()); !bytes.Equal(got, h.orig) {
		t.Errorf("--on-exit uninstall did not restore the original:\n%s", got)
	}
}

// TestSIGKILLAtRandomPointsLeavesValidFiles kills the agent with SIGKILL at
// random moments while another writer fights over the primary's file. After
// every kill the file must be a complete, valid config (old or new, never
// half-written) holding at most one entry of ours, and no file a runtime
// would load may be left behind. A final install gives exactly one entry and
// uninstall the original bytes.
func TestSIGKILLAtRandomPointsLeavesValidFiles(t *testing.T) {
	h := newHost(t)
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	for i := 0; i < 20; i++ {
		cmd := h.agent("run", "--health-addr", "127.0.0.1:0", "--monitoring-port", "0")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
		deadline := time.Now().Add(time.Duration(20+rng.Intn(200)) * time.Millisecond)
		for time.Now().Before(deadline) { // the primary rewrites its file meanwhile
			if err := atomicfile.WriteFile(h.path(), h.orig, nil); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(rng.Intn(15)) * time.Millisecond)
		}
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		if n := h.entries(t); n > 1 {
			t.Fatalf("kill %d: %d entries of ours", i, n)
		}
		ents, _ := os.ReadDir(h.conf)
		for _, e := range ents {
			if e.Name() != primary && conflist.Loadable(e.Name()) {
				t.Fatalf("kill %d: stray loadable file %s", i, e.Name())
			}
		}
	}
	run(t, h.agent("install", "--once"))
	if n := h.entries(t); n != 1 {
		t.Fatalf("%d entries after recovery install", n)
	}
	run(t, h.agent("uninstall"))
	if got, _ := os.ReadFile(h.path()); !bytes.Equal(got, h.orig) {
		t.Error("uninstall after kills did not restore the original")
	}
}
