// Package containerdtest runs a private containerd with its CRI plugin the
// way a node runs it for kubelet, so tests drive the CNI chain through the
// real runtime path: RunPodSandbox → containerd's libcni → the conflist in
// a conf dir → the plugins in a bin dir. Everything lives under a temp dir
// except what containerd hard-codes (/run/containerd/s, the pods' netns
// files, cgroups), and containerd runs inside a network namespace of the
// test's, so its bridge and sysctls never touch the machine's own. All of
// it is removed at test cleanup, also when the test fails. Recipe and
// pitfalls: ../shared/reference/lab-containerd.md.
package containerdtest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/nftcni/nftcni/internal/testnet"
)

// Generation is one containerd build: its binaries' dir and the config
// format it reads.
type Generation struct {
	Name string
	// Dir holds containerd, ctr and containerd-shim-runc-v2.
	Dir string
	// V2 is containerd 2.x (config version 4, CNI STATUS, cniVersion 1.1.0).
	V2 bool
}

// Generations lists the containerd builds on this machine: Debian's 1.6
// (apt, in PATH) and 2.x built from the module proxy into
// $NFTCNI_CONTAINERD2_BIN or the Makefile's cache (make containerd-bins). With NFTCNI_REQUIRE_CRI=1
// (make test) a missing one fails the test instead of skipping it, so CI
// cannot pass by not running them.
func Generations(t testing.TB) []Generation {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run containerd")
	}
	var gens []Generation
	var missing []string
	if p, err := exec.LookPath("containerd"); err == nil {
		gens = append(gens, Generation{Name: "containerd-1.6", Dir: filepath.Dir(p)})
	} else {
		missing = append(missing, "containerd 1.6 (apt-get install containerd runc)")
	}
	if d := testnet.Cached("NFTCNI_CONTAINERD2_BIN", "containerd-v2.4.2"); exists(filepath.Join(d, "containerd")) {
		gens = append(gens, Generation{Name: "containerd-2", Dir: d, V2: true})
	} else {
		missing = append(missing, "containerd 2.x (make containerd-bins, NFTCNI_CONTAINERD2_BIN)")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		gens, missing = nil, append(missing, "runc")
	}
	if len(missing) > 0 {
		if os.Getenv("NFTCNI_REQUIRE_CRI") == "1" {
			t.Fatalf("missing: %s", strings.Join(missing, ", "))
		}
		if len(gens) == 0 {
			t.Skipf("missing: %s", strings.Join(missing, ", "))
		}
		t.Logf("not testing: %s", strings.Join(missing, ", "))
	}
	return gens
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

// Options places one containerd.
type Options struct {
	// Netns is the path of the network namespace containerd runs in (the
	// test's stand-in for the host's).
	Netns string
	// ConfDir and BinDir are CNI's: the conflist and every plugin, as on a
	// node (containerd 1.6 takes a single bin dir).
	ConfDir, BinDir string
	// Handlers are further runtime handlers, each with a CNI conf dir of
	// its own (containerd 2.x's per-handler cni_conf_dir): pods of one
	// containerd on different chains. RunOn picks one.
	Handlers map[string]string
}

// Containerd is a running private containerd and a CRI client to it.
type Containerd struct {
	Gen     Generation
	Dir     string
	Sock    string
	Runtime runtimeapi.RuntimeServiceClient
	t       testing.TB
	cmd     *exec.Cmd
	conn    *grpc.ClientConn
	metrics *http.Client // dials into containerd's netns

	mu        sync.Mutex
	sandboxes map[string]bool // ids this harness created, for cleanup
}

// Start runs containerd until the test ends, with the sandbox image
// imported and CRI reporting RuntimeReady and NetworkReady.
func Start(t testing.TB, gen Generation, o Options) *Containerd {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctrd") // short: socket paths have a length limit
	if err != nil {
		t.Fatal(err)
	}
	// Traversable, as containerd's own dirs are on a node: a pod with a
	// user namespace of its own mounts its rootfs as an unprivileged uid.
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	c := &Containerd{Gen: gen, Dir: dir, Sock: filepath.Join(dir, "containerd.sock"), t: t, sandboxes: map[string]bool{}}
	// /run/containerd is hard-coded (shim sockets); remove it afterwards
	// only if it is ours.
	_, statErr := os.Stat("/run/containerd")
	ownRun := errors.Is(statErr, os.ErrNotExist)
	t.Cleanup(func() { c.cleanup(ownRun) })

	cfg := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfg, []byte(Config(gen, Paths{Root: filepath.Join(dir, "root"), State: filepath.Join(dir, "state"),
		Sock: c.Sock, RuncRoot: filepath.Join(dir, "runc"), BinDir: o.BinDir, ConfDir: o.ConfDir, Handlers: o.Handlers,
		Metrics: metricsAddr})), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	// nsenter only switches the network namespace: the mount namespace
	// stays the host's, so pod netns files under /var/run/netns are seen by
	// the test, the plugin and the agent alike.
	c.cmd = exec.Command("nsenter", "--net="+o.Netns, "--", filepath.Join(gen.Dir, "containerd"), "--config", cfg)
	c.cmd.Env = append(os.Environ(), "PATH="+gen.Dir+":"+os.Getenv("PATH"))
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c.conn, err = grpc.NewClient("unix://"+c.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c.Runtime = runtimeapi.NewRuntimeServiceClient(c.conn)
	c.metrics = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (conn net.Conn, err error) {
			err = ns.WithNetNSPath(o.Netns, func(ns.NetNS) error {
				conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return conn, err
		}}}
	t.Cleanup(c.metrics.CloseIdleConnections)
	if err := c.waitReady(30 * time.Second); err != nil {
		t.Fatalf("%s: %v\n%s", gen.Name, err, c.Log())
	}
	c.importPause()
	return c
}

// Paths are where a containerd keeps its files and where its CNI is.
type Paths struct {
	Root, State, Sock, RuncRoot string
	BinDir, ConfDir             string
	Handlers                    map[string]string // runtime handler -> CNI conf dir (2.x only)
	Metrics                     string            // host:port of the Prometheus endpoint, if any
}

// metricsAddr is where Start's containerd serves its metrics, inside its
// own netns (one containerd per netns: the port is always free there).
const metricsAddr = "127.0.0.1:1338"

// Config is containerd's config for gen: cgroupfs (no systemd here), no
// snapshotters but overlayfs, and restrict_oom_score_adj, without which
// runc cannot start a sandbox on this machine (root lacks CAP_SYS_RESOURCE).
func Config(gen Generation, p Paths) string {
	if len(p.Handlers) > 0 && !gen.V2 {
		panic("containerdtest: runtime handlers with their own CNI conf dir need containerd 2.x")
	}
	disabled := `["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]`
	opt := filepath.Join(p.Root, "opt")
	if gen.V2 {
		return fmt.Sprintf(`version = 4
root = %[1]q
state = %[2]q
imports = []
disabled_plugins = %[3]s
[plugins.'io.containerd.server.v1.grpc']
  address = %[4]q
[plugins.'io.containerd.server.v1.ttrpc']
  address = %[5]q
[plugins.'io.containerd.internal.v1.opt']
  path = %[6]q
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[7]q
[plugins.'io.containerd.cri.v1.runtime']
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [%[8]q]
    conf_dir = %[9]q
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %[10]q
`, p.Root, p.State, disabled, p.Sock, p.Sock+".ttrpc", opt, PauseImage, p.BinDir, p.ConfDir, p.RuncRoot) + handlers(p) + metrics(p, "plugins.'io.containerd.server.v1.metrics'")
	}
	return fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = %[3]s
[grpc]
  address = %[4]q
[ttrpc]
  address = %[5]q
[plugins."io.containerd.internal.v1.opt"]
  path = %[6]q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[7]q
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[8]q
    conf_dir = %[9]q
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %[10]q
`, p.Root, p.State, disabled, p.Sock, p.Sock+".ttrpc", opt, PauseImage, p.BinDir, p.ConfDir, p.RuncRoot) + metrics(p, "metrics")
}

// metrics is the table that serves containerd's Prometheus metrics.
func metrics(p Paths, table string) string {
	if p.Metrics == "" {
		return ""
	}
	return fmt.Sprintf("[%s]\n  address = %q\n", table, p.Metrics)
}

// handlers is the runtime table of each extra handler: runc, configured
// as the default handler is, with the handler's own CNI conf dir.
func handlers(p Paths) string {
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(p.Handlers)) {
		fmt.Fprintf(&b, `    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%[1]s]
      runtime_type = "io.containerd.runc.v2"
      cni_conf_dir = %[2]q
      cni_max_conf_num = 1
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%[1]s.options]
        SystemdCgroup = false
        Root = %[3]q
`, name, p.Handlers[name], p.RuncRoot)
	}
	return b.String()
}

func (c *Containerd) waitReady(limit time.Duration) error {
	deadline := time.Now().Add(limit)
	var last error
	for time.Now().Before(deadline) {
		if c.cmd.ProcessState != nil {
			return errors.New("containerd exited")
		}
		rt, nw, reason, err := c.Ready()
		if err == nil && rt && nw {
			return nil
		}
		last = fmt.Errorf("runtime ready %v, network ready %v (%s): %v", rt, nw, reason, err)
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("CRI not ready after %v: %v", limit, last)
}

// Ready asks CRI's Status, which on containerd 2.x runs the CNI STATUS of
// a 1.1.0 conflist: the runtime's and the network's readiness, and why the
// network is not.
func (c *Containerd) Ready() (runtime, network bool, reason string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := c.Runtime.Status(ctx, &runtimeapi.StatusRequest{})
	if err != nil {
		return false, false, "", err
	}
	for _, cond := range st.GetStatus().GetConditions() {
		switch cond.Type {
		case runtimeapi.RuntimeReady:
			runtime = cond.Status
		case runtimeapi.NetworkReady:
			network = cond.Status
			reason = cond.Reason + ": " + cond.Message
		}
	}
	return runtime, network, reason, nil
}

// RuntimeVersion is the runtime as the kubelet writes it into its Node's
// status.nodeInfo.containerRuntimeVersion: CRI Version's name and version,
// name://version without a leading v.
func (c *Containerd) RuntimeVersion() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	v, err := c.Runtime.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		return "", err
	}
	return v.GetRuntimeName() + "://" + strings.TrimPrefix(v.GetRuntimeVersion(), "v"), nil
}

// Log is containerd's log so far.
func (c *Containerd) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.Dir, "containerd.log"))
	return string(b)
}

// Pod is the sandbox config kubelet would send for namespace/name.
func (c *Containerd) Pod(namespace, name, uid string, annotations map[string]string) *runtimeapi.PodSandboxConfig {
	return &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: namespace, Uid: uid},
		Hostname:     name,
		LogDirectory: filepath.Join(c.Dir, "pods", uid),
		Labels:       map[string]string{"app": name},
		Annotations:  annotations,
		Linux:        &runtimeapi.LinuxPodSandboxConfig{},
	}
}

// Run is RunPodSandbox; the sandbox is stopped and removed at cleanup if
// the test did not.
func (c *Containerd) Run(cfg *runtimeapi.PodSandboxConfig) (string, error) {
	return c.RunOn("", cfg)
}

// RunOn is Run through runtime handler (one of Options.Handlers; "" is
// the default).
func (c *Containerd) RunOn(handler string, cfg *runtimeapi.PodSandboxConfig) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := c.Runtime.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: handler})
	if err != nil {
		return "", err
	}
	c.mu.Lock()
	c.sandboxes[r.PodSandboxId] = true
	c.mu.Unlock()
	return r.PodSandboxId, nil
}

// Stop is StopPodSandbox (the first CNI DEL, with the cached result).
func (c *Containerd) Stop(id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := c.Runtime.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id})
	return err
}

// Remove is RemovePodSandbox (the second CNI DEL, with no netns).
func (c *Containerd) Remove(id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := c.Runtime.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id})
	return err
}

// NetworkSetup is containerd's own running total of the time it spent in
// CNI ADDs (network_plugin_operations_duration_seconds, set_up_pod; go-metrics adds a second _seconds: its
// timer around the whole chain, loopback included). The difference across
// one RunPodSandbox is that sandbox's network set-up, without the rest of
// the call's noise.
func (c *Containerd) NetworkSetup() (time.Duration, error) {
	const series = `containerd_cri_network_plugin_operations_duration_seconds_seconds_sum{operation_type="set_up_pod"} `
	resp, err := c.metrics.Get("http://" + metricsAddr + "/v1/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(l, series); ok {
			secs, err := strconv.ParseFloat(v, 64)
			return time.Duration(secs * float64(time.Second)), err
		}
	}
	return 0, nil // no ADD yet: containerd has not made the series
}

// Sandbox is what the runtime reports about a running sandbox.
type Sandbox struct {
	ID    string
	IP    string
	Netns string // the netns file the runtime made, as CNI_NETNS
	PID   int    // the pause process
}

// Status reads a sandbox's IP, netns path and pause pid (the verbose
// info carries the runtime spec).
func (c *Containerd) Status(id string) (Sandbox, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := c.Runtime.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		return Sandbox{}, err
	}
	s := Sandbox{ID: id, IP: st.GetStatus().GetNetwork().GetIp()}
	var info struct {
		Pid         int `json:"pid"`
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string } `json:"namespaces"`
			} `json:"linux"`
		} `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(st.GetInfo()["info"]), &info); err != nil {
		return s, fmt.Errorf("sandbox %s verbose info: %w", id, err)
	}
	s.PID = info.Pid
	for _, ns := range info.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" {
			s.Netns = ns.Path
		}
	}
	if s.Netns == "" {
		return s, fmt.Errorf("sandbox %s: no network namespace in its runtime spec", id)
	}
	return s, nil
}

// PauseImage is the sandbox image the harness builds and imports.
const PauseImage = "localhost/pause:nftcni-test"

var (
	pauseOnce sync.Once
	pauseTar  []byte
	pauseErr  error
)

// importPause builds the pause program once per test binary, packs it as
// an OCI image layout and imports it with this generation's ctr.
func (c *Containerd) importPause() {
	t := c.t
	t.Helper()
	if _, err := PauseArchive(); err != nil {
		t.Fatalf("pause image: %v", err)
	}
	p := filepath.Join(c.Dir, "pause.tar")
	if err := os.WriteFile(p, pauseTar, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(c.Gen.Dir, "ctr"), "-a", c.Sock, "-n", "k8s.io", "images", "import", p).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
}

// PauseArchive is the sandbox image PauseImage as an OCI archive, built
// once per test binary.
func PauseArchive() ([]byte, error) {
	pauseOnce.Do(func() { pauseTar, pauseErr = buildPauseImage() })
	return pauseTar, pauseErr
}

func buildPauseImage() ([]byte, error) {
	dir, err := os.MkdirTemp("", "pause")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "pause")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "github.com/nftcni/nftcni/integration/cmd/pause")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build pause: %v\n%s", err, out)
	}
	prog, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	return ociLayout(prog)
}

// ociLayout packs one static program as an OCI image layout tar whose
// index names it PauseImage (the name ctr import gives it).
func ociLayout(prog []byte) ([]byte, error) {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	if err := tw.WriteHeader(&tar.Header{Name: "pause", Mode: 0o755, Size: int64(len(prog)), Typeflag: tar.TypeReg}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(prog); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(layer.Bytes()); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	blobs := map[string][]byte{}
	blob := func(b []byte) (string, int) {
		sum := sha256.Sum256(b)
		d := hex.EncodeToString(sum[:])
		blobs[d] = b
		return "sha256:" + d, len(b)
	}
	diffSum := sha256.Sum256(layer.Bytes())
	layerDigest, layerSize := blob(gz.Bytes())
	config, _ := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Entrypoint": []string{"/pause"}, "WorkingDir": "/"},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffSum[:])}},
	})
	configDigest, configSize := blob(config)
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": configDigest, "size": configSize},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layerDigest, "size": layerSize}},
	})
	manifestDigest, manifestSize := blob(manifest)
	index, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
		"manifests": []any{map[string]any{
			"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifestDigest, "size": manifestSize,
			"platform":    map[string]string{"architecture": "amd64", "os": "linux"},
			"annotations": map[string]string{"io.containerd.image.name": PauseImage, "org.opencontainers.image.ref.name": "nftcni-test"},
		}},
	})
	var out bytes.Buffer
	ow := tar.NewWriter(&out)
	add := func(name string, b []byte) error {
		if err := ow.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := ow.Write(b)
		return err
	}
	if err := add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return nil, err
	}
	if err := add("index.json", index); err != nil {
		return nil, err
	}
	for d, b := range blobs {
		if err := add("blobs/sha256/"+d, b); err != nil {
			return nil, err
		}
	}
	if err := ow.Close(); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// cleanup stops and removes every sandbox still there, stops containerd,
// kills what its shims left, and removes its dirs, mounts and cgroups.
func (c *Containerd) cleanup(ownRun bool) {
	t := c.t
	c.mu.Lock()
	ids := make([]string, 0, len(c.sandboxes))
	for id := range c.sandboxes {
		ids = append(ids, id)
	}
	c.mu.Unlock()
	if c.cmd != nil && c.cmd.Process != nil && c.cmd.ProcessState == nil {
		for _, id := range ids {
			if err := c.Stop(id); err != nil && !strings.Contains(err.Error(), "not found") {
				t.Logf("cleanup: stopping sandbox %s: %v", id, err)
			}
			if err := c.Remove(id); err != nil && !strings.Contains(err.Error(), "not found") {
				t.Logf("cleanup: removing sandbox %s: %v", id, err)
			}
		}
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = c.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-done
		}
	}
	if c.conn != nil {
		c.conn.Close()
	}
	// Shims are started with our socket in their arguments; pause
	// processes live in the sandboxes' cgroups. Neither outlives the test.
	killMatching(c.Sock)
	for _, id := range ids {
		for _, cg := range cgroupDirs(id) {
			killCgroup(cg)
			_ = os.Remove(cg)
		}
	}
	for _, cg := range cgroupDirs("") {
		_ = os.Remove(cg) // the k8s.io parent, if empty
	}
	unmountUnder(c.Dir)
	if err := os.RemoveAll(c.Dir); err != nil {
		t.Logf("cleanup: %v", err)
	}
	if ownRun {
		_ = os.RemoveAll("/run/containerd")
	}
}

// cgroupDirs lists /sys/fs/cgroup/<hierarchy>/k8s.io/<id> (cgroupfs driver,
// the default parent) in every hierarchy.
func cgroupDirs(id string) []string {
	m, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", "k8s.io", id))
	u, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "k8s.io", id)) // cgroup v2 only
	return append(m, u...)
}

func killCgroup(dir string) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return
	}
	for _, f := range strings.Fields(string(b)) {
		var pid int
		if _, err := fmt.Sscan(f, &pid); err == nil && pid > 1 {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	for i := 0; i < 50; i++ {
		if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs")); len(bytes.TrimSpace(b)) == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func killMatching(s string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(b, []byte(s)) {
			continue
		}
		var pid int
		if _, err := fmt.Sscan(filepath.Base(filepath.Dir(p)), &pid); err == nil && pid != os.Getpid() {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
}

// unmountUnder detaches whatever containerd left mounted under dir (a
// rootfs or shm of a sandbox it had no time to remove).
func unmountUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	lines := strings.Split(string(b), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		f := strings.Fields(lines[i])
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			_ = unix.Unmount(f[4], unix.MNT_DETACH)
		}
	}
}
