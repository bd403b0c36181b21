package integration

// The conformance suite against Istio's running agent and plugin: Istio's
// install-cni (ambient, each backend) and its istio-cni plugin enrol a pod
// on one node, nftcni's agent and plugin enrol its twin on another, both
// through the CNI ADD a runtime makes, and the same probe matrix goes
// through both pods (package conformance).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	current "github.com/containernetworking/cni/pkg/types/100"
	cnins "github.com/containernetworking/plugins/pkg/ns"
	"github.com/tidwall/gjson"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/nftcni/nftcni/agent/enablement"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/conformance"
	"github.com/nftcni/nftcni/integration/istiotest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/templates"
)

// liveSide is a node running one mesh CNI, Istio's or nftcni's.
type liveSide struct {
	name     string
	node     *conformance.Node
	nodeName string
	plugin   string // the CNI plugin binary
	entry    []byte // its conflist entry, as its installer wrote it
	z        *ztunneltest.Ztunnel
	log      func() string
}

// istioSide runs Istio's install-cni on a node of its own and takes its
// plugin entry from the conflist it patched.
func istioSide(t *testing.T, kube *kubetest.Server, nodeName string, nftables bool) *liveSide {
	s := &liveSide{name: "istio", node: conformance.NewNode(t, "istio"), nodeName: nodeName}
	dir := t.TempDir()
	confDir, binDir := filepath.Join(dir, "net.d"), filepath.Join(dir, "bin")
	for _, d := range []string{confDir, binDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	conf := filepath.Join(confDir, "10-primary.conflist")
	if err := os.WriteFile(conf, []byte(`{"cniVersion":"1.0.0","name":"primary","plugins":[{"type":"loopback"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	api := istiotest.Relay(t, s.node.NS, strings.TrimPrefix(kube.Config.Host, "https://"))
	a := istiotest.Start(t, istiotest.Options{HostNetns: s.node.NS.Path, ConfDir: confDir, BinDir: binDir, APIHost: api,
		Token: kube.Token, NodeName: nodeName, Nftables: nftables})
	s.log = a.Log
	s.z = ztunneltest.ConnectBare(t, a.ZtunnelSocket)
	b, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	e := gjson.GetBytes(b, `plugins.#(type=="istio-cni")`)
	if !e.Exists() {
		t.Fatalf("install-cni's conflist has no istio-cni entry:\n%s", b)
	}
	s.entry, s.plugin = []byte(e.Raw), filepath.Join(binDir, "istio-cni")
	return s
}

// nftcniSide runs nftcni's agent (its enrolment side, as the binary
// starts it) on a node of its own, pods from the API server.
func nftcniSide(t *testing.T, kube *kubetest.Server, nodeName string) *liveSide {
	s := &liveSide{name: "nftcni", node: conformance.NewNode(t, "nftcni"), nodeName: nodeName}
	run := t.TempDir()
	zsock := filepath.Join(t.TempDir(), "ztunnel.sock")
	logs := &syncBuffer{}
	kc, err := kubesrc.NewClient(kube.Config)
	if err != nil {
		t.Fatal(err)
	}
	policy, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	a, err := node.Start(context.Background(), node.Config{RunDir: run, HostNetns: s.node.NS.Path, ProcDir: "/proc", ZtunnelSocket: zsock,
		IPv6: true, Policy: policy, Kube: kc, NodeName: nodeName, Log: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatalf("starting nftcni's agent: %v\n%s", err, logs)
	}
	t.Cleanup(a.Stop)
	s.log = logs.String
	s.z = ztunneltest.ConnectBare(t, zsock)
	s.z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	if s.entry, err = templates.PluginEntry(templates.Values{LogLevel: "info", AgentRunDir: run, ExcludeNamespaces: []string{"kube-system"}, PodNamespace: "kube-system"}); err != nil {
		t.Fatal(err)
	}
	s.plugin = filepath.Join(binDir, "nftcni")
	return s
}

// cni runs the side's plugin for pod as a runtime runs the last plugin of
// a chain: its entry with the network's name and version, and the
// primary's result (the twin's eth0 and addresses) as prevResult.
func (s *liveSide) cni(t *testing.T, command string, tw *conformance.Twin, pod *corev1.Pod) error {
	t.Helper()
	conf := map[string]any{}
	if err := json.Unmarshal(s.entry, &conf); err != nil {
		t.Fatal(err)
	}
	idx := 0
	prev := &current.Result{CNIVersion: "1.0.0", Interfaces: []*current.Interface{{Name: "eth0", Sandbox: tw.Pod.Path}},
		IPs: []*current.IPConfig{{Interface: &idx, Address: net.IPNet{IP: conformance.PodIP4.AsSlice(), Mask: net.CIDRMask(24, 32)}, Gateway: conformance.NodeIP4.AsSlice()}}}
	if tw.Shape.IPv6 {
		prev.IPs = append(prev.IPs, &current.IPConfig{Interface: &idx, Address: net.IPNet{IP: conformance.PodIP6.AsSlice(), Mask: net.CIDRMask(64, 128)}, Gateway: conformance.NodeIP6.AsSlice()})
	}
	var pb bytes.Buffer
	if err := prev.PrintTo(&pb); err != nil {
		t.Fatal(err)
	}
	conf["name"], conf["cniVersion"], conf["prevResult"] = "primary", "1.0.0", json.RawMessage(pb.Bytes())
	stdin, _ := json.Marshal(conf)
	args := &invoke.Args{Command: command, ContainerID: "ctr-" + pod.Name, NetNS: tw.Pod.Path, IfName: "eth0", Path: filepath.Dir(s.plugin),
		PluginArgs: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", pod.Name},
			{"K8S_POD_UID", string(pod.UID)}, {"K8S_POD_INFRA_CONTAINER_ID", "ctr-" + pod.Name}}}
	var out []byte
	var err error
	nerr := cnins.WithNetNSPath(s.node.NS.Path, func(cnins.NetNS) error {
		out, err = (&invoke.RawExec{Stderr: os.Stderr}).ExecPlugin(context.Background(), s.plugin, stdin, args.AsEnv())
		return nil
	})
	if nerr != nil {
		return nerr
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", s.name, command, err, out)
	}
	return nil
}

// reportIPs puts the pod's addresses in its status, as kubelet does once
// the sandbox is up (Istio's agent releases a pod's probe set entries by
// them).
func reportIPs(t *testing.T, kube *kubetest.Server, pod *corev1.Pod, shape conformance.Shape) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error { // the agent annotates it meanwhile
		p, err := kube.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		p.Status.Phase, p.Status.PodIP = corev1.PodRunning, conformance.PodIP4.String()
		p.Status.PodIPs = []corev1.PodIP{{IP: conformance.PodIP4.String()}}
		if shape.IPv6 {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: conformance.PodIP6.String()})
		}
		_, err = kube.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(context.Background(), p, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// waitDel waits until the side's ztunnel was told to drop uid.
func waitDel(t *testing.T, s *liveSide, uid string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for _, e := range s.z.Seen() {
			if e.Kind == zds.KindDel && e.UID == uid {
				return
			}
		}
	}
	t.Errorf("%s's agent never released pod %s\n%s", s.name, uid, s.log())
}

// liveCase is a pod configuration, as annotations and (for a sidecar pod)
// the proxy container's environment.
type liveCase struct {
	name    string
	shape   conformance.Shape
	ann     map[string]string
	sidecar bool
	env     map[string]string
}

var liveCases = []liveCase{
	{name: "ambient-default", shape: conformance.Shape{IPv6: true}},
	{name: "ambient-bypass-inbound-capture", shape: conformance.Shape{IPv6: true}, ann: map[string]string{istio.AnnBypassInbound: "true"}},
	{name: "ambient-dns-capture-false", shape: conformance.Shape{IPv6: true}, ann: map[string]string{istio.AnnDNSCapture: "false"}},
	{name: "ambient-reroute-virtual-interfaces", shape: conformance.Shape{IPv6: true, Secondary: []string{"eth1"}},
		ann: map[string]string{istio.AnnRerouteInterfaces: "eth1"}},
	{name: "sidecar-dual-stack", shape: conformance.Shape{IPv6: true}, sidecar: true},
	{name: "sidecar-dual-stack-env", shape: conformance.Shape{IPv6: true}, sidecar: true, env: map[string]string{"ISTIO_DUAL_STACK": "true"}},
	{name: "sidecar-tproxy", shape: conformance.Shape{IPv6: true}, sidecar: true, env: map[string]string{"ISTIO_DUAL_STACK": "true"},
		ann: map[string]string{istio.AnnInterceptionMode: istio.ModeTProxy}},
	{name: "sidecar-dns-capture", shape: conformance.Shape{}, sidecar: true, env: map[string]string{istio.EnvDNSCapture: "true"}},
	{name: "sidecar-ports-and-ranges", shape: conformance.Shape{}, sidecar: true, ann: map[string]string{
		istio.AnnIncludeInboundPorts: "8080,4000", istio.AnnExcludeOutboundCIDRs: "9.9.0.0/16",
		istio.AnnIncludeOutboundPorts: "31000", istio.AnnExcludeOutboundPorts: "5555"}},
}

// pod is the case's pod on a side's node, created in the API server.
func (c liveCase) pod(t *testing.T, kube *kubetest.Server, s *liveSide, round string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: c.name + "-" + s.name + "-" + round, Namespace: meshNS, Annotations: map[string]string{}},
		Spec: corev1.PodSpec{NodeName: s.nodeName, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}
	for k, v := range c.ann {
		p.Annotations[k] = v
	}
	if c.sidecar {
		p.Annotations[istio.AnnSidecarStatus] = `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`
		uid := int64(istio.ProxyID)
		proxy := corev1.Container{Name: istio.ProxyContainer, Image: "proxyv2", SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}}
		for k, v := range c.env {
			proxy.Env = append(proxy.Env, corev1.EnvVar{Name: k, Value: v})
		}
		p.Spec.InitContainers = []corev1.Container{{Name: istio.ValidationContainer, Image: "proxyv2"}}
		p.Spec.Containers = append(p.Spec.Containers, proxy)
	}
	created, err := kube.Client.CoreV1().Pods(meshNS).Create(context.Background(), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return created
}

// TestConformanceAgainstIstioAgent compares the rules Istio's own agent
// and plugin make with nftcni's, for ambient pods (defaults and each
// per-pod override) and sidecar pods, both of Istio's backends.
func TestConformanceAgainstIstioAgent(t *testing.T) {
	istiotest.Bins(t)
	kube := kubetest.Start(t)
	istioNamespaces(t, kube)
	nft := nftcniSide(t, kube, "conformance-nftcni")
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend, func(t *testing.T) {
			ist := istioSide(t, kube, "conformance-istio-"+backend, backend == "nftables")
			for _, c := range liveCases {
				t.Run(c.name, func(t *testing.T) {
					pods := map[*liveSide]*corev1.Pod{}
					twins := map[*liveSide]*conformance.Twin{}
					for _, s := range []*liveSide{ist, nft} {
						pods[s] = c.pod(t, kube, s, backend)
						twins[s] = s.node.AddPod(t, s.name, c.shape)
					}
					time.Sleep(300 * time.Millisecond) // both agents' informers have the pods
					for _, s := range []*liveSide{ist, nft} {
						pod, tw := pods[s], twins[s]
						t.Cleanup(func() {
							_ = s.cni(t, "DEL", tw, pod)
							now := int64(0) // no kubelet here to finish a graceful delete
							_ = kube.Client.CoreV1().Pods(meshNS).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &now})
							// Istio's DEL does nothing: its agent releases the pod
							// (probe set entry, then ztunnel) on the API's delete
							// event. The next pod takes the same addresses.
							if !c.sidecar {
								waitDel(t, s, string(pod.UID))
							}
						})
						if err := s.cni(t, "ADD", tw, pod); err != nil {
							t.Fatalf("%v\n%s's agent:\n%s", err, s.name, s.log())
						}
						if !c.sidecar {
							s.z.Wait(zds.KindAdd, string(pod.UID), 10*time.Second)
						}
						reportIPs(t, kube, pod, c.shape)
					}
					cc := conformance.Case{Name: "live-" + backend + "/" + c.name, Shape: c.shape, ProxyUID: istio.ProxyID, ProxyGID: istio.ProxyID}
					if backend == "iptables" && c.sidecar && c.shape.IPv6 && c.env["ISTIO_DUAL_STACK"] == "" {
						// Istio makes IPv4 rules only for this pod (its proxy is not dual-stack).
						cc.Deliberate = func(p conformance.Probe) string {
							if p.Dst.Addr().Is6() {
								return conformance.BackendsDisagreeOnIPv6
							}
							return ""
						}
					}
					r := conformance.Differ(t, cc, twins[ist], twins[nft])
					conformance.Report(t, cc, r)
					// Istio's rules must capture something, or the case proves nothing.
					captured := false
					for _, f := range r.IstioFates {
						captured = captured || strings.Contains(f, "pod:15001") || strings.Contains(f, "pod:15006")
					}
					if !captured {
						t.Errorf("nothing was captured in Istio's pod: its rules are not there\n%s", ist.log())
					}
				})
			}
		})
	}
}
