package integration

// Live handover from istio-cni: Istio's own agent and plugin enrol pods,
// Istio's agent goes the way its DaemonSet goes in an upgrade, nftcni
// starts on the node and takes every pod over without a restart.

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	cnins "github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/inspect"
	"github.com/nftcni/nftcni/agent/install"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/istiotest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/templates"
)

// istioPods is a node where Istio's agent enrolled pods.
type istioPods struct {
	n       *cniNode
	kube    *kubetest.Server
	node    string
	confDir string
	binDir  string // the node's CNI bin dir, where Istio installed its plugin
	pods    []*testnet.NS
	names   []string
	uids    []string
	ips     []string
	agent   *istiotest.Agent
	z       *ztunneltest.Ztunnel
}

// enrolWithIstio runs Istio's agent on a new node and enrols count pods
// through Istio's plugin, each with a process in its pod cgroup (what a
// /proc scan finds of a running pod) and its IP in its status.
func enrolWithIstio(t testing.TB, kube *kubetest.Server, subnet, count int, nftables bool) *istioPods {
	return enrolWithIstioOwned(t, kube, subnet, count, nftables, false)
}

// enrolWithIstioOwned is enrolWithIstio with istio-cni in its owned-config
// mode (ISTIO_OWNED_CNI_CONFIG: 02-istio-cni.conflist, a copy of the
// primary with its plugin, loaded first) when owned is set.
func enrolWithIstioOwned(t testing.TB, kube *kubetest.Server, subnet, count int, nftables, owned bool) *istioPods {
	ctx := context.Background()
	h := &istioPods{n: newCNINode(t, subnet), kube: kube, node: fmt.Sprintf("handover-%d", subnet)}
	h.n.wide = count > 250
	if _, err := kube.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: h.node}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	h.confDir = filepath.Join(dir, "net.d")
	istioBin := filepath.Join(dir, "bin")
	h.binDir = istioBin
	for _, d := range []string{h.confDir, istioBin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	conf := filepath.Join(h.confDir, "10-bridge.conflist")
	if err := os.WriteFile(conf, h.n.primary("bridge", "1.0.0"), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < count; i++ {
		name := fmt.Sprintf("app-%d-%d", subnet, i)
		p, err := kube.Client.CoreV1().Pods(meshNS).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: meshNS},
			Spec: corev1.PodSpec{NodeName: h.node, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		h.names, h.uids = append(h.names, name), append(h.uids, string(p.UID))
		h.pods = append(h.pods, testnet.NewNS(t, "handover"))
	}
	api := istiotest.Relay(t, h.n.node, strings.TrimPrefix(kube.Config.Host, "https://"))
	h.agent = istiotest.Start(t, istiotest.Options{HostNetns: h.n.node.Path, ConfDir: h.confDir, BinDir: istioBin, APIHost: api,
		Token: kube.Token, NodeName: h.node, Nftables: nftables, OwnedConfig: owned})
	h.z = ztunneltest.Connect(t, h.agent.ZtunnelSocket)
	if owned {
		conf = filepath.Join(h.confDir, "02-istio-cni.conflist")
	}
	withIstio, err := libcni.ConfListFromFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	h.n.cni = libcni.NewCNIConfigWithCacheDir([]string{referencePlugins(t), istioBin}, t.TempDir(), nil)
	time.Sleep(500 * time.Millisecond) // the agent's informer has the pods
	for i, p := range h.pods {
		rt := runtimeConf(p, meshNS, h.names[i], nil)
		rt.Args[3][1] = h.uids[i]
		res, err := h.n.add(withIstio, rt)
		if err != nil {
			t.Fatalf("ADD through Istio: %v\n%s", err, h.agent.Log())
		}
		h.z.Wait(zds.KindAdd, h.uids[i], 10*time.Second)
		// kubelet reports the pod's IP, which a /proc scan checks.
		r, err := current.NewResultFromResult(res)
		if err != nil || len(r.IPs) == 0 {
			t.Fatalf("ADD result %v: %v", res, err)
		}
		ip := r.IPs[0].Address.IP.String()
		h.ips = append(h.ips, ip)
		kp, err := kube.Client.CoreV1().Pods(meshNS).Get(ctx, h.names[i], metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kp.Status.Phase, kp.Status.PodIP, kp.Status.PodIPs = corev1.PodRunning, ip, []corev1.PodIP{{IP: ip}}
		if _, err := kube.Client.CoreV1().Pods(meshNS).UpdateStatus(ctx, kp, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		testnet.PodProcess(t, p, h.uids[i])
	}
	return h
}

// TestHandoverFromIstio is the live migration, for each of Istio's
// backends: Istio's real agent and plugin enrol pods, a connection loop
// runs in every pod, Istio's agent stops as its DaemonSet's removal stops
// it (its in-pod rules stay), and nftcni starts on the same ZDS socket
// path: every pod ends with exactly nftcni's ruleset, no connection of any
// loop escaped capture or failed, ztunnel's snapshot holds every pod,
// probes from the host still reach the pods, and Istio's host state is
// gone.
func TestHandoverFromIstio(t *testing.T) {
	istiotest.Bins(t)
	kube := kubetest.Start(t)
	istioNamespaces(t, kube)
	for i, c := range []handover{
		{nftables: false, keep: true, mode: install.Chained},
		{nftables: true, keep: false, mode: install.Chained},
		// The chart's default mode, with Istio's agent still running when
		// nftcni's starts (a DaemonSet rollout's order): nftcni waits for
		// the ZDS socket, Istio's agent leaves as an upgrade would.
		{nftables: false, keep: true, mode: install.Owned, istioRunning: true},
		{nftables: true, keep: false, mode: install.Owned, istioRunning: true},
		// istio-cni in its own owned-config mode, leaving its file.
		{nftables: true, keep: true, mode: install.Owned, istioOwned: true},
	} {
		t.Run(c.String(), func(t *testing.T) { testHandover(t, kube, 84+i, 20, c) })
	}
}

// handover is one way of moving a node from istio-cni to nftcni.
type handover struct {
	nftables bool         // Istio's backend: native nftables, else iptables
	keep     bool         // Istio's agent leaves its node state (an upgrade's stop)
	mode     install.Mode // nftcni's install mode
	// istioRunning: nftcni's agent starts while Istio's still serves
	// ztunnel; Istio's stops a moment later.
	istioRunning bool
	istioOwned   bool // istio-cni writes 02-istio-cni.conflist
}

func (c handover) String() string {
	s := map[bool]string{false: "iptables", true: "nftables"}[c.nftables] + "/" + string(c.mode)
	if c.keep {
		s += "/istio-keeps"
	}
	if c.istioRunning {
		s += "/istio-running"
	}
	if c.istioOwned {
		s += "/istio-owned"
	}
	return s
}

func testHandover(t *testing.T, kube *kubetest.Server, subnet, count int, c handover) {
	nftables := c.nftables
	h := enrolWithIstioOwned(t, kube, subnet, count, nftables, c.istioOwned)
	gw := h.n.gateway()
	real := h.n.node.Listen(t, gw+":9080", false)
	var escaped atomic.Int64
	go acceptAll(real, &escaped)
	var captured atomic.Int64
	for _, uid := range h.uids {
		go acceptAll(h.z.Pod(uid).Outbound, &captured)
	}
	loops := make([]*dialLoop, len(h.pods))
	for i, p := range h.pods {
		loops[i] = startDialLoop(t, p, gw+":9080", 50*time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	if captured.Load() == 0 || escaped.Load() != 0 {
		t.Fatalf("under Istio: captured %d escaped %d", captured.Load(), escaped.Load())
	}
	before := captured.Load()

	// Istio's agent goes. With its DaemonSet still there and selecting the
	// node (iptables run), it takes that for an upgrade and leaves all its
	// node state for nftcni to take over; without it (nftables run) it
	// removes its conflist entry, binary and host rules. Its in-pod rules
	// stay either way, and ztunnel keeps serving the pods.
	if c.keep {
		keepIstioOnStop(t, kube)
	}
	istioConf := "10-bridge.conflist"
	if c.istioOwned {
		istioConf = "02-istio-cni.conflist"
	}
	stopIstio := func() {
		h.agent.Stop()
		if c.istioRunning {
			return // nftcni, waiting for the socket, takes over at once
		}
		time.Sleep(200 * time.Millisecond)
		left, _ := os.ReadFile(filepath.Join(h.confDir, istioConf))
		if got := strings.Contains(string(left), `"istio-cni"`); got != c.keep {
			t.Errorf("after Istio's agent stopped its conflist entry in %s is there: %v, want %v", istioConf, got, c.keep)
		}
	}
	if !c.istioRunning {
		stopIstio()
	}

	// nftcni starts on the node, serving ztunnel on the same socket path.
	// The first pod also holds someone else's table: it must be left as
	// it is, Istio's rules and all.
	plantForeignTable(t, h.pods[0])
	refusedBefore := nftRuleset(t, h.pods[0])
	if c.istioRunning {
		time.AfterFunc(time.Second, stopIstio) // the rollout's other half
	}
	// The whole agent, installer included, as its DaemonSet runs it.
	run, logs, took := h.runAgent(t, c.mode)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("nftcni's log:\n%s", logs)
		}
	})
	// Nothing of Istio's left in the conf dir; ours where the mode puts it,
	// loaded first.
	ents, _ := os.ReadDir(h.confDir)
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join(h.confDir, e.Name()))
		if strings.Contains(string(b), `"istio-cni"`) {
			t.Errorf("%s still names istio-cni after the handover:\n%s", e.Name(), b)
		}
	}
	ours := "10-bridge.conflist"
	if c.mode == install.Owned {
		ours = install.DefaultOwnedName
	}
	if conf, _ := os.ReadFile(filepath.Join(h.confDir, ours)); !strings.Contains(string(conf), `"nftcni"`) || ents[0].Name() != ours {
		t.Errorf("%s after the handover (first file in the conf dir: %s):\n%s", ours, ents[0].Name(), conf)
	}
	if _, err := os.Stat(filepath.Join(h.binDir, "istio-cni")); !os.IsNotExist(err) {
		t.Errorf("Istio's plugin binary is still installed: %v", err)
	}
	z2 := ztunneltest.Connect(t, h.agent.ZtunnelSocket)
	z2.Wait(zds.KindSnapshotSent, "", 10*time.Second)
	// The refused pod is kept (ZDS KeepWorkload: ztunnel goes on serving it
	// with the netns it has); every other pod comes with its netns.
	kept := false
	for _, e := range z2.Seen() {
		kept = kept || (e.Kind == zds.KindKeep && e.UID == h.uids[0])
	}
	if !kept {
		t.Errorf("ztunnel's snapshot from nftcni does not keep the refused pod %s", h.uids[0])
	}
	for _, uid := range h.uids[1:] {
		if p := z2.Pod(uid); p == nil {
			t.Errorf("ztunnel's snapshot from nftcni lacks pod %s", uid)
		} else {
			go acceptAll(p.Outbound, &captured) // the new listeners share the port
		}
	}
	time.Sleep(500 * time.Millisecond)
	for _, l := range loops {
		l.stop()
	}
	after := captured.Load()
	failed := 0
	for _, l := range loops {
		failed += l.failed()
	}
	t.Logf("handover of %d pods (%s): nftcni installed and serving in %v; captured %d -> %d, escaped %d, failed %d",
		count, c, took.Round(time.Millisecond), before, after, escaped.Load(), failed)
	if escaped.Load() != 0 || failed != 0 || after <= before {
		t.Errorf("connection loops across the handover: escaped %d, failed %d, captured %d -> %d", escaped.Load(), failed, before, after)
	}
	if n := strings.Count(logs.String(), "took a pod over from istio-cni"); n != count-1 {
		t.Errorf("nftcni's log says %d pods were taken over, want %d", n, count-1)
	}
	if !strings.Contains(logs.String(), "not taking a pod over from istio-cni") || !strings.Contains(logs.String(), "pod=mesh/"+h.names[0]) {
		t.Errorf("nftcni's log does not report the refused pod %s", h.names[0])
	}
	if got := nftRuleset(t, h.pods[0]); got != refusedBefore {
		t.Errorf("the refused pod's rules changed:\n%s\nwas:\n%s", got, refusedBefore)
	}
	// inspect reports it by name too (no record: the agent answers).
	in := &inspect.Inspector{RunDir: run, HostNetns: h.n.node.Path, Host: capture.HostSpec{IPv6: true}}
	var refused strings.Builder
	if err := in.Target(&refused, meshNS+"/"+h.names[0]); err != nil || !strings.Contains(refused.String(), "istio-cni's rules left in place") {
		t.Errorf("inspect of the refused pod %s: %v\n%s", h.names[0], err, refused.String())
	}

	// Every pod holds exactly nftcni's ruleset, and inspect says so.
	for i, p := range h.pods[1:] {
		i++
		ruleset := nftRuleset(t, p)
		if strings.Contains(ruleset, "istio") || strings.Contains(ruleset, "ISTIO") || !strings.Contains(ruleset, "table inet nftcni") {
			t.Errorf("pod %s after the handover:\n%s", h.names[i], ruleset)
		}
		var out strings.Builder
		if err := in.Target(&out, meshNS+"/"+h.names[i]); err != nil {
			t.Errorf("inspect %s: %v\n%s", h.names[i], err, out.String())
		}
	}
	// Istio's host probe SNAT is gone; ours probes every pod.
	if host := nftRuleset(t, h.n.node); strings.Contains(host, "istio") || strings.Contains(host, "ISTIO") {
		t.Errorf("Istio's host state left after the handover:\n%s", host)
	}
	nh, err := netlink.NewHandleAt(netns.NsHandle(h.n.node.FD), unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatal(err)
	}
	defer nh.Close()
	// Its ipsets go once the kernel has released the rules that used them.
	for _, set := range nft.IstioProbeSets {
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if _, err := nh.IpsetList(set); err != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("Istio's ipset %s is left on the host", set)
				break
			}
		}
	}
	for i, p := range h.pods[1:] {
		i++
		app := p.Listen(t, "0.0.0.0:8080", false)
		c, err := h.n.node.Dial(t, "tcp", h.ips[i]+":8080", testnet.DialOpts{})
		if err != nil {
			t.Errorf("probe of %s from the host: %v", h.names[i], err)
			continue
		}
		got, err := testnet.Accept(t, app, 2*time.Second)
		c.Close()
		if err != nil || got.Remote.Addr() != capture.ProbeSNATv4 {
			t.Errorf("probe of %s from the host: %+v %v, want it from %s", h.names[i], got, err, istio.ProbeSNATv4)
		}
		app.Close()
	}
}

// agentConfig is nftcni's agent on this node: Istio's ZDS socket path,
// the node's host netns, the test API server, the default policy.
func (h *istioPods) agentConfig(t testing.TB, run string, log *slog.Logger) node.Config {
	t.Helper()
	kc, err := kubesrc.NewClient(h.kube.Config)
	if err != nil {
		t.Fatal(err)
	}
	policy, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return node.Config{RunDir: run, HostNetns: h.n.node.Path, ProcDir: "/proc", ZtunnelSocket: h.agent.ZtunnelSocket,
		IPv6: true, Policy: policy, Kube: kc, NodeName: h.node, Log: log}
}

// runAgent runs nftcni's whole agent on the node (node.Run: enrolment
// side, then the installer in chained mode over the conflist Istio left),
// and returns once the install is valid, with how long that took.
func (h *istioPods) runAgent(t *testing.T, mode install.Mode) (string, *syncBuffer, time.Duration) {
	t.Helper()
	run := t.TempDir()
	logs := &syncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	entry, err := templates.PluginEntry(templates.Values{LogLevel: "info", AgentRunDir: run, ExcludeNamespaces: []string{"kube-system"}, PodNamespace: "kube-system"})
	if err != nil {
		t.Fatal(err)
	}
	in, err := install.New(install.Config{ConfDir: h.confDir, BinDirs: []string{h.binDir}, Mode: mode, Entry: entry,
		PluginBinary: filepath.Join(binDir, "nftcni"), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	state := &install.State{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	started := time.Now()
	go func() {
		done <- node.Run(ctx, node.Agent{Config: h.agentConfig(t, run, log),
			Installer: in, InstallMetrics: install.NewMetrics(nil), State: state, OnExit: node.ExitKeep})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("the agent: %v", err)
		}
	})
	for deadline := time.Now().Add(30 * time.Second); state.Ready() != nil; time.Sleep(2 * time.Millisecond) {
		select {
		case err := <-done:
			t.Fatalf("the agent stopped: %v\n%s", err, logs)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent's install is not valid after 30 s: %v\n%s", state.Ready(), logs)
		}
	}
	return run, logs, time.Since(started)
}

// keepIstioOnStop puts istio-cni's DaemonSet in the API server, selecting
// every node, so that Istio's stopping agent takes its stop for an upgrade
// and leaves its conflist entry, binary and host state in place.
func keepIstioOnStop(t *testing.T, kube *kubetest.Server) {
	t.Helper()
	labels := map[string]string{"k8s-app": "istio-cni-node"}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "istio-cni-node", Namespace: "istio-system"}, Spec: appsv1.DaemonSetSpec{
		Selector: &metav1.LabelSelector{MatchLabels: labels},
		Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "install-cni", Image: "istio/install-cni"}}}},
	}}
	if _, err := kube.Client.AppsV1().DaemonSets("istio-system").Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = kube.Client.AppsV1().DaemonSets("istio-system").Delete(context.Background(), "istio-cni-node", metav1.DeleteOptions{})
	})
}

// istioNamespaces makes the ambient namespace (labelled) and istiod's.
func istioNamespaces(t testing.TB, kube *kubetest.Server) {
	t.Helper()
	for _, ns := range []string{meshNS, "istio-system"} {
		labels := map[string]string{}
		if ns == meshNS {
			labels[istio.LabelDataplaneMode] = istio.DataplaneAmbient
		}
		if _, err := kube.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// startNftcni starts nftcni's agent on the node (Istio's gone), on the same
// ZDS socket path, and returns once it serves, with how long Start took:
// the whole handover happens inside it, before ztunnel is served.
func (h *istioPods) startNftcni(t testing.TB) (*node.Node, string, *syncBuffer, time.Duration) {
	t.Helper()
	return h.startNftcniAdopting(t, 0)
}

// startNftcniAdopting is startNftcni taking over adopt pods at once (0:
// the agent's default).
func (h *istioPods) startNftcniAdopting(t testing.TB, adopt int) (*node.Node, string, *syncBuffer, time.Duration) {
	t.Helper()
	run := t.TempDir()
	logs := &syncBuffer{}
	cfg := h.agentConfig(t, run, slog.New(slog.NewTextHandler(logs, nil)))
	cfg.AdoptConcurrency = adopt
	started := time.Now()
	a, err := node.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("starting nftcni: %v\n%s", err, logs)
	}
	took := time.Since(started)
	t.Cleanup(a.Stop)
	return a, run, logs, took
}

// BenchmarkIstioHandover times nftcni's start on a node where Istio's own
// agent (stopped) enrolled 20 pods with each of its backends, and 500 with
// its nftables backend: from exec of node.Start to serving, every pod
// found through /proc and its rules replaced in one transaction each,
// Istio's host state removed. One round per size (-benchtime 1x). The
// 500-pod handover runs at the agent's default adoption concurrency (32),
// then at the former default, 8.
func BenchmarkIstioHandover(b *testing.B) {
	istiotest.Bins(b)
	kube := kubetest.Start(b)
	istioNamespaces(b, kube)
	subnet := 90
	for _, c := range []struct {
		pods     int
		nftables bool
		adopt    int
	}{{20, false, 0}, {20, true, 0}, {500, true, 0}, {500, true, 8}} {
		name := fmt.Sprintf("%d-%s", c.pods, map[bool]string{false: "iptables", true: "nftables"}[c.nftables])
		if c.adopt > 0 {
			name += fmt.Sprintf("/adopt=%d", c.adopt)
		}
		b.Run(name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				subnet++
				h := enrolWithIstio(b, kube, subnet, c.pods, c.nftables)
				h.agent.Stop()
				b.StartTimer()
				_, _, logs, took := h.startNftcniAdopting(b, c.adopt)
				b.StopTimer()
				if n := strings.Count(logs.String(), "took a pod over from istio-cni"); n != c.pods {
					b.Fatalf("%d of %d pods taken over:\n%s", n, c.pods, logs)
				}
				b.ReportMetric(took.Seconds()*1e3, "handover-ms")
				b.ReportMetric(took.Seconds()*1e3/float64(c.pods), "per-pod-ms")
			}
		})
	}
}

// plantForeignTable adds a table of someone else's, with a rule, to ns.
func plantForeignTable(t *testing.T, ns *testnet.NS) {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(ns.FD))
	if err != nil {
		t.Fatal(err)
	}
	tb := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "someone-else"})
	ch := c.AddChain(&nftables.Chain{Name: "input", Table: tb, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: tb, Chain: ch, Exprs: []expr.Any{&expr.Counter{}}})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}

// nftRuleset is `nft list ruleset` in ns (tests may read rules with nft).
func nftRuleset(t *testing.T, ns *testnet.NS) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", ns.Name, "nft", "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list ruleset: %v\n%s", err, out)
	}
	return nftCounters.ReplaceAllString(string(out), "counter")
}

var nftCounters = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// acceptAll counts the connections l accepts until it closes.
func acceptAll(l net.Listener, n *atomic.Int64) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		n.Add(1)
		c.Close()
	}
}

// dialLoop connects from a pod to addr every interval, counting failures.
type dialLoop struct {
	quit, done chan struct{}
	fails      atomic.Int64
	errs       []string
}

func startDialLoop(t *testing.T, pod *testnet.NS, addr string, every time.Duration) *dialLoop {
	l := &dialLoop{quit: make(chan struct{}), done: make(chan struct{})}
	netns, err := cnins.GetNS(pod.Path)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(l.done)
		defer netns.Close()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-l.quit:
				return
			case <-tick.C:
			}
			var c net.Conn
			derr := netns.Do(func(cnins.NetNS) error {
				var err error
				c, err = net.DialTimeout("tcp", addr, time.Second)
				return err
			})
			if derr != nil {
				if l.fails.Add(1) <= 3 {
					l.errs = append(l.errs, derr.Error())
				}
				continue
			}
			c.Close()
		}
	}()
	t.Cleanup(l.stop)
	return l
}

func (l *dialLoop) stop() {
	select {
	case <-l.quit:
	default:
		close(l.quit)
	}
	<-l.done
}

func (l *dialLoop) failed() int { return int(l.fails.Load()) }
