package integration

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tidwall/sjson"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/integration/istiotest"
	"github.com/nftcni/nftcni/integration/nodetest"
	"github.com/nftcni/nftcni/istio"
)

// nodeVariant is what runs on a node benchmark's node besides the primary:
// nothing ("bare"), the least an ambient CNI does at a burst ("bound": a Go
// plugin asks a node agent, which annotates the pod) or at a reboot
// ("gate": ztunnel-gate holds each mesh pod's ADD until ztunnel is
// connected), nftcni's chart ("nftcni"; its agent in the node's network
// namespace: "nftcni-hostnet"), or Istio's CNI ("istio-cni"). "bound-watch"
// is the bound with the pod and namespace watches of nftcni's agent, to
// tell what those cost the API server.
type nodeVariant struct {
	name  string
	n     *nodetest.Node
	istio *istiotest.Agent
	bound *boundAgent
}

// startVariant sets the node up for variant name.
func startVariant(b *testing.B, n *nodetest.Node, imageValues []string, name string) *nodeVariant {
	b.Helper()
	v := &nodeVariant{name: name, n: n}
	switch name {
	case "nftcni":
		helmInstall(b, n, imageValues, "chained")
	case "nftcni-hostnet":
		helmInstall(b, n, slices.Concat(imageValues, []string{"--set", "ambient.shareHostNetworkNamespace=true"}), "chained")
	case "istio-cni":
		v.istio = startIstioCNI(b, n)
	case "bound", "bound-watch":
		v.bound = startBound(b, n, name == "bound-watch")
	case "gate":
		startGate(b, n)
		n.WaitFor("the ztunnel stand-in connected to ztunnel-gate", 3*time.Minute, func() bool {
			_, err := os.Stat(n.Path(gateFile))
			return err == nil
		})
	}
	return v
}

// enrolled says whether the variant's CNI annotates the pods of an ambient
// namespace as enrolled (the bound does, without capturing them).
func (v *nodeVariant) enrolled() bool {
	return v.nftcni() || v.name == "istio-cni" || v.bound != nil
}

// nftcni says whether nftcni's chart runs.
func (v *nodeVariant) nftcni() bool { return strings.HasPrefix(v.name, "nftcni") }

// rebooted starts again what the node's boot does not: Istio's agent runs
// outside the node's kubelet here (nftcni's is a DaemonSet pod the kubelet
// restarts with the others).
func (v *nodeVariant) rebooted(b *testing.B) {
	b.Helper()
	if v.istio != nil {
		v.istio.Stop() // gone with the node
		v.istio = startIstioCNI(b, v.n)
	}
	if v.name == "gate" {
		v.n.Service("ztunnel-gate", nil, filepath.Join(v.n.BinDir, "ztunnel-gate"), "serve", gateSocket, gateFile)
	}
}

// stop leaves the node bare again.
func (v *nodeVariant) stop(b *testing.B) {
	b.Helper()
	switch {
	case v.nftcni():
		helmUninstall(b, v.n)
	case v.istio != nil:
		stopIstioCNI(b, v.n, v.istio)
	case v.bound != nil:
		v.bound.stop()
	case v.name == "gate":
		v.n.StopService("ztunnel-gate")
		v.n.WritePrimaryConflist()
		_ = os.Remove(v.n.Path(gateSocket))
		_ = os.Remove(v.n.Path(gateFile))
	}
}

// Where ztunnel-gate serves ztunnel (the path the stand-in dials) and the
// file it creates once ztunnel is connected (on the node's /run: gone with
// a reboot).
const (
	gateSocket = "/run/ztunnel/ztunnel.sock"
	gateFile   = "/run/ztunnel-gate/open"
)

// startGate chains ztunnel-gate after the primary, holding the ADDs of the
// reboot benchmark's namespace for up to 30 s (nftcni's default wait for
// its agent), and starts its ZDS end as a service of the node.
func startGate(b *testing.B, n *nodetest.Node) {
	b.Helper()
	if err := installFile(filepath.Join(binDir, "ztunnel-gate"), filepath.Join(n.BinDir, "ztunnel-gate")); err != nil {
		b.Fatal(err)
	}
	entry := fmt.Sprintf(`{"type": "ztunnel-gate", "namespace": "reboot", "gate": %q, "wait_seconds": 30}`, gateFile)
	doc, err := sjson.SetRaw(n.PrimaryConflist(), "plugins.-1", entry)
	if err != nil {
		b.Fatal(err)
	}
	n.WriteConflist(doc)
	n.Service("ztunnel-gate", nil, filepath.Join(n.BinDir, "ztunnel-gate"), "serve", gateSocket, gateFile)
}

// boundAgent is the node agent of the burst's bound: the least an ambient
// CNI must do for each pod. Its plugin is askplugin, chained after the
// primary: one Go exec that asks a local agent with the pod's netns, as
// any such plugin must (the labels that decide enrolment are not in what
// the runtime hands a plugin). The agent answers at once and then PATCHes
// the pod's redirection annotation on its status, as nftcni's agent does
// (istiod reads it), with nftcni's client settings; the ADD does not wait
// for the PATCH. Nothing is captured and ztunnel is told nothing.
type boundAgent struct {
	n         *nodetest.Node
	l         *net.UnixListener
	stopWatch context.CancelFunc
}

// boundSocket is where the bound's agent serves its plugin, on the node's
// /run.
const boundSocket = "/run/nftcni-bound/ask.sock"

func startBound(b *testing.B, n *nodetest.Node, watch bool) *boundAgent {
	b.Helper()
	if err := installFile(filepath.Join(binDir, "askplugin"), filepath.Join(n.BinDir, "askplugin")); err != nil {
		b.Fatal(err)
	}
	if err := os.MkdirAll(n.Path(filepath.Dir(boundSocket)), 0o700); err != nil {
		b.Fatal(err)
	}
	_ = os.Remove(n.Path(boundSocket))
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: n.Path(boundSocket), Net: "unixpacket"})
	if err != nil {
		b.Fatal(err)
	}
	cfg := rest.CopyConfig(n.Config)
	cfg.QPS, cfg.Burst = 80, 160       // nftcni's agent's
	client, err := kube.NewClient(cfg) // the agent's own (protobuf, pods/status)
	if err != nil {
		b.Fatal(err)
	}
	a := &boundAgent{n: n, l: l, stopWatch: func() {}}
	if watch {
		// The agent's own informers (pods on this node, namespaces), with
		// nobody working their queue: the watches' cost alone.
		ctx, cancel := context.WithCancel(context.Background())
		a.stopWatch = cancel
		if err := kube.New(client, nodetest.NodeName, nil, slog.New(slog.DiscardHandler), nil).Start(ctx); err != nil {
			cancel()
			b.Fatal(err)
		}
	}
	go func() {
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			go a.serve(b, c, client)
		}
	}()
	doc, err := sjson.SetRaw(n.PrimaryConflist(), "plugins.-1", fmt.Sprintf(`{"type": "askplugin", "socket": %q}`, boundSocket))
	if err != nil {
		b.Fatal(err)
	}
	n.WriteConflist(doc)
	return a
}

// serve answers one ADD's question, then annotates its pod.
func (a *boundAgent) serve(b *testing.B, c *net.UnixConn, client *kube.Client) {
	defer c.Close()
	q, err := readAsk(c)
	if err != nil {
		return
	}
	if _, err := c.Write([]byte(`{"kind":"decision","decision":{"mode":"ambient"}}`)); err != nil {
		return
	}
	ns, name, ok := strings.Cut(string(bytes.TrimRight(q, "\x00")), "/")
	if !ok {
		return
	}
	patch := []byte(`{"metadata":{"annotations":{"` + istio.AnnRedirection + `":"enabled"}}}`)
	if err := client.PatchPodStatus(context.Background(), ns, name, patch); err != nil {
		b.Logf("bound: annotating %s/%s: %v", ns, name, err)
	}
}

// stop leaves the node bare: the primary's conflist, the socket gone.
func (a *boundAgent) stop() {
	a.stopWatch()
	a.n.WritePrimaryConflist()
	a.l.Close()
	_ = os.RemoveAll(a.n.Path(filepath.Dir(boundSocket)))
}

// benchVariants is defaults, or the variants NFTCNI_BENCH_VARIANTS names
// (a comma-separated list) of defaults and more, to look at some alone or
// at one the benchmark does not run by default.
func benchVariants(b *testing.B, defaults []string, more ...string) []string {
	env := os.Getenv("NFTCNI_BENCH_VARIANTS")
	if env == "" {
		return defaults
	}
	known := slices.Concat(defaults, more)
	var out []string
	for _, v := range strings.Split(env, ",") {
		if !slices.Contains(known, v) {
			b.Fatalf("NFTCNI_BENCH_VARIANTS: no variant %q here (%s)", v, strings.Join(known, ", "))
		}
		out = append(out, v)
	}
	return out
}

// startIstioCNI runs Istio's CNI agent inside the node, as its DaemonSet
// would (the node's netns as its host netns, its plugin in the node's
// conflist, its ZDS socket on the host path ztunnel mounts), and waits for
// the ztunnel stand-in to connect to it.
func startIstioCNI(b *testing.B, n *nodetest.Node) *istiotest.Agent {
	b.Helper()
	a := istiotest.Start(b, istiotest.Options{HostNetns: "/proc/1/ns/net", ConfDir: n.ConfDir, BinDir: n.BinDir,
		APIHost: strings.TrimPrefix(n.Config.Host, "https://"), Token: nodetest.AdminToken, NodeName: nodetest.NodeName,
		Nftables: true, Command: n.Command, Root: n.Path(""), ZtunnelSocket: "/run/ztunnel/ztunnel.sock"})
	n.WaitFor("the ztunnel stand-in connected to Istio's agent", 3*time.Minute, func() bool {
		return strings.Contains(a.Log(), "new ztunnel connected")
	})
	return a
}

// stopIstioCNI stops Istio's agent as its DaemonSet's removal would, and
// leaves the node as the bare node: the primary's conflist and no table of
// Istio's in the node's netns.
func stopIstioCNI(b *testing.B, n *nodetest.Node, a *istiotest.Agent) {
	b.Helper()
	a.Stop()
	if conf, _ := os.ReadFile(filepath.Join(n.ConfDir, nodetest.ConfFile)); strings.Contains(string(conf), "istio-cni") {
		n.WritePrimaryConflist()
	}
	out, err := n.Run("nft", "list", "tables")
	if err != nil {
		b.Fatalf("nft list tables in the node: %v\n%s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && strings.HasPrefix(f[2], "istio") {
			if out, err := n.Run("nft", "delete", "table", f[1], f[2]); err != nil {
				b.Fatalf("nft delete table %s %s: %v\n%s", f[1], f[2], err, out)
			}
		}
	}
}

// readyAgain reports, once, the time from since to the first moment a pod
// of ns matching selector is Ready in a container other than the one
// that ran at since (polled every 250 ms, through the API server's restart),
// or nothing if ctx ends first.
func readyAgain(ctx context.Context, n *nodetest.Node, ns, selector string, since time.Time) <-chan time.Duration {
	old := map[string]bool{}
	if l, err := n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector}); err == nil {
		for _, p := range l.Items {
			for _, c := range p.Status.ContainerStatuses {
				old[c.ContainerID] = true
			}
		}
	}
	out := make(chan time.Duration, 1)
	go func() {
		for ctx.Err() == nil {
			l, err := n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
			for i := 0; err == nil && i < len(l.Items); i++ {
				p := &l.Items[i]
				if podReady(p) && len(p.Status.ContainerStatuses) > 0 && !old[p.Status.ContainerStatuses[0].ContainerID] {
					out <- time.Since(since)
					return
				}
			}
			time.Sleep(250 * time.Millisecond)
		}
	}()
	return out
}
