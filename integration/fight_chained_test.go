package integration

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/nodetest"
)

// TestNodeChainedFightingPrimary: in chained mode, a primary CNI whose
// installer keeps rewriting its conflist without our entry (every 500 ms,
// atomically, as a reconcile loop would) while ambient pods are created.
// A pod whose sandbox is made while our entry is missing runs through a
// chain without nftcni; the agent finds it through the informer and /proc
// and enrols it late. What must hold: every pod ends captured, the agent
// puts its entry back after every rewrite. What the test reports (a
// measurement, not a limit): how long each pod's app ran before its first
// captured connection, how many connections escaped meanwhile, and how
// long the conflist went without our entry after each rewrite.
func TestNodeChainedFightingPrimary(t *testing.T) {
	gen := containerd2(t)
	n := nodetest.Start(t, gen)
	installChained(t, n)
	deployZtunnel(t, n)
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")
	mkNamespace(t, n, "amb", map[string]string{"istio.io/dataplane-mode": "ambient"})
	mkNamespace(t, n, "plain", nil)
	target := runApp(t, n, "plain", "target", false) + ":8081"
	primary := filepath.Join(n.ConfDir, nodetest.ConfFile)
	ask := func(podIP, path string) string { t.Helper(); return askApp(t, n, podIP, path) }
	var report strings.Builder
	// Every 500 ms, every 100 ms, and at once (0: a primary that watches
	// its file and reverts our entry the moment it appears).
	var escaped []string // pods with a connection that went un-captured
	for _, every := range []time.Duration{500 * time.Millisecond, 100 * time.Millisecond, 0} {
		r, e := fight(t, n, primary, every, target, ask)
		t.Log(r)
		report.WriteString(r + "\n")
		escaped = append(escaped, e...)
	}
	// Never in silence: every pod that started outside the chain is
	// warned about by name and counted. A pod with an escaped connection
	// surely started outside it; one enrolled late before its first
	// connection may have too, so the warned pods are a superset.
	// The agent has a pod IP of its own (no hostNetwork); its chart
	// exposes /metrics on monitoringPort there.
	agent, err := n.Client.CoreV1().Pods("kube-system").Get(t.Context(), waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node"), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	warned := warnedOutsideChain(agentPodLog(t, n, agent.Name))
	for _, p := range escaped {
		if !slices.Contains(warned, p) {
			t.Errorf("%s had connections escape, but the agent never warned that it started outside the chain (warned: %v)", p, warned)
		}
	}
	for _, p := range warned {
		if !strings.HasPrefix(p, "amb/f") {
			t.Errorf("the agent warned that %s started outside the chain; it is not one of the fight's pods", p)
		}
	}
	resp, err := n.HTTP().Get("http://" + agent.Status.PodIP + ":15014/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := fmt.Sprintf("nftcni_pods_started_outside_chain_total %d\n", len(warned)); !strings.Contains(string(metrics), want) {
		t.Errorf("the agent's metrics lack %q (the pods it warned about: %v); they have %q", want, warned,
			grepLines(string(metrics), "nftcni_pods_started_outside_chain_total"))
	}
	fmt.Fprintf(&report, "the agent warned about and counted %d pods that started outside the chain (%d had connections escape)\n", len(warned), len(escaped))
	t.Log(strings.TrimSpace(report.String()))
	if p := os.Getenv("NFTCNI_FIGHT_REPORT"); p != "" {
		if err := os.WriteFile(p, []byte(report.String()), 0o644); err != nil {
			t.Error(err)
		}
	}
}

// fight rewrites the primary's conflist every interval (0: as soon as our
// entry is back) while it creates
// ambient pods, then waits for each pod to be captured and says how long
// it ran un-captured and how long the conflist went without our entry.
func fight(t *testing.T, n *nodetest.Node, primary string, every time.Duration, target string, ask func(ip, path string) string) (report string, escapedPods []string) {
	stop := make(chan struct{})
	var gaps []time.Duration // after each rewrite, until our entry was back
	var fought sync.WaitGroup
	fought.Add(1)
	go func() {
		defer fought.Done()
		tick := time.NewTicker(max(every, time.Millisecond))
		defer tick.Stop()
		for {
			tmp := primary + ".fight"
			if err := os.WriteFile(tmp, []byte(n.PrimaryConflist()), 0o644); err != nil {
				t.Error(err)
				return
			}
			if err := os.Rename(tmp, primary); err != nil {
				t.Error(err)
				return
			}
			wrote := time.Now()
			for back := false; !back; {
				select {
				case <-stop:
					return
				case <-tick.C: // not back by the next rewrite
					if every == 0 {
						continue
					}
					gaps = append(gaps, time.Since(wrote))
					back = true
					continue
				case <-time.After(2 * time.Millisecond):
				}
				if b, _ := os.ReadFile(primary); strings.Contains(string(b), `"nftcni"`) {
					gaps = append(gaps, time.Since(wrote))
					back = true
					if every == 0 {
						continue // revert at once
					}
					select {
					case <-tick.C:
					case <-stop:
						return
					}
				}
			}
		}
	}()
	const pods = 6
	prefix := fmt.Sprintf("f%d-", every.Milliseconds())
	for i := range pods {
		createApp(t, n, "amb", prefix+fmt.Sprint(i), false, corev1.EnvVar{Name: "LOOP", Value: target})
		time.Sleep(700 * time.Millisecond)
	}
	ips := map[string]string{}
	for i := range pods {
		name := prefix + fmt.Sprint(i)
		ips[name] = waitApp(t, n, "amb", name, false)
	}
	close(stop)
	fought.Wait()

	var windows []time.Duration
	escaped := 0
	for i := range pods {
		name := prefix + fmt.Sprint(i)
		var st map[string]int
		n.WaitFor("amb/"+name+" captured", 60*time.Second, func() bool {
			st = loopStats(t, ask(ips[name], "/loop"))
			return st["first_captured_ms"] >= 0
		})
		w := time.Duration(st["first_captured_ms"]) * time.Millisecond
		windows = append(windows, w)
		escaped += st["escaped"]
		if st["escaped"]+st["failed"] > 0 {
			escapedPods = append(escapedPods, "amb/"+name)
		}
		t.Logf("amb/%s: first captured connection %v after its app started; %d connections escaped before", name, w, st["escaped"])
	}
	n.WaitFor("our entry back in the primary's conflist", 30*time.Second, func() bool {
		b, _ := os.ReadFile(primary)
		return strings.Contains(string(b), `"nftcni"`)
	})
	slices.Sort(windows)
	slices.Sort(gaps)
	if len(gaps) == 0 {
		t.Fatal("the fight made no rewrite")
	}
	how := "every " + every.String()
	if every == 0 {
		how = "the moment our entry appears"
	}
	return fmt.Sprintf("chained mode, primary rewriting its conflist %s: %d of %d ambient pods ran connections un-captured; "+
		"un-captured from app start: median %v, max %v; %d connections escaped; our entry back after median %v, max %v (%d rewrites)",
		how, len(escapedPods), pods, windows[len(windows)/2], windows[len(windows)-1], escaped,
		gaps[len(gaps)/2].Round(time.Millisecond), gaps[len(gaps)-1].Round(time.Millisecond), len(gaps)), escapedPods
}

// agentPodLog is the agent pod's log as the kubelet serves it.
func agentPodLog(t testing.TB, n *nodetest.Node, pod string) string {
	t.Helper()
	b, err := n.Client.CoreV1().Pods("kube-system").GetLogs(pod, &corev1.PodLogOptions{}).DoRaw(context.Background())
	if err != nil {
		return fmt.Sprintf("(its log: %v)", err)
	}
	return string(b)
}

// warnedOutsideChain is the pods the agent's log names as having started
// without nftcni in their chain.
func warnedOutsideChain(log string) []string {
	var pods []string
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "started without nftcni") {
			continue
		}
		if m := podField.FindStringSubmatch(line); m != nil && !slices.Contains(pods, m[1]) {
			pods = append(pods, m[1])
		}
	}
	return pods
}

// As slog writes it, in text (pod=ns/name) or JSON ("pod":"ns/name").
var podField = regexp.MustCompile(`\bpod"?[=:]"?([^"\s]+)`)
