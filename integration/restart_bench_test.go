package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

// rssKB reads a process's resident set size.
func rssKB(b *testing.B, pid int) int {
	b.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.Atoi(f[1])
			return kb
		}
	}
	b.Fatal("no VmRSS")
	return 0
}

// BenchmarkAgentRestart500 enrols 500 pods through libcni and the agent
// process (static pod source, a test ztunnel), kills the agent, and times
// the new one from exec: to ready (/readyz 200: install valid, all 500
// restored, ztunnel's socket serving a snapshot of all 500), and to
// ztunnel having acked that snapshot. The second is mostly ztunnel's own
// work: the stand-in, like ztunnel, opens its three listeners in each
// pod's netns before it acks, and ZDS acks one message at a time.
// Rulesets are verified after ready (the verifier's first pass).
// Reported: enrolment throughput, medians of both restart times, and the
// agent's RSS with 500 pods before and after the restart.
func BenchmarkAgentRestart500(b *testing.B) {
	const pods = 500
	testnet.RequireRoot(b)
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"bench500","plugins":[{"type":"loopback"},{"type":"bridge","bridge":"nftbr500","isGateway":true,
	 "ipam":{"type":"host-local","ranges":[[{"subnet":"10.89.0.0/22"}]],"dataDir":%q}}]}`, filepath.Join(b.TempDir(), "ipam"))
	n := newAgentNode(b, 69, []byte(conf)) // a /22: 500 pods on one bridge
	h := n.h
	var manifest strings.Builder
	manifest.WriteString("apiVersion: v1\nkind: Namespace\nmetadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}\n")
	for i := range pods {
		fmt.Fprintf(&manifest, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p%d, namespace: mesh, uid: uid-p%d}\n", i, i)
	}
	src := podSourceDir(b, manifest.String())
	cmd, z := n.start(b, "--pod-source", src)
	list := n.installed(b)
	nss := make([]*testnet.NS, pods)
	for i := range nss {
		nss[i] = testnet.NewNS(b, "nftb500")
	}
	start := time.Now()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8) // a kubelet starts a handful of sandboxes at once
	errs := make([]error, pods)
	for i := range pods {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			_, errs[i] = n.add(list, runtimeConf(nss[i], "mesh", "p"+strconv.Itoa(i), nil))
		}()
	}
	wg.Wait()
	enrolTook := time.Since(start)
	for i, err := range errs {
		if err != nil {
			b.Fatalf("ADD %d: %v", i, err)
		}
	}
	rssBefore := rssKB(b, cmd.Process.Pid)

	b.ResetTimer()
	var ready, acked []time.Duration
	var rssAfter int
	for i := 0; i < b.N; i++ {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		z.Close()
		t0 := time.Now()
		var addr string
		cmd, addr, _ = startAgent(b, h, "--pod-source", src)
		readyAt := make(chan time.Time, 1)
		go func() { waitReadyEvery(b, addr, time.Millisecond); readyAt <- time.Now() }()
		z = ztunneltest.Connect(b, h.zsock)
		z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
		acked = append(acked, time.Since(t0))
		ready = append(ready, (<-readyAt).Sub(t0))
		if got := len(z.UIDs()); got != pods {
			b.Fatalf("snapshot after restart held %d pods, want %d", got, pods)
		}
		rssAfter = rssKB(b, cmd.Process.Pid)
	}
	b.StopTimer()

	// Continuous verification: an agent verifying every second. The first
	// pass lists every ruleset (pods restored: pending); later passes find
	// each netns's ruleset generation unchanged (one netlink request per
	// pod). Reported: the first pass's wall time (the agent's gauge) and
	// the CPU per later pass.
	_ = cmd.Process.Kill()
	_, _ = cmd.Process.Wait()
	z.Close()
	port := testnet.FreePort(b)
	cmd, addr, _ := startAgent(b, h, "--pod-source", src, "--verify-interval", "1s", "--monitoring-port", strconv.Itoa(port))
	z = ztunneltest.Connect(b, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
	waitReady(b, addr)
	firstPass := 0.0
	for deadline := time.Now().Add(30 * time.Second); firstPass == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatal("no verification pass of all 500 pods")
		}
		m := scrape(b, port)
		if metricValue(m, "nftcni_ruleset_verified_pods") == pods {
			firstPass = metricValue(m, "nftcni_ruleset_verify_pass_seconds")
		}
	}
	const passes = 5
	c1 := cpuTime(b, cmd.Process.Pid)
	time.Sleep(passes * time.Second)
	c2 := cpuTime(b, cmd.Process.Pid)
	b.ReportMetric(float64(pods)/enrolTook.Seconds(), "pods/s-enrol")
	b.ReportMetric(median(ready).Seconds(), "s/ready-500pods")
	b.ReportMetric(median(acked).Seconds(), "s/snapshot-acked-500pods")
	b.ReportMetric(float64(rssBefore)/1024, "MB-rss-500pods")
	b.ReportMetric(float64(rssAfter)/1024, "MB-rss-after-restart")
	b.ReportMetric(firstPass*1000, "ms-first-verify-pass")
	b.ReportMetric(float64((c2-c1).Microseconds())/1000/passes, "ms-cpu-per-verify-pass")
}

// metricValue is the value of an unlabelled metric in a scrape (-1: none).
func metricValue(scrape, name string) float64 {
	for _, l := range strings.Split(scrape, "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err == nil {
				return v
			}
		}
	}
	return -1
}

// cpuTime is the CPU time a process's threads have had so far (schedstat:
// nanoseconds on a CPU), finer than /proc/PID/stat's clock ticks.
func cpuTime(b *testing.B, pid int) time.Duration {
	b.Helper()
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	if err != nil || len(tasks) == 0 {
		b.Fatalf("no threads of %d: %v", pid, err)
	}
	var total time.Duration
	for _, t := range tasks {
		raw, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that ended
		}
		if f := strings.Fields(string(raw)); len(f) > 0 {
			ns, _ := strconv.ParseInt(f[0], 10, 64)
			total += time.Duration(ns)
		}
	}
	return total
}
