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
	"github.com/nftcni/nftcni/integration/testnet"
	"github.com/nftcni/nftcni/integration/ztunneltest"
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
// the new one from exec to ready with all 500 restored: each netns reopened
// and checked, each ruleset verified, ztunnel's snapshot sent. Reported:
// enrolment throughput, restart-to-ready seconds, and the agent's RSS
// with 500 pods before and after the restart.
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
	var restart time.Duration
	var rssAfter int
	for i := 0; i < b.N; i++ {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		z.Close()
		t0 := time.Now()
		var addr string
		cmd, addr, _ = startAgent(b, h, "--pod-source", src)
		z = ztunneltest.Connect(b, h.zsock)
		z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
		waitReady(b, addr)
		restart += time.Since(t0)
		if got := len(z.UIDs()); got != pods {
			b.Fatalf("snapshot after restart held %d pods, want %d", got, pods)
		}
		rssAfter = rssKB(b, cmd.Process.Pid)
	}
	b.StopTimer()
	b.ReportMetric(float64(pods)/enrolTook.Seconds(), "pods/s-enrol")
	b.ReportMetric(restart.Seconds()/float64(b.N), "s/restart-500pods")
	b.ReportMetric(float64(rssBefore)/1024, "MB-rss-500pods")
	b.ReportMetric(float64(rssAfter)/1024, "MB-rss-after-restart")
}
