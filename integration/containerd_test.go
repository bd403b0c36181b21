package integration

import (
	"bufio"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidwall/gjson"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// criPods is the agent's static pod source for the containerd tests; the
// sandboxes' metadata (namespace, name, uid) matches it, as kubelet's does
// the API server's.
func criPods() string {
	var b strings.Builder
	b.WriteString(`apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
`)
	for _, p := range []string{"mesh/app", "mesh/app2", "mesh/app3", "plain/web"} {
		ns, name, _ := strings.Cut(p, "/")
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: %s, namespace: %s, uid: uid-%s}\n", name, ns, name)
	}
	// Sidecar-injected, its proxy at Istio's default UID.
	b.WriteString(`---
apiVersion: v1
kind: Pod
metadata:
  name: sidecar
  namespace: plain
  uid: uid-sidecar
  annotations:
    sidecar.istio.io/status: '{"initContainers":["istio-validation"],"containers":["istio-proxy"],"revision":"default"}'
    traffic.sidecar.istio.io/excludeOutboundPorts: "9999"
spec:
  containers:
  - {name: app, image: app}
  - {name: istio-proxy, image: proxyv2, args: [proxy, sidecar]}
`)
	for i := range benchPods {
		for _, ns := range []string{"mesh", "plain"} {
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: bench-%d, namespace: %s, uid: uid-%s-bench-%d}\n", i, ns, ns, i)
		}
	}
	return b.String()
}

const benchPods = 40

// criNode is a node whose runtime is a real containerd: the agent process
// installs nftcni next to the primary plugins in the node's one bin dir and
// patches the primary conflist in the conf dir containerd loads, and
// kubelet's calls are made over CRI.
type criNode struct {
	t       testing.TB
	h       *host
	subnet  int
	version string // the conflists' cniVersion
	ipam    string // host-local's store
	primary string // the primary conflist's path
	podSrc  string
	agent   *exec.Cmd
	alog    *agentLog
	metrics string // the agent's /metrics URL
	z       *ztunneltest.Ztunnel
	ctrd    *containerdtest.Containerd
}

// newCRINode writes a bridge primary conflist at cniVersion version,
// starts the agent with args (nftcni: false leaves the agent out and the
// primary alone), and then containerd in the node netns.
func newCRINode(t testing.TB, gen containerdtest.Generation, subnet int, version string, chained string, args ...string) *criNode {
	t.Helper()
	n := placeCRINode(t, subnet, version, chained, args...)
	n.startContainerd(gen, nil)
	return n
}

// placeCRINode is newCRINode up to containerd's start.
func placeCRINode(t testing.TB, subnet int, version string, chained string, args ...string) *criNode {
	t.Helper()
	n := &criNode{t: t, h: newHost(t), subnet: subnet, version: version, ipam: filepath.Join(t.TempDir(), "ipam")}
	if err := os.Remove(n.h.path()); err != nil {
		t.Fatal(err)
	}
	// One bin dir for everything, as on a node (containerd 1.6 takes one).
	ref := referencePlugins(t)
	for _, p := range []string{"bridge", "host-local", "loopback", "tuning"} {
		copyFile(t, filepath.Join(ref, p), filepath.Join(n.h.bin, p))
	}
	n.primary = n.writeConflist(n.h.conf, chained)
	if chained == "nftcni" {
		n.podSrc = podSourceDir(t, criPods())
		n.startAgent(args...)
	}
	return n
}

// writeConflist writes the node's bridge conflist into dir, with reference
// tuning chained after it when chained is "tuning" (a chained plugin that
// does nothing: the control), and returns its path. Every conflist of a
// node names the same network, bridge and IPAM store.
func (n *criNode) writeConflist(dir, chained string) string {
	tail := ""
	if chained == "tuning" {
		tail = `,{"type":"tuning"}`
	}
	doc := fmt.Sprintf(`{
  "cniVersion": %q,
  "name": "crinet%d",
  "plugins": [
    {"type": "bridge", "bridge": "nftcbr%d", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.90.%d.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}}%s
  ]
}
`, n.version, n.subnet, n.subnet, n.subnet, n.ipam, tail)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		n.t.Fatal(err)
	}
	path := filepath.Join(dir, "10-crinet.conflist")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		n.t.Fatal(err)
	}
	return path
}

// startContainerd runs the node's containerd on the node's conf dir, with
// handlers (runtime handler -> CNI conf dir) beside it.
func (n *criNode) startContainerd(gen containerdtest.Generation, handlers map[string]string) {
	n.t.Helper()
	n.ctrd = containerdtest.Start(n.t, gen, containerdtest.Options{Netns: n.h.netns.Path, ConfDir: n.h.conf, BinDir: n.h.bin, Handlers: handlers})
}

// startAgent runs the agent process (again) and connects a new test
// ztunnel, which has had the agent's snapshot when this returns.
func (n *criNode) startAgent(args ...string) {
	n.t.Helper()
	waitReady(n.t, n.launchAgent(args...))
	n.connectZtunnel()
}

// launchAgent runs the agent process (again) and returns its health
// address, ready or not.
func (n *criNode) launchAgent(args ...string) string {
	t := n.t
	t.Helper()
	port := testnet.FreePort(t)
	n.metrics = fmt.Sprintf("http://127.0.0.1:%d/metrics", port)
	cmd, addr, alog := startAgent(t, n.h, append([]string{"--pod-source", n.podSrc, "--monitoring-port", fmt.Sprint(port)}, args...)...)
	n.agent, n.alog = cmd, alog
	return addr
}

// connectZtunnel connects a new test ztunnel, which has had the agent's
// snapshot when this returns.
func (n *criNode) connectZtunnel() {
	n.t.Helper()
	n.z = ztunneltest.Connect(n.t, n.h.zsock)
	n.z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
}

func (n *criNode) killAgent() {
	n.t.Helper()
	if err := n.agent.Process.Kill(); err != nil {
		n.t.Fatal(err)
	}
	_, _ = n.agent.Process.Wait()
	n.z.Close()
}

// run starts a sandbox through CRI and returns it with its netns.
func (n *criNode) run(namespace, name, uid string, ann map[string]string) (containerdtest.Sandbox, *testnet.NS) {
	t := n.t
	t.Helper()
	id, err := n.ctrd.Run(n.ctrd.Pod(namespace, name, uid, ann))
	if err != nil {
		t.Fatalf("RunPodSandbox %s/%s: %v\n%s", namespace, name, err, tail(n.ctrd.Log(), 20))
	}
	s, err := n.ctrd.Status(id)
	if err != nil {
		t.Fatal(err)
	}
	if s.IP == "" || !strings.HasPrefix(s.Netns, "/var/run/netns/") {
		t.Fatalf("sandbox %s/%s: ip %q netns %q", namespace, name, s.IP, s.Netns)
	}
	fd, err := unix.Open(s.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return s, &testnet.NS{Name: filepath.Base(s.Netns), Path: s.Netns, FD: fd}
}

// remove stops and removes a sandbox: both of the runtime's CNI DELs.
func (n *criNode) remove(s containerdtest.Sandbox) {
	n.t.Helper()
	if err := n.ctrd.Stop(s.ID); err != nil {
		n.t.Errorf("StopPodSandbox (first DEL): %v", err)
	}
	if err := n.ctrd.Remove(s.ID); err != nil {
		n.t.Errorf("RemovePodSandbox (second DEL): %v", err)
	}
}

func (n *criNode) gateway() string { return fmt.Sprintf("10.90.%d.1", n.subnet) }

// addRequests is the agent's count of ADDs it was asked to decide.
func (n *criNode) addRequests() float64 {
	t := n.t
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	resp, err := client.Get(n.metrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "istio_cni_plugin_requests_total{") && strings.Contains(l, `type="add"`) {
			var v float64
			if _, err := fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v); err == nil {
				sum += v
			}
		}
	}
	return sum
}

func openFDs(t testing.TB, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// Pods created by containerd's CRI plugin, as kubelet creates them, on
// containerd 1.6 (Debian) and 2.x (module proxy), with a 1.0.0 conflist.
func TestCRIPodsThroughNftcni(t *testing.T) {
	for i, gen := range containerdtest.Generations(t) {
		t.Run(gen.Name, func(t *testing.T) { testCRIPods(t, gen, 10+i) })
	}
}

func testCRIPods(t *testing.T, gen containerdtest.Generation, subnet int) {
	n := newCRINode(t, gen, subnet, "1.0.0", "nftcni")
	installed, err := os.ReadFile(n.primary)
	if err != nil {
		t.Fatal(err)
	}
	if v := gjson.GetBytes(installed, "cniVersion").String(); v != "1.0.0" {
		t.Errorf("installer changed the conflist's cniVersion to %q", v)
	}
	baseFDs := openFDs(t, n.agent.Process.Pid)

	// Enrolled: our ruleset in the sandbox's netns, its netns handed to
	// ztunnel, and the pod's outbound TCP landing on ztunnel's 15001.
	app, appNS := n.run("mesh", "app", "uid-app", nil)
	if err := nft.Verify(appNS.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("mesh/app's ruleset: %v", err)
	}
	n.z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	if _, err := appNS.Dial(t, "tcp", "192.0.2.1:443", testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from mesh/app: %v", err)
	}
	if a, err := testnet.Accept(t, n.z.Pod("uid-app").Outbound, 2*time.Second); err != nil {
		t.Errorf("mesh/app's outbound did not reach ztunnel: %v", err)
	} else if a.OrigDst.String() != "192.0.2.1:443" {
		t.Errorf("ztunnel sees original destination %v", a.OrigDst)
	}

	// Outside the mesh: no table, and traffic goes straight to its peer.
	web, webNS := n.run("plain", "web", "uid-web", nil)
	if hasTable(t, webNS) {
		t.Error("plain/web got a ruleset")
	}
	upstream := n.h.netns.Listen(t, n.gateway()+":8080", false)
	if _, err := webNS.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from plain/web: %v", err)
	}
	if a, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("plain/web's connection did not arrive: %v", err)
	} else if a.Remote.Addr() != netip.MustParseAddr(web.IP) {
		t.Errorf("plain/web's connection came from %v, want %s", a.Remote, web.IP)
	}

	// Sidecar-injected: containerd passes the pod's annotations in
	// runtimeConfig; the agent decides the ruleset from the pod's spec (the
	// proxy's UID) and annotations, and the plugin programs it.
	ann := map[string]string{
		istio.AnnSidecarStatus:        `{"initContainers":["istio-validation"],"containers":["istio-proxy"],"revision":"default"}`,
		istio.AnnExcludeOutboundPorts: "9999",
	}
	before := n.addRequests()
	sc, scNS := n.run("plain", "sidecar", "uid-sidecar", ann)
	spec, err := capture.ParseSidecar(ann, capture.SidecarProxy{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Verify(scNS.FD, capture.Sidecar(spec)); err != nil {
		t.Errorf("sidecar ruleset from runtime annotations: %v", err)
	}
	if after := n.addRequests(); after != before+1 {
		t.Errorf("the agent decided %v ADDs for the sidecar pod, want 1", after-before)
	}
	proxy := scNS.Listen(t, ":15001", false)
	if _, err := scNS.Dial(t, "tcp", n.gateway()+":80", testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, proxy, 2*time.Second); err != nil {
		t.Errorf("sidecar pod's outbound did not land on 15001: %v", err)
	}

	// Stop and remove: both DELs succeed, and the pod's rules, ztunnel
	// state, agent record and host probe entry all go.
	for _, s := range []containerdtest.Sandbox{app, web, sc} {
		n.remove(s)
		if _, err := os.Stat(s.Netns); !os.IsNotExist(err) {
			t.Errorf("netns %s still there after remove: %v", s.Netns, err)
		}
	}
	n.z.Wait(zds.KindDel, "uid-app", 5*time.Second)
	if recs, _ := os.ReadDir(filepath.Join(n.h.run, records.DirName)); len(recs) != 0 {
		t.Errorf("agent records left after removal: %v", recs)
	}
	if set := probeSet(t, n.h.netns); strings.Contains(set, app.IP) {
		t.Errorf("host probe set still holds %s:\n%s", app.IP, set)
	}
	// (The agent closes a plugin's connection when the plugin hangs up,
	// a moment after the runtime's call returned.)
	fds := openFDs(t, n.agent.Process.Pid)
	for deadline := time.Now().Add(2 * time.Second); fds > baseFDs && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		fds = openFDs(t, n.agent.Process.Pid)
	}
	if fds > baseFDs {
		t.Errorf("agent holds %d fds after all pods went, %d before", fds, baseFDs)
	}

	// Agent killed and restarted while a pod runs: the pod keeps capture
	// throughout, ztunnel gets it again in the new agent's snapshot, and a
	// new pod still starts enrolled.
	app2, app2NS := n.run("mesh", "app2", "uid-app2", nil)
	n.z.Wait(zds.KindAdd, "uid-app2", 5*time.Second)
	n.killAgent()
	if err := nft.Verify(app2NS.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("mesh/app2's ruleset with the agent down: %v", err)
	}
	n.startAgent()
	if n.z.Pod("uid-app2") == nil {
		t.Fatalf("the restarted agent's snapshot to ztunnel lacks mesh/app2 (has %v)", n.z.UIDs())
	}
	if _, err := app2NS.Dial(t, "tcp", "192.0.2.2:80", testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from mesh/app2: %v", err)
	}
	if _, err := testnet.Accept(t, n.z.Pod("uid-app2").Outbound, 2*time.Second); err != nil {
		t.Errorf("mesh/app2's outbound after the agent's restart: %v", err)
	}
	app3, app3NS := n.run("mesh", "app3", "uid-app3", nil)
	n.z.Wait(zds.KindAdd, "uid-app3", 5*time.Second)
	if err := nft.Verify(app3NS.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("mesh/app3 after the restart: %v", err)
	}
	n.remove(app2)
	n.remove(app3)
	n.z.Wait(zds.KindDel, "uid-app3", 5*time.Second)
}

// containerd 2.x with a 1.1.0 conflist runs CNI STATUS on every CRI
// Status call: with status_requires_agent the node's NetworkReady follows
// the agent; without it the node stays ready and pods fall back to the
// policy snapshot.
func TestCRIStatusFollowsAgent(t *testing.T) {
	var gen *containerdtest.Generation
	for _, g := range containerdtest.Generations(t) {
		if g.V2 {
			gen = &g
		}
	}
	if gen == nil {
		t.Skip("needs containerd 2.x (containerd 1.6 refuses cniVersion 1.1.0 results)")
	}
	for i, optIn := range []bool{true, false} {
		t.Run(fmt.Sprintf("status_requires_agent=%v", optIn), func(t *testing.T) {
			n := newCRINode(t, *gen, 20+i, "1.1.0", "nftcni", fmt.Sprintf("--status-requires-agent=%v", optIn))
			if v := gjson.GetBytes(mustRead(t, n.primary), "cniVersion").String(); v != "1.1.0" {
				t.Errorf("cniVersion after install: %q", v)
			}
			s, podNS := n.run("mesh", "app", "uid-app", nil)
			if !hasTable(t, podNS) {
				t.Error("no ruleset with a 1.1.0 conflist")
			}
			n.killAgent()
			_, ready, reason, err := n.ctrd.Ready()
			if err != nil {
				t.Fatal(err)
			}
			if ready == optIn {
				t.Errorf("NetworkReady %v with the agent down (%s), want %v", ready, reason, !optIn)
			}
			if optIn && !strings.Contains(reason, "plugin.sock") {
				t.Errorf("NetworkReady reason does not name the agent's socket: %s", reason)
			}
			n.startAgent(fmt.Sprintf("--status-requires-agent=%v", optIn))
			if _, ready, reason, _ := n.ctrd.Ready(); !ready {
				t.Errorf("NetworkReady false with the agent back: %s", reason)
			}
			n.remove(s)
		})
	}
}

// probeSet lists the host probe set's v4 elements in the netns host.
func probeSet(t testing.TB, host *testnet.NS) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", host.Name, "nft", "list", "set", "inet", nft.HostTable, "probe-v4").CombinedOutput()
	if err != nil {
		t.Fatalf("listing the probe set: %v\n%s", err, out)
	}
	return string(out)
}

func mustRead(t testing.TB, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func copyFile(t testing.TB, from, to string) {
	t.Helper()
	if err := installFile(from, to); err != nil {
		t.Fatal(err)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
