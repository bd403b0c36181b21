package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/enrol"
	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
	"github.com/nftcni/nftcni/templates"
)

// referencePlugins is the dir holding the reference CNI plugins that
// `make cni-plugins` builds from the Go module proxy.
func referencePlugins(t testing.TB) string {
	t.Helper()
	dir := testnet.Cached("NFTCNI_CNI_BIN", "cni-plugins-v1.10.0")
	for _, p := range []string{"bridge", "loopback", "ptp", "host-local", "portmap"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Fatalf("reference CNI plugin %s not found in %s: run `make cni-plugins` (make test does) or set NFTCNI_CNI_BIN", p, dir)
		}
	}
	// Installed once per test binary, as nftcni is (installDir).
	refOnce.Do(func() {
		refDir = filepath.Join(binDir, "reference")
		if refErr = os.Mkdir(refDir, 0o755); refErr == nil {
			refErr = installDir(dir, refDir)
		}
	})
	if refErr != nil {
		t.Fatalf("installing the reference CNI plugins: %v", refErr)
	}
	return refDir
}

var (
	refOnce sync.Once
	refDir  string
	refErr  error
)

// syncBuffer is a goroutine-safe log sink tests can read.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// cniNode is a throw-away node: its own netns (the primary CNI's bridge
// lives there, and it stands in for the host netns, where the probe SNAT
// table goes), run/data/cache dirs, and the agent's enrolment side started
// in-process the way the agent binary starts it (package node), with pods
// from an in-memory store the test fills. Tests start and stop the agent;
// a test ztunnel connects each time it starts.
type cniNode struct {
	t      testing.TB
	node   *testnet.NS
	subnet int
	run    string
	data   string
	cni    *libcni.CNIConfig
	store  *podsource.Store
	policy *enablement.Policy
	log    *syncBuffer
	zsock  string
	// agent is the running enrolment side (nil when stopped), reg its
	// metrics, ztunnel the test ztunnel connected to it.
	agent   *node.Node
	reg     *prometheus.Registry
	ztunnel *ztunneltest.Ztunnel
	// agentWait is our entry's agent_wait_seconds: 0 (an ADD without the
	// agent fails at once) unless a test sets it.
	agentWait float64
	// pluginLogLevel is our entry's plugin_log_level: debug for tests,
	// the product's default (info) for benchmarks.
	pluginLogLevel string
	// wide gives the pod network a /22 (10.<100+subnet>.0.0) for more than
	// 254 pods; the default is 10.88.<subnet>.0/24.
	wide bool
	// state is the agent's state dir (the policy snapshot), "" for none.
	state string
}

// podRange is the pod network's subnet; gateway its bridge's address.
func (n *cniNode) podRange() string {
	if n.wide {
		return fmt.Sprintf("10.%d.0.0/22", 100+n.subnet)
	}
	return fmt.Sprintf("10.88.%d.0/24", n.subnet)
}

func (n *cniNode) gateway() string {
	if n.wide {
		return fmt.Sprintf("10.%d.0.1", 100+n.subnet)
	}
	return fmt.Sprintf("10.88.%d.1", n.subnet)
}

const (
	meshNS  = "mesh"  // labelled istio.io/dataplane-mode=ambient
	plainNS = "plain" // not labelled
)

func newCNINode(t testing.TB, subnet int) *cniNode {
	testnet.RequireRoot(t)
	root := t.TempDir()
	n := &cniNode{t: t, node: testnet.NewNS(t, "nftnode"), subnet: subnet,
		run: filepath.Join(root, "run"), data: filepath.Join(root, "ipam"), log: &syncBuffer{},
		zsock: filepath.Join(root, "ztunnel", "ztunnel.sock"), pluginLogLevel: "debug"}
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{referencePlugins(t), binDir}, filepath.Join(root, "cache"), nil)
	n.store = podsource.NewStore()
	n.store.PutNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: meshNS,
		Labels: map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient}}})
	n.store.PutNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: plainNS}})
	var err error
	if n.policy, err = enablement.Compile(enablement.DefaultConfig()); err != nil {
		t.Fatal(err)
	}
	return n
}

// probeSet lists the host probe set's v4 elements in the node netns.
func (n *cniNode) probeSet(t *testing.T) string { return probeSet(t, n.node) }

// enroller is the running agent's enrolment state machine.
func (n *cniNode) enroller() *enrol.Enroller { return n.agent.Enroller }

// startAgent starts the agent's enrolment side until stopAgent or the
// test's end, and connects a test ztunnel, which has had its snapshot
// when startAgent returns. Verification passes are left to the test.
func (n *cniNode) startAgent() {
	t := n.t
	n.reg = prometheus.NewRegistry()
	// The agent logs at the plugin's level, so that the plugin's records
	// it forwards are kept.
	var level slog.Level
	if err := level.UnmarshalText([]byte(n.pluginLogLevel)); err != nil {
		t.Fatal(err)
	}
	a, err := node.Start(context.Background(), node.Config{RunDir: n.run, StateDir: n.state, HostNetns: n.node.Path, ZtunnelSocket: n.zsock,
		IPv6: true, Policy: n.policy, Store: n.store, LookupRetries: 2, Registry: n.reg,
		Log: slog.New(slog.NewTextHandler(n.log, &slog.HandlerOptions{Level: level}))})
	if err != nil {
		t.Fatalf("starting the agent: %v\n%s", err, n.log)
	}
	n.agent = a
	t.Cleanup(n.stopAgent)
	n.ztunnel = ztunneltest.Connect(t, n.zsock)
	n.ztunnel.Wait(zds.KindSnapshotSent, "", 3*time.Second)
	for deadline := time.Now().Add(3 * time.Second); !a.ZDS.Connected(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("test ztunnel never registered")
		}
	}
}

func (n *cniNode) stopAgent() {
	if n.agent != nil {
		n.agent.Stop()
		n.agent = nil
	}
	if n.ztunnel != nil {
		n.ztunnel.Close()
		n.ztunnel = nil
	}
}

// metric reads a counter or gauge of the running agent by name and labels.
func (n *cniNode) metric(name string, labels ...string) float64 {
	n.t.Helper()
	return gathered(n.t, n.reg, name, labels...)
}

// pod registers a pod in the agent's store.
func (n *cniNode) pod(namespace, name string, ann map[string]string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name,
		UID: k8stypes.UID("uid-" + name), Annotations: ann}}
	n.store.PutPod(p)
	return p
}

// entry is our conflist entry as the installer renders it.
func (n *cniNode) entry(statusRequiresAgent bool) []byte {
	v := templates.Values{LogLevel: n.pluginLogLevel, AgentRunDir: n.run, ExcludeNamespaces: []string{"kube-system"},
		PodNamespace: "nftcni-system", StatusRequiresAgent: statusRequiresAgent, AgentWaitSeconds: &n.agentWait}
	if n.state != "" {
		v.PolicySnapshot = filepath.Join(n.state, wire.PolicyName)
	}
	e, err := templates.PluginEntry(v)
	if err != nil {
		n.t.Fatal(err)
	}
	return e
}

// primary is a primary CNI's conflist: "bridge" (loopback + bridge +
// host-local) or "ptp" (ptp + host-local + portmap on its nftables backend,
// the shape of Calico- and Flannel-style chains).
func (n *cniNode) primary(shape, version string) []byte {
	ipam := fmt.Sprintf(`{"type":"host-local","ranges":[[{"subnet":%q}]],"routes":[{"dst":"0.0.0.0/0"}],"dataDir":%q}`, n.podRange(), n.data)
	var plugins string
	switch shape {
	case "bridge":
		plugins = fmt.Sprintf(`{"type":"loopback"},{"type":"bridge","bridge":"nftbr%d","isGateway":true,"ipMasq":false,"ipam":%s}`, n.subnet, ipam)
	case "ptp":
		plugins = fmt.Sprintf(`{"type":"ptp","ipMasq":false,"ipam":%s},{"type":"portmap","backend":"nftables","capabilities":{"portMappings":true}}`, ipam)
	default:
		n.t.Fatalf("unknown shape %s", shape)
	}
	return []byte(fmt.Sprintf("{\n  \"cniVersion\": %q,\n  \"name\": \"nftnet%d\",\n  \"plugins\": [%s]\n}\n", version, n.subnet, plugins))
}

// list parses a conflist; with nftcni, our entry is inserted the way the
// installer does it.
func (n *cniNode) list(shape, version string, withNftcni, statusRequiresAgent bool) *libcni.NetworkConfigList {
	doc := n.primary(shape, version)
	if withNftcni {
		var err error
		if doc, err = conflist.Insert(doc, templates.PluginType, n.entry(statusRequiresAgent)); err != nil {
			n.t.Fatal(err)
		}
	}
	l, err := libcni.NetworkConfFromBytes(doc)
	if err != nil {
		n.t.Fatalf("parsing conflist: %v\n%s", err, doc)
	}
	return l
}

func runtimeConf(pod *testnet.NS, namespace, name string, ann map[string]string) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{ContainerID: "ctr-" + pod.Name, NetNS: pod.Path, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", namespace}, {"K8S_POD_NAME", name},
			{"K8S_POD_UID", "uid-" + name}, {"K8S_POD_INFRA_CONTAINER_ID", "ctr-" + pod.Name}},
		CapabilityArgs: map[string]any{"portMappings": []map[string]any{{"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"}}},
	}
	if ann != nil {
		rt.CapabilityArgs["io.kubernetes.cri.pod-annotations"] = ann
	}
	return rt
}

// inNode runs a libcni call from the node netns, as the runtime would run
// on the node: the primary plugins make their host side there.
func (n *cniNode) inNode(f func() error) error {
	var err error
	if nerr := ns.WithNetNSPath(n.node.Path, func(ns.NetNS) error { err = f(); return nil }); nerr != nil {
		return nerr
	}
	return err
}

func (n *cniNode) add(l *libcni.NetworkConfigList, rt *libcni.RuntimeConf) (types.Result, error) {
	var r types.Result
	err := n.inNode(func() error {
		var err error
		r, err = n.cni.AddNetworkList(context.Background(), l, rt)
		return err
	})
	return r, err
}

func (n *cniNode) del(l *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
	return n.inNode(func() error { return n.cni.DelNetworkList(context.Background(), l, rt) })
}

func (n *cniNode) check(l *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
	return n.inNode(func() error { return n.cni.CheckNetworkList(context.Background(), l, rt) })
}

// execNftcni runs our plugin alone with prevResult, exactly as libcni runs
// a chained plugin (config + name + cniVersion + prevResult on stdin).
func (n *cniNode) execNftcni(command, version string, prev types.Result, rt *libcni.RuntimeConf) ([]byte, error) {
	conf := map[string]any{}
	if err := json.Unmarshal(n.entry(false), &conf); err != nil {
		return nil, err
	}
	conf["name"], conf["cniVersion"] = fmt.Sprintf("nftnet%d", n.subnet), version
	var pb bytes.Buffer
	if err := prev.PrintTo(&pb); err != nil {
		return nil, err
	}
	conf["prevResult"] = json.RawMessage(pb.Bytes())
	stdin, _ := json.Marshal(conf)
	args := &invoke.Args{Command: command, ContainerID: rt.ContainerID, NetNS: rt.NetNS, IfName: rt.IfName,
		PluginArgs: rt.Args, Path: binDir}
	var out []byte
	err := n.inNode(func() error {
		var err error
		out, err = (&invoke.RawExec{Stderr: os.Stderr}).ExecPlugin(context.Background(), filepath.Join(binDir, "nftcni"), stdin, args.AsEnv())
		return err
	})
	return out, err
}

// hasTable says whether our table is in the pod netns, read back with nft.
func hasTable(t *testing.T, pod *testnet.NS) bool {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", pod.Name, "nft", "list", "tables").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list tables: %v\n%s", err, out)
	}
	return strings.Contains(string(out), "table inet "+nft.PodTable)
}

// podIPs are the addresses a result gives the pod.
func podIPs(t *testing.T, r types.Result) []netip.Addr {
	t.Helper()
	res, err := current.NewResultFromResult(r)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, ip := range res.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		out = append(out, a.Unmap())
	}
	return out
}

// gateway is the node side of the pod's network (bridge or ptp host end).
func gateway(t *testing.T, r types.Result) netip.Addr {
	t.Helper()
	res, err := current.NewResultFromResult(r)
	if err != nil || len(res.IPs) == 0 || res.IPs[0].Gateway == nil {
		t.Fatalf("result has no gateway: %v %v", err, r)
	}
	a, _ := netip.AddrFromSlice(res.IPs[0].Gateway)
	return a.Unmap()
}

func TestCNIChainEndToEnd(t *testing.T) {
	subnet := 40
	for _, shape := range []string{"bridge", "ptp"} {
		for _, version := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
			subnet++
			t.Run(shape+"/"+version, func(t *testing.T) { testChain(t, subnet, shape, version) })
		}
	}
}

func testChain(t *testing.T, subnet int, shape, version string) {
	n := newCNINode(t, subnet)
	n.startAgent()
	full := n.list(shape, version, true, false)
	primaryOnly := n.list(shape, version, false, false)

	// Enrolled pod: run the primary chain, then nftcni with its result as
	// prevResult, as libcni does: nftcni must hand back the same result.
	enrolled := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "app", nil)
	rt := runtimeConf(enrolled, meshNS, "app", nil)
	prev, err := n.add(primaryOnly, rt)
	if err != nil {
		t.Fatalf("primary ADD: %v", err)
	}
	out, err := n.execNftcni("ADD", version, prev, rt)
	if err != nil {
		t.Fatalf("nftcni ADD: %v\n%s", err, n.log)
	}
	var want bytes.Buffer
	_ = prev.PrintTo(&want)
	if !conflist.SameJSON(out, want.Bytes()) {
		t.Errorf("nftcni changed the result:\n got %s\nwant %s", out, want.Bytes())
	}
	if !hasTable(t, enrolled) {
		t.Fatalf("no table inet %s in the enrolled pod", nft.PodTable)
	}
	if got := n.enroller().Members(); len(got) != 1 || got[0].Pod.Name != "app" || got[0].Mode != wire.ModeAmbient {
		t.Errorf("agent members = %+v, want app/ambient", got)
	}
	if !strings.Contains(n.log.String(), "source=plugin") {
		t.Errorf("plugin logs were not forwarded to the agent:\n%s", n.log)
	}

	// ztunnel got the pod's netns over ZDS before the rules went in, its
	// IPs are in the host probe set, and its outbound TCP lands on the
	// 15001 listener ztunnel opened inside the pod.
	e := n.ztunnel.Wait(zds.KindAdd, "uid-app", 2*time.Second)
	if e.Info == nil || e.Info.Name != "app" || e.Info.Namespace != meshNS {
		t.Errorf("ZDS Add carried %+v", e.Info)
	}
	podIP := podIPs(t, prev)[0]
	if set := n.probeSet(t); !strings.Contains(set, podIP.String()+` comment "uid-app"`) {
		t.Errorf("host probe set lacks %s for uid-app:\n%s", podIP, set)
	}
	gw := gateway(t, prev)
	if _, err := enrolled.Dial(t, "tcp", netip.AddrPortFrom(gw, 80).String(), testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from the enrolled pod: %v", err)
	}
	a, err := testnet.Accept(t, n.ztunnel.Pod("uid-app").Outbound, 2*time.Second)
	if err != nil {
		t.Fatalf("outbound TCP did not land on ztunnel's 15001: %v", err)
	}
	if a.OrigDst != netip.AddrPortFrom(gw, 80) {
		t.Errorf("original destination %v, want %v", a.OrigDst, netip.AddrPortFrom(gw, 80))
	}

	// CHECK passes, then fails once someone deletes our table.
	if version != "0.3.1" { // CHECK exists from 0.4.0
		if err := n.check(full, rt); err != nil {
			t.Errorf("CHECK of an intact pod: %v", err)
		}
		if out, err := exec.Command("ip", "netns", "exec", enrolled.Name, "nft", "delete", "table", "inet", nft.PodTable).CombinedOutput(); err != nil {
			t.Fatalf("deleting the table: %v %s", err, out)
		}
		err := n.check(full, rt)
		if err == nil || !strings.Contains(err.Error(), "table") {
			t.Errorf("CHECK after the table was deleted = %v, want a drift error", err)
		}
		if _, err := n.execNftcni("ADD", version, prev, rt); err != nil { // re-program for DEL below
			t.Fatal(err)
		}
	}

	// DEL removes our table; DEL again and DEL after the netns is gone succeed.
	if err := n.del(full, rt); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if hasTable(t, enrolled) {
		t.Error("table still there after DEL")
	}
	if len(n.enroller().Members()) != 0 {
		t.Errorf("agent still holds %v after DEL", n.enroller().Members())
	}
	n.ztunnel.Wait(zds.KindDel, "uid-app", 2*time.Second)
	if set := n.probeSet(t); strings.Contains(set, podIP.String()) {
		t.Errorf("host probe set still holds %s after DEL:\n%s", podIP, set)
	}
	if err := n.del(full, rt); err != nil {
		t.Errorf("second DEL: %v", err)
	}
	testnet.IP(t, "netns", "del", enrolled.Name)
	if err := n.del(full, rt); err != nil {
		t.Errorf("DEL after the netns is gone: %v", err)
	}

	// A pod outside the mesh, through the whole chain: no rules, and its
	// traffic goes where it was sent.
	plainPod := testnet.NewNS(t, "nftpod")
	n.pod(plainNS, "web", nil)
	prt := runtimeConf(plainPod, plainNS, "web", nil)
	r, err := n.add(full, prt)
	if err != nil {
		t.Fatalf("ADD of a plain pod: %v\n%s", err, n.log)
	}
	if hasTable(t, plainPod) {
		t.Error("a pod outside the mesh got our table")
	}
	if shape == "ptp" {
		// portmap ran on its nftables backend next to our tables.
		out, err := exec.Command("ip", "netns", "exec", n.node.Name, "nft", "list", "tables").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "cni_hostport") {
			t.Errorf("portmap's nftables table is missing in the node netns: %v\n%s", err, out)
		}
	}
	upstream := n.node.Listen(t, netip.AddrPortFrom(gateway(t, r), 8080).String(), false)
	if _, err := plainPod.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from the plain pod: %v", err)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("plain pod's traffic did not reach the node: %v", err)
	}
	if version == "1.1.0" {
		if err := n.inNode(func() error { return n.cni.GetStatusNetworkList(context.Background(), full) }); err != nil {
			t.Errorf("STATUS with the agent up: %v", err)
		}
	}
	if err := n.del(full, prt); err != nil {
		t.Errorf("DEL of the plain pod: %v", err)
	}
}

// netListenConfig makes a unixpacket listener (to leave a stale socket).
type netListenConfig struct{}

func (netListenConfig) listen(path string) (interface{ Close() error }, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, err
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	return l, nil
}
