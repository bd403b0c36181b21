package integration

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/nodetest"
)

// BenchmarkNodeReboot: a node running N pods of an ambient namespace
// reboots (every process of the node killed at once; containerd's state
// and the pods' netns on the node's /run are gone, its disk stays), and
// the kubelet starts every pod again. Timed per pod from the moment the
// node went down to its new container running, on the bare node, with
// ztunnel-gate, the machine's bound for any ambient CNI (a minimal chained
// plugin holds each mesh pod's ADD until ztunnel is connected to a minimal
// ZDS end started with the node's services; it captures nothing), with
// nftcni (its agent a DaemonSet pod the kubelet restarts too;
// NFTCNI_BENCH_VARIANTS=...,nftcni-hostnet adds it in the node's network
// namespace, ambient.shareHostNetworkNamespace) and with Istio's CNI (its
// agent started again as soon as the node's services are up), rotating
// per round. For the enrolled variants every pod must then be captured:
// its outbound connection to an address where nothing listens lands on
// the ztunnel stand-in. Reported per variant: p50, p90 and p99 in ms over
// every pod of every round, the sandboxes the kubelet failed to create
// (and retried) meanwhile, the time to the first pod running, to
// ztunnel's pod and to nftcni's agent pod Ready again (medians over
// rounds; for nftcni also its ADDs the agent told to ask again and its
// agent's CPU time), and the p99 ratios to the bare node's and nftcni's to
// the bound's, with their bootstrap interval over rounds.
func BenchmarkNodeReboot(b *testing.B) {
	const size = 100
	gen := containerd2(b)
	n := nodetest.Start(b, gen)
	imageValues := importImages(b, n)
	deployZtunnel(b, n)
	waitDaemonSetPodReady(b, n, "istio-system", "app=ztunnel")
	mkNamespace(b, n, "reboot", map[string]string{"istio.io/dataplane-mode": "ambient"})
	pods := map[string][]time.Duration{} // variant -> every pod's time to running again
	p99s := map[string][]time.Duration{} // variant -> each round's p99
	failed := map[string]int{}           // variant -> sandboxes the kubelet failed to create
	// variant -> each round's time from down to: ztunnel's pod Ready,
	// nftcni's agent pod Ready, the first pod running
	ztunnelBack, agentBack, firstBack := map[string][]time.Duration{}, map[string][]time.Duration{}, map[string][]time.Duration{}
	retries, agentCPU := map[string]float64{}, map[string]float64{} // nftcni's ADDs asked again, its agent's CPU seconds
	var gateOpen []time.Duration                                    // each round's time from down to ztunnel connected to ztunnel-gate
	variants := benchVariants(b, rebootVariants, "nftcni-hostnet")
	for round := 0; round < b.N; round++ {
		order := roundOrder(variants, round)
		for _, name := range order {
			v := startVariant(b, n, imageValues, name)
			_, ids := createPods(b, n, "reboot", fmt.Sprintf("r%d", round), size, v.enrolled())
			ctx, cancel := context.WithCancel(context.Background())
			down, logAt := time.Now(), kubeletLogSize(n)
			ztunnel := readyAgain(ctx, n, "istio-system", "app=ztunnel", down)
			agent := readyAgain(ctx, n, "kube-system", "k8s-app=nftcni-node", down)
			n.Reboot(nil)
			v.rebooted(b)
			back := restarted(b, n, "reboot", ids, down)
			failed[name] += failedSandboxes(b, n, logAt)
			if name == "gate" {
				opened := gateOpened(b, n).Sub(down)
				if first := slices.Min(back); first < opened {
					b.Fatalf("a pod held by ztunnel-gate ran %v after the node went down, before ztunnel connected (%v)", first, opened)
				}
				gateOpen = append(gateOpen, opened)
			}
			if v.enrolled() {
				requireCaptured(b, n, "reboot")
			}
			pods[name] = append(pods[name], back...)
			p99s[name] = append(p99s[name], quantile(back, 0.99))
			b.Logf("round %d of %d, %s (%d of %d): p99 %.1f s, first pod %.1f s", round+1, b.N, name,
				slices.Index(order, name)+1, len(order), quantile(back, 0.99).Seconds(), slices.Min(back).Seconds())
			firstBack[name] = append(firstBack[name], slices.Min(back))
			ztunnelBack[name] = append(ztunnelBack[name], backWithin(b, ztunnel, "ztunnel's pod"))
			if v.nftcni() {
				agentBack[name] = append(agentBack[name], backWithin(b, agent, "nftcni's agent pod"))
				// The agent started with the node: its counters are the reboot's.
				m := agentMetrics(b, n)
				if r := gauge(m, `istio_cni_plugin_requests_total{result="retry",type="add"}`); !math.IsNaN(r) { // NaN: none
					retries[name] += r
				}
				agentCPU[name] += gauge(m, "process_cpu_seconds_total")
			}
			cancel()
			deletePods(b, n, "reboot")
			v.stop(b)
		}
	}
	for _, v := range variants {
		b.ReportMetric(ms(quantile(pods[v], 0.5)), v+"-ms-p50")
		b.ReportMetric(ms(quantile(pods[v], 0.9)), v+"-ms-p90")
		b.ReportMetric(ms(quantile(pods[v], 0.99)), v+"-ms-p99")
		b.ReportMetric(float64(failed[v]), v+"-failed-sandboxes")
		b.ReportMetric(ms(median(firstBack[v])), v+"-first-pod-ms")
		b.ReportMetric(ms(median(ztunnelBack[v])), v+"-ztunnel-ready-ms")
		if len(agentBack[v]) > 0 {
			b.ReportMetric(ms(median(agentBack[v])), v+"-agent-ready-ms")
			b.ReportMetric(retries[v]/float64(b.N), v+"-add-retries/round")
			b.ReportMetric(agentCPU[v]*1e3/float64(b.N), v+"-agent-cpu-ms/round")
		}
	}
	if len(gateOpen) > 0 {
		b.ReportMetric(ms(median(gateOpen)), "gate-ztunnel-connected-ms")
	}
	for _, v := range variants {
		if v == "bare" {
			continue
		}
		r, lo, hi := addedRatio(p99s, v, "bare", "")
		if math.IsNaN(r) { // no bare variant in this run
			continue
		}
		// The interval as metrics too: Go keeps only a benchmark's first
		// ten log lines, and the rounds' lines come first.
		b.ReportMetric(r, "p99-"+v+"/bare")
		b.ReportMetric(lo, "p99-"+v+"/bare-p5")
		b.ReportMetric(hi, "p99-"+v+"/bare-p95")
		b.Logf("reboot with %d pods, %d rounds: p99 %s/bare %.3fx (90%% of round resamples %.3f–%.3fx)", size, b.N, v, r, lo, hi)
	}
	// Against the bound: what any ambient CNI must wait for.
	if r, lo, hi := addedRatio(p99s, "nftcni", "gate", ""); !math.IsNaN(r) {
		b.ReportMetric(r, "p99-nftcni/gate")
		b.ReportMetric(lo, "p99-nftcni/gate-p5")
		b.ReportMetric(hi, "p99-nftcni/gate-p95")
		b.Logf("reboot with %d pods, %d rounds: p99 nftcni/gate %.3fx (90%% of round resamples %.3f–%.3fx)", size, b.N, r, lo, hi)
	}
}

// gateOpened is when ztunnel-gate saw ztunnel connect after the reboot:
// its gate file's time.
func gateOpened(b *testing.B, n *nodetest.Node) time.Time {
	st, err := os.Stat(n.Path(gateFile))
	if err != nil {
		b.Fatalf("ztunnel-gate's gate after the reboot: %v", err)
	}
	return st.ModTime()
}

// backWithin is what readyAgain reports, failing if it has not within a
// minute of the pods' return.
func backWithin(b *testing.B, c <-chan time.Duration, what string) time.Duration {
	select {
	case d := <-c:
		return d
	case <-time.After(time.Minute):
		b.Fatalf("%s not Ready again a minute after every pod runs", what)
		return 0
	}
}

// rebootVariants run by default; nftcni-hostnet (the agent's pod
// hostNetwork) on request: its agent came back no sooner (docs/benchmarks.md).
var rebootVariants = []string{"bare", "gate", "nftcni", "istio-cni"}

// restarted waits until every pod of ids (name -> its container before the
// reboot) runs a new container, and returns each one's time from down.
func restarted(b *testing.B, n *nodetest.Node, ns string, ids map[string]string, down time.Time) []time.Duration {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	back := map[string]time.Duration{}
	done := watchPods(ctx, n, ns, func(p *corev1.Pod) bool {
		mu.Lock()
		defer mu.Unlock()
		if old, ok := ids[p.Name]; ok && len(p.Status.ContainerStatuses) == 1 {
			if c := p.Status.ContainerStatuses[0]; c.State.Running != nil && c.ContainerID != old {
				if _, seen := back[p.Name]; !seen {
					back[p.Name] = time.Since(down)
				}
			}
		}
		return len(back) == len(ids)
	})
	select {
	case <-done:
	case <-time.After(10 * time.Minute):
		mu.Lock()
		defer mu.Unlock()
		b.Fatalf("10 minutes after the reboot %d of %d pods run again", len(back), len(ids))
	}
	mu.Lock()
	defer mu.Unlock()
	var out []time.Duration
	for _, d := range back {
		out = append(out, d)
	}
	return out
}

// requireCaptured fails unless every pod of ns is captured: nodeapp in it
// dials the bridge's address, where nothing listens, and only the ztunnel
// stand-in's outbound listener can answer.
func requireCaptured(b *testing.B, n *nodetest.Node, ns string) {
	l, err := n.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	var missed []string
	deadline := time.Now().Add(time.Minute) // for all: a pod's app may not listen yet
	for _, p := range l.Items {
		got := dialFrom(n, p.Status.PodIP, "10.88.0.1:9")
		for ; !strings.HasPrefix(got, "ztunnel:15001") && time.Now().Before(deadline); got = dialFrom(n, p.Status.PodIP, "10.88.0.1:9") {
			time.Sleep(200 * time.Millisecond)
		}
		if !strings.HasPrefix(got, "ztunnel:15001") {
			missed = append(missed, fmt.Sprintf("%s (%q)", p.Name, got))
		}
	}
	if len(missed) > 0 {
		b.Fatalf("%d of %d pods not captured after the reboot: %v", len(missed), len(l.Items), missed)
	}
}

// dialFrom is nodeapp's answer at podIP to /dial?addr=addr, or the error.
func dialFrom(n *nodetest.Node, podIP, addr string) string {
	resp, err := n.HTTP().Get("http://" + podIP + ":8080/dial?addr=" + addr)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}
