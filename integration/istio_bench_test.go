package integration

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/istiotest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

// BenchmarkIstioCNIAdd measures Istio's own CNI (install-cni in ambient
// mode and its istio-cni plugin, built from the module proxy by make
// istio-bins) through the same harness as BenchmarkCNIAdd: the same primary
// chain (loopback + bridge + host-local) run by libcni from a node netns,
// alone and with Istio's plugin appended by Istio's installer, for an
// ambient pod (namespace labelled istio.io/dataplane-mode=ambient) and a
// pod outside the mesh, interleaved round by round; pods are real objects
// in a real kube-apiserver (Istio's plugin and agent read them there), and
// a ztunnel stand-in takes the netns over ZDS. One sub-benchmark per Istio
// backend: iptables (iptables-nft here) and native nftables. Reported as
// BenchmarkCNIAdd reports: medians and p90 of the whole ADD, "added" over
// the primary alone, and the exec of istio-cni inside the chain.
func BenchmarkIstioCNIAdd(b *testing.B) {
	istiotest.Bins(b) // skips without them
	kube := kubetest.Start(b)
	ctx := context.Background()
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: meshNS, Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: plainNS}},
		{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}},
	} {
		if _, err := kube.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	for i, backend := range []string{"iptables", "nftables"} {
		b.Run(backend, func(b *testing.B) { benchIstio(b, kube, 72+i, backend == "nftables") })
	}
}

func benchIstio(b *testing.B, kube *kubetest.Server, subnet int, nftables bool) {
	ctx := context.Background()
	n := newCNINode(b, subnet)
	// The benchmark function runs more than once (b.N 1, then the rounds
	// asked for): names are unique per run.
	run := time.Now().UnixNano() % 1e6
	node := fmt.Sprintf("istio-node-%d-%d", subnet, run)
	if _, err := kube.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	confDir, istioBin := filepath.Join(dir, "net.d"), filepath.Join(dir, "bin")
	for _, d := range []string{confDir, istioBin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	conf := filepath.Join(confDir, "10-bridge.conflist")
	if err := os.WriteFile(conf, n.primary("bridge", "1.0.0"), 0o644); err != nil {
		b.Fatal(err)
	}
	primary := n.list("bridge", "1.0.0", false, false)
	// The pods' netns exist before the agent starts: its private mount
	// namespace does not see mounts made after it.
	order := []string{"primary", "ambient", "plain"}
	pods := map[string]*testnet.NS{}
	for _, v := range order {
		pods[v] = testnet.NewNS(b, "istbench")
	}
	api := istiotest.Relay(b, n.node, strings.TrimPrefix(kube.Config.Host, "https://"))
	agent := istiotest.Start(b, istiotest.Options{HostNetns: n.node.Path, ConfDir: confDir, BinDir: istioBin, APIHost: api,
		Token: kube.Token, NodeName: node, Nftables: nftables})
	z := ztunneltest.Connect(b, agent.ZtunnelSocket)
	withIstio, err := libcni.ConfListFromFile(conf)
	if err != nil {
		b.Fatal(err)
	}
	timed := newTimedExec(io.Discard) // istio-cni logs each call to stderr; keep the benchmark lines whole
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{referencePlugins(b), istioBin}, b.TempDir(), timed)
	lists := map[string]*libcni.NetworkConfigList{"primary": primary, "ambient": withIstio, "plain": withIstio}
	// Every round's pods exist in the API server before the round: Istio's
	// plugin and agent look them up there.
	for i := 0; i < b.N; i++ {
		for _, v := range []string{"ambient", "plain"} {
			namespace := plainNS
			if v == "ambient" {
				namespace = meshNS
			}
			p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d-%d", v, run, i), Namespace: namespace},
				Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}
			if _, err := kube.Client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
		}
	}
	time.Sleep(500 * time.Millisecond) // the agent's informer sees the last of them
	samples := map[string][]time.Duration{}
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		for j := range order {
			v := order[(i+j)%len(order)]
			namespace, name := plainNS, fmt.Sprintf("%s-%d-%d", v, run, i)
			if v == "ambient" {
				namespace = meshNS
			}
			rt := runtimeConf(pods[v], namespace, name, nil)
			start := time.Now()
			_, err := n.add(lists[v], rt)
			took := time.Since(start)
			if err != nil {
				b.Fatalf("%s ADD: %v\ninstall-cni log:\n%s", v, err, agent.Log())
			}
			samples[v] = append(samples[v], took)
			if v != "primary" {
				samples[v+"-exec"] = append(samples[v+"-exec"], timed.last("istio-cni"))
			}
			if v == "ambient" && i == 0 {
				z.Wait(zds.KindAdd, "", 5*time.Second) // ztunnel got the first ambient pod: the path is the real one
			}
			if err := n.del(lists[v], rt); err != nil {
				b.Fatalf("%s DEL: %v", v, err)
			}
		}
	}
	q := reportQuantiles(b, []string{"primary", "ambient", "plain", "ambient-exec", "plain-exec"}, samples)
	b.ReportMetric(q("ambient", 0.5)-q("primary", 0.5), "added-ambient-ms-median")
	b.ReportMetric(q("plain", 0.5)-q("primary", 0.5), "added-plain-ms-median")
	b.ReportMetric(q("ambient", 0.5)*1e6, "ns/op")
}
