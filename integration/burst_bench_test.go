package integration

import (
	"cmp"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/nftcni/nftcni/integration/nodetest"
	"github.com/nftcni/nftcni/istio"
)

// BenchmarkNodeBurst: N pods created at once in an ambient namespace on a
// real node (kubelet, containerd 2.x, the scheduler bypassed as the other
// node tests do), timed from each pod's creation to its container running
// — what the kubelet's pod start-up SLI measures, image pulls excluded —
// on the bare node (the primary alone), with the bound (the least an
// ambient CNI does for a pod: a Go plugin asking a node agent, which
// PATCHes the pod's redirection annotation as nftcni's agent does; see
// boundAgent), and with nftcni (the chart, the ztunnel stand-in enrolling
// every pod), each round in a balanced order (-benchtime Nx: N rounds of
// each). Reported per variant: p50, p90 and
// p99 in ms over every pod of every round, the kubelet's own
// kubelet_pod_start_sli_duration_seconds (its histogram's quantiles,
// bucket bounds), the sandboxes the kubelet failed to create (a CNI ADD
// failed or timed out, retried with back-off), and nftcni's p99 over the
// bare node's, the median over rounds with its bootstrap interval. Where nftcni's share goes, per
// enrolled pod: the agent's CPU time over the burst (its
// process_cpu_seconds_total), the agent's time on each ADD (its log's
// ready_ms, what the ADD waits for; done_ms, to the annotation), the plugin's own clock
// to its decision and to its rules programmed, and each ZDS Add's wait
// for its connection and for ztunnel's ack. Istio's CNI is the fourth
// variant: its install-cni (ambient, nftables backend) run inside the node
// as its chart runs it, patching the node's conflist, its istio-cni plugin
// run by containerd, and the same ztunnel stand-in. Every pod of the
// nftcni and Istio variants must end annotated as enrolled.
func BenchmarkNodeBurst(b *testing.B) {
	gen := containerd2(b)
	n := nodetest.Start(b, gen)
	imageValues := importImages(b, n)
	deployZtunnel(b, n)
	waitDaemonSetPodReady(b, n, "istio-system", "app=ztunnel")
	mkNamespace(b, n, "burst", map[string]string{"istio.io/dataplane-mode": "ambient"})
	kubelet := kubeletMetrics(n)
	variants := benchVariants(b, burstVariants, "bound-watch")
	for _, size := range []int{50, 100} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			pods := map[string][]time.Duration{}          // variant -> every pod's start
			p99s := map[string][]time.Duration{}          // variant -> each round's p99
			sli := map[string]map[float64]float64{}       // variant -> histogram bucket deltas
			failed := map[string]int{}                    // variant -> sandboxes the kubelet failed to create
			services := map[string]map[string][]float64{} // variant -> service -> each round's CPU ms a pod
			teardowns := map[string][]time.Duration{}     // variant -> each round's stopping after the pods left the API
			var share burstShare
			for round := 0; round < b.N; round++ {
				order := roundOrder(variants, round)
				for _, name := range order {
					v := startVariant(b, n, imageValues, name)
					before, logAt := kubelet(b), kubeletLogSize(n)
					var m0 string
					if name == "nftcni" {
						m0 = agentMetrics(b, n)
					}
					cpu0 := serviceCPU(b)
					prefix := fmt.Sprintf("r%d", round)
					starts, teardown := burst(b, n, "burst", prefix, size, v.enrolled())
					teardowns[name] = append(teardowns[name], teardown)
					addCPU(services, name, serviceCPU(b), cpu0, size)
					sli[name] = addBuckets(sli[name], subBuckets(kubelet(b), before))
					failed[name] += failedSandboxes(b, n, logAt)
					pods[name] = append(pods[name], starts...)
					p99s[name] = append(p99s[name], quantile(starts, 0.99))
					b.Logf("round %d of %d, %s (%d of %d): p99 %.1f s, the node's teardown after %.1f s", round+1, b.N, name,
						slices.Index(order, name)+1, len(order), quantile(starts, 0.99).Seconds(), teardown.Seconds())
					if name == "nftcni" {
						share.metrics(m0, agentMetrics(b, n))
						share.pods += size
						share.add(agentPodLog(b, n, waitDaemonSetPodReady(b, n, "kube-system", "k8s-app=nftcni-node")), "burst/"+prefix+"-")
					}
					v.stop(b)
				}
			}
			for _, v := range variants {
				b.ReportMetric(ms(quantile(pods[v], 0.5)), v+"-ms-p50")
				b.ReportMetric(ms(quantile(pods[v], 0.9)), v+"-ms-p90")
				b.ReportMetric(ms(quantile(pods[v], 0.99)), v+"-ms-p99")
				b.ReportMetric(bucketQuantile(sli[v], 0.5)*1e3, v+"-sli-ms-p50")
				b.ReportMetric(bucketQuantile(sli[v], 0.99)*1e3, v+"-sli-ms-p99")
				b.ReportMetric(float64(failed[v]), v+"-failed-sandboxes")
				td := median(teardowns[v])
				b.ReportMetric(ms(td), v+"-teardown-ms")
				cpu := fmt.Sprintf("%d pods at once, %s: stopped %.1f s after they left the API; CPU a pod, its start and deletion (median over rounds):",
					size, v, td.Seconds())
				for _, svc := range nodeServices {
					ms := median(services[v][svc])
					b.ReportMetric(ms, v+"-"+svc+"-cpu-ms/pod")
					cpu += fmt.Sprintf(" %s %.1f ms", svc, ms)
				}
				b.Log(cpu)
			}
			share.report(b)
			at := fmt.Sprintf("%d pods at once, %d rounds", size, b.N)
			reportRatio(b, p99s, "nftcni", "bare", "", "p99-nftcni/bare", at+": p99 nftcni/bare")
			reportRatio(b, p99s, "istio-cni", "bare", "", "p99-istio/bare", at+": p99 istio-cni/bare")
			reportRatio(b, p99s, "nftcni", "istio-cni", "bare", "p99-added-nftcni/istio", at+": what nftcni adds to the bare node's p99 over what Istio's CNI adds")
			// The bound: what any ambient CNI adds here, and nftcni against it.
			reportRatio(b, p99s, "bound", "bare", "", "p99-bound/bare", at+": p99 bound/bare, the least an ambient CNI adds here")
			reportRatio(b, p99s, "nftcni", "bound", "", "p99-nftcni/bound", at+": p99 nftcni/bound")
			reportRatio(b, p99s, "bound", "istio-cni", "bare", "p99-added-bound/istio", at+": what the bound adds to the bare node's p99 over what Istio's CNI adds")
		})
	}
}

// reportRatio reports addedRatio(p99s, v, ref, base) as metric, with its
// bootstrap interval as metric-p5 and metric-p95, and logs it after what.
func reportRatio(b *testing.B, p99s map[string][]time.Duration, v, ref, base, metric, what string) {
	b.Helper()
	r, lo, hi := addedRatio(p99s, v, ref, base)
	b.ReportMetric(r, metric)
	b.ReportMetric(lo, metric+"-p5")
	b.ReportMetric(hi, metric+"-p95")
	b.Logf("%s: %.3f (90%% of round resamples %.3f–%.3f)", what, r, lo, hi)
}

// burstShare is where nftcni's time in a burst goes.
type burstShare struct {
	cpu  float64 // the agent's CPU seconds over the bursts
	pods int
	// per enrolled pod, ms: the agent's part the ADD waits for, and to
	// the annotation; the plugin's clock to its decision and its rules
	ready, done, decided, programmed []float64
	failed, unacked                  int // ADDs the agent failed; of them, for want of ztunnel's ack
	firstFailure                     string
	queue, ack                       map[float64]float64 // ZDS Adds' wait for their turn, and for ztunnel's ack
}

// metrics adds what the agent's metrics moved by over a burst.
func (s *burstShare) metrics(before, after string) {
	s.cpu += gauge(after, "process_cpu_seconds_total") - gauge(before, "process_cpu_seconds_total")
	for _, h := range []struct {
		sum  *map[float64]float64
		name string
	}{{&s.queue, "nftcni_ztunnel_add_queue_seconds"}, {&s.ack, "nftcni_ztunnel_add_ack_seconds"}} {
		*h.sum = addBuckets(*h.sum, subBuckets(histogram(after, h.name), histogram(before, h.name)))
	}
}

var enrolledTimes = regexp.MustCompile(`ready_ms"?[=:]([0-9.]+).*done_ms"?[=:]([0-9.]+).*plugin_decided_ms"?[=:]([0-9.]+).*plugin_programmed_ms"?[=:]([0-9.]+)`)

// add reads the agent's "pod enrolled" lines of the burst's pods.
func (s *burstShare) add(log, podPrefix string) {
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, podPrefix) {
			continue
		}
		if strings.Contains(line, "pod ADD failed") {
			s.failed++
			if strings.Contains(line, "did not ack") {
				s.unacked++
			}
			if s.firstFailure == "" {
				s.firstFailure = line
			}
			continue
		}
		if !strings.Contains(line, "pod enrolled") {
			continue
		}
		if m := enrolledTimes.FindStringSubmatch(line); m != nil {
			f := make([]float64, 4)
			for i := range f {
				f[i], _ = strconv.ParseFloat(m[i+1], 64)
			}
			s.ready, s.done = append(s.ready, f[0]), append(s.done, f[1])
			s.decided, s.programmed = append(s.decided, f[2]), append(s.programmed, f[3])
		}
	}
}

func (s *burstShare) report(b *testing.B) {
	if s.pods == 0 {
		return
	}
	b.ReportMetric(s.cpu*1e3/float64(s.pods), "agent-cpu-ms/pod")
	q := func(v []float64, p float64) float64 {
		if len(v) == 0 {
			return math.NaN()
		}
		return quantile(v, p)
	}
	b.ReportMetric(q(s.ready, 0.5), "agent-ready-ms-p50")
	b.ReportMetric(q(s.ready, 0.99), "agent-ready-ms-p99")
	b.ReportMetric(q(s.done, 0.5), "agent-done-ms-p50")
	b.ReportMetric(q(s.decided, 0.5), "plugin-decided-ms-p50")
	b.ReportMetric(q(s.programmed, 0.5), "plugin-programmed-ms-p50")
	b.ReportMetric(q(s.programmed, 0.99), "plugin-programmed-ms-p99")
	b.ReportMetric(bucketQuantile(s.queue, 0.5)*1e3, "zds-queue-ms-p50")
	b.ReportMetric(bucketQuantile(s.queue, 0.99)*1e3, "zds-queue-ms-p99")
	b.ReportMetric(bucketQuantile(s.ack, 0.5)*1e3, "zds-ack-ms-p50")
	b.ReportMetric(bucketQuantile(s.ack, 0.99)*1e3, "zds-ack-ms-p99")
	b.Logf("ZDS AddWorkload: waiting for the connection (queued behind other pods' Adds) p50 <= %.0f ms, p99 <= %.0f ms; ztunnel's ack p50 <= %.0f ms, p99 <= %.0f ms (bucket bounds)",
		bucketQuantile(s.queue, 0.5)*1e3, bucketQuantile(s.queue, 0.99)*1e3, bucketQuantile(s.ack, 0.5)*1e3, bucketQuantile(s.ack, 0.99)*1e3)
	b.ReportMetric(float64(s.failed), "failed-adds")
	b.ReportMetric(float64(s.unacked), "unacked-adds")
	if s.failed > 0 {
		b.Logf("%d ADDs failed (and were retried by the kubelet), %d for want of ztunnel's ack; the first: %s", s.failed, s.unacked, s.firstFailure)
	}
	b.Logf("nftcni's share: agent CPU %.2f ms a pod; the ADD's wait on the agent p50 %.1f ms, p99 %.1f ms (to the annotation p50 %.1f ms); plugin decided p50 %.2f ms, programmed p50 %.2f ms, p99 %.2f ms (%d of %d pods' ADDs logged)",
		s.cpu*1e3/float64(s.pods), q(s.ready, 0.5), q(s.ready, 0.99), q(s.done, 0.5), q(s.decided, 0.5), q(s.programmed, 0.5), q(s.programmed, 0.99), len(s.ready), s.pods)
}

// nodeServices are the node's processes whose CPU a burst reports (the
// pods' start and their deletion): the API server (every pod's writes and
// watch events; on this machine it shares the node's two cores), the
// kubelet, and containerd with the CNI plugins it ran and reaped (runc
// runs under the shims, which are not counted).
var nodeServices = []string{"kube-apiserver", "kubelet", "containerd"}

// serviceCPU is each node service's CPU seconds so far: its own, and, for
// containerd, its reaped children's. One node runs on the machine at a
// time, so a service is every host process of that name. From
// /proc/PID/stat, not cpuTime's schedstat: only stat keeps the time of
// threads that ended and of children reaped.
func serviceCPU(b *testing.B) map[string]float64 {
	b.Helper()
	out := map[string]float64{}
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		b.Fatal(err)
	}
	for _, d := range dirs {
		stat, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue // not a process, or gone
		}
		// pid (comm) state ppid ...: comm may hold spaces; fields follow
		// the last ')'.
		open, end := strings.IndexByte(string(stat), '('), strings.LastIndexByte(string(stat), ')')
		if open < 0 || end < open {
			continue
		}
		comm := string(stat[open+1 : end])
		if !slices.Contains(nodeServices, comm) {
			continue
		}
		f := strings.Fields(string(stat[end+1:])) // f[0] is field 3 (state)
		ticks := func(field int) float64 { v, _ := strconv.ParseFloat(f[field-3], 64); return v }
		t := ticks(14) + ticks(15) // utime, stime
		if comm == "containerd" {
			t += ticks(16) + ticks(17) // cutime, cstime: the CNI plugins it reaped
		}
		out[comm] += t / 100 // USER_HZ
	}
	return out
}

// addCPU adds one burst's CPU ms a pod, per service, to a variant's rounds.
func addCPU(to map[string]map[string][]float64, variant string, after, before map[string]float64, pods int) {
	if to[variant] == nil {
		to[variant] = map[string][]float64{}
	}
	for _, svc := range nodeServices {
		to[variant][svc] = append(to[variant][svc], (after[svc]-before[svc])*1e3/float64(pods))
	}
}

// agentMetrics is the agent's /metrics text, on its metrics port.
func agentMetrics(b *testing.B, n *nodetest.Node) string {
	b.Helper()
	agent, err := n.Client.CoreV1().Pods("kube-system").Get(context.Background(), waitDaemonSetPodReady(b, n, "kube-system", "k8s-app=nftcni-node"), metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	resp, err := n.HTTP().Get("http://" + agent.Status.PodIP + ":15014/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	text, err := io.ReadAll(resp.Body)
	if err != nil {
		b.Fatal(err)
	}
	return string(text)
}

// kubeletLogSize is where the node's kubelet log ends now.
func kubeletLogSize(n *nodetest.Node) int64 {
	fi, err := os.Stat(filepath.Join(n.Dir, "logs", "kubelet.log"))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// failedSandboxes counts the sandboxes the kubelet failed to create (a CNI
// ADD that failed or timed out, retried with back-off) in its log since
// offset.
func failedSandboxes(b *testing.B, n *nodetest.Node, offset int64) int {
	f, err := os.Open(filepath.Join(n.Dir, "logs", "kubelet.log"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		b.Fatal(err)
	}
	text, err := io.ReadAll(f)
	if err != nil {
		b.Fatal(err)
	}
	return strings.Count(string(text), `"CreatePodSandbox for pod failed"`)
}

// gauge is the value of an unlabelled metric in a /metrics text.
func gauge(text, name string) float64 {
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			if f, err := strconv.ParseFloat(v, 64); err == nil {
				return f
			}
		}
	}
	return math.NaN()
}

// histogram is an unlabelled histogram's cumulative bucket counts by upper
// bound, in a /metrics text.
func histogram(text, name string) map[float64]float64 {
	buckets := map[float64]float64{}
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, name+"_bucket{") {
			continue
		}
		_, rest, _ := strings.Cut(line, `le="`)
		le, count, _ := strings.Cut(rest, `"} `)
		bound, err1 := strconv.ParseFloat(le, 64)
		if le == "+Inf" {
			bound, err1 = math.Inf(1), nil
		}
		v, err2 := strconv.ParseFloat(count, 64)
		if err1 == nil && err2 == nil {
			buckets[bound] = v
		}
	}
	return buckets
}

// burstVariants are the bare node, the bound (boundAgent: the least an
// ambient CNI does for a pod, annotation included), nftcni and Istio's
// CNI.
var burstVariants = []string{"bare", "bound", "nftcni", "istio-cni"}

// roundOrder is the order the variants run in round r: a Williams design
// (a balanced Latin square). Over n rounds (2n when n is odd) each
// variant runs once in each position and follows each other variant
// equally often, so neither a position nor a predecessor's leftovers
// favour one. A rotation kept neighbours: with it the bare node always
// followed Istio's CNI.
func roundOrder(variants []string, r int) []string {
	n := len(variants)
	out := make([]string, n)
	lo, hi := 1, n-1
	for i := range out {
		b := 0 // the first row: 0, 1, n-1, 2, n-2, …
		switch {
		case i == 0:
		case i%2 == 1:
			b, lo = lo, lo+1
		default:
			b, hi = hi, hi-1
		}
		out[i] = variants[(b+r)%n]
	}
	if n%2 == 1 && (r/n)%2 == 1 {
		slices.Reverse(out) // odd n: the mirrored square balances predecessors
	}
	return out
}

// burst creates size pods at once and returns, for each, the time from
// its creation to its container running; then it deletes them, waits
// until the node has stopped them, and returns how long that took after
// the API server forgot them.
func burst(b *testing.B, n *nodetest.Node, ns, prefix string, size int, enrolled bool) ([]time.Duration, time.Duration) {
	starts, _ := createPods(b, n, ns, prefix, size, enrolled)
	teardown := deletePods(b, n, ns)
	return starts, teardown
}

// createPods creates size pods at once and returns, for each, the time
// from its creation to its container running, and their container IDs by
// name. enrolled: wait as well until each is annotated as enrolled.
func createPods(b *testing.B, n *nodetest.Node, ns, prefix string, size int, enrolled bool) ([]time.Duration, map[string]string) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	created := map[string]time.Time{}
	running := map[string]time.Time{}
	ids := map[string]string{}
	annotated := map[string]bool{}
	// seen notes a pod's container running, and says whether all are
	// (and, for enrolled bursts, annotated).
	seen := func(p *corev1.Pod) bool {
		mu.Lock()
		defer mu.Unlock()
		if p.Annotations[istio.AnnRedirection] == "enabled" {
			annotated[p.Name] = true
		}
		if _, ok := running[p.Name]; !ok && len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Running != nil {
			running[p.Name] = time.Now()
			ids[p.Name] = p.Status.ContainerStatuses[0].ContainerID
		}
		return len(running) == size && (!enrolled || len(annotated) == size)
	}
	done := watchPods(ctx, n, ns, seen)
	var wg sync.WaitGroup
	for i := range size {
		name := fmt.Sprintf("%s-%d", prefix, i)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: corev1.PodSpec{
			NodeName:                      nodetest.NodeName,
			TerminationGracePeriodSeconds: ptr(int64(1)),
			Containers:                    []corev1.Container{{Name: "app", Image: appImage, ImagePullPolicy: corev1.PullNever}},
		}}
		wg.Add(1)
		go func() { // as a ReplicaSet controller creates them: concurrently
			defer wg.Done()
			mu.Lock()
			created[name] = time.Now()
			mu.Unlock()
			if _, err := n.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		mu.Lock()
		defer mu.Unlock()
		b.Fatalf("after 5 minutes: %d of %d pods running, %d annotated", len(running), size, len(annotated))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(running) != size || (enrolled && len(annotated) != size) {
		b.Fatalf("the watch ended with %d of %d pods seen running, %d annotated", len(running), size, len(annotated))
	}
	var starts []time.Duration
	for name, at := range running {
		starts = append(starts, at.Sub(created[name]))
	}
	return starts, ids
}

// watchPods calls seen with every version of every pod of ns it sees,
// until seen says all is seen (the returned channel is then closed) or
// ctx ends. The API server ends a watch when it likes: list, then watch
// from the list's version, again.
func watchPods(ctx context.Context, n *nodetest.Node, ns string, seen func(*corev1.Pod) bool) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		w := watch.Interface(watch.NewEmptyWatch())
		for {
			for ev := range w.ResultChan() {
				if p, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Deleted && seen(p) {
					w.Stop()
					close(done)
					return
				}
			}
			if ctx.Err() != nil {
				return
			}
			list, err := n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				time.Sleep(100 * time.Millisecond) // the API server restarting
				continue
			}
			all := false
			for i := range list.Items {
				all = seen(&list.Items[i])
			}
			if all {
				close(done)
				return
			}
			if w, err = n.Client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion}); err != nil {
				w = watch.NewEmptyWatch()
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()
	return done
}

// deletePods deletes every pod of ns, waits until the API server has
// forgotten them and the node has stopped them, and removes their
// sandboxes (nodetest.RemovePodSandboxes). It returns the time the node
// took to stop them once the API server had forgotten them. Force-deleted
// pods leave the API at once: without the wait, the next variant's burst
// would share the node with this one's teardown, and a variant whose
// start takes seconds (a chart to install) would leave it less of it.
func deletePods(b *testing.B, n *nodetest.Node, ns string) time.Duration {
	ctx := context.Background()
	if err := n.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}, metav1.ListOptions{}); err != nil {
		b.Fatal(err)
	}
	n.WaitFor("the pods of "+ns+" gone", 5*time.Minute, func() bool {
		l, err := n.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0
	})
	took, err := n.RemovePodSandboxes(ns, 5*time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	return took
}

// helmUninstall removes the chart and waits for the agent's pod to go.
func helmUninstall(t testing.TB, n *nodetest.Node) {
	t.Helper()
	if out, err := n.Helm("uninstall", "nftcni", "--namespace", "kube-system", "--wait", "--timeout", "120s"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	n.WaitFor("the agent's pod gone", 120*time.Second, func() bool {
		l, err := n.Client.CoreV1().Pods("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "k8s-app=nftcni-node"})
		return err == nil && len(l.Items) == 0
	})
}

// kubeletMetrics reads the kubelet's pod start-up SLI histogram: its
// cumulative bucket counts by upper bound (seconds).
func kubeletMetrics(n *nodetest.Node) func(testing.TB) map[float64]float64 {
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DialContext: n.DialContext,
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // the test node's kubelet: a self-signed cert
	return func(t testing.TB) map[float64]float64 {
		t.Helper()
		resp, err := c.Get("https://" + nodetest.NodeIP + ":10250/metrics")
		if err != nil {
			t.Fatalf("the kubelet's metrics: %v", err)
		}
		defer resp.Body.Close()
		text, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("the kubelet's metrics: %v", err)
		}
		return histogram(string(text), "kubelet_pod_start_sli_duration_seconds")
	}
}

func subBuckets(after, before map[float64]float64) map[float64]float64 {
	d := map[float64]float64{}
	for le, v := range after {
		d[le] = v - before[le]
	}
	return d
}

func addBuckets(sum, d map[float64]float64) map[float64]float64 {
	if sum == nil {
		sum = map[float64]float64{}
	}
	for le, v := range d {
		sum[le] += v
	}
	return sum
}

// bucketQuantile is the upper bound of the bucket that holds quantile q
// of a cumulative histogram (the resolution the kubelet gives).
func bucketQuantile(buckets map[float64]float64, q float64) float64 {
	bounds := make([]float64, 0, len(buckets))
	for le := range buckets {
		bounds = append(bounds, le)
	}
	slices.Sort(bounds)
	if len(bounds) == 0 || buckets[bounds[len(bounds)-1]] == 0 {
		return math.NaN()
	}
	total := buckets[bounds[len(bounds)-1]]
	for _, le := range bounds {
		if buckets[le] >= q*total {
			return le
		}
	}
	return math.Inf(1)
}

// quantile is the sample at quantile q of d (nearest rank below).
func quantile[T cmp.Ordered](d []T, q float64) T {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[int(q*float64(len(s)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }
