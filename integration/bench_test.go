package integration

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/tidwall/sjson"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/unixsock"
	"github.com/nftcni/nftcni/plugin/wire"
	"github.com/nftcni/nftcni/templates"
)

// BenchmarkCNIAdd measures what nftcni adds to a pod's CNI ADD: the same
// primary chain (loopback + bridge + host-local) run by libcni from the
// node netns, alone and with one plugin appended: the reference tuning
// plugin with nothing to tune (what appending a real plugin costs here),
// nullplugin (the least any Go chained plugin can do: hand prevResult
// back), askplugin (nullplugin plus one round trip with the netns fd to a
// responder in this process that answers at once: the least a plugin that
// must ask an agent can do), and nftcni for a pod in an excluded namespace (no agent contact),
// a pod outside the mesh (one round trip to the agent), the same asking
// askplugin's responder in place of the agent ("plain-stub": the plugin's
// own share of "plain", the rest being the agent's), and an enrolled pod
// (ambient ruleset programmed into its netns, ztunnel handed the netns).
// Every round runs each variant once, in a rotating order, so drift on the
// machine hits them alike; each variant keeps its own pod netns (ADD, then
// DEL, round after round), so no netns is made or torn down while timing.
// Reported per variant: the median and p90 of the whole ADD in ms; "added"
// is a variant's median minus the primary's; "exec" is libcni's own time
// running the appended plugin (timed inside the chain, without the other
// plugins' noise). Exec-only rows: a static Go hello-world, nftcni and
// tuning answering VERSION.
func BenchmarkCNIAdd(b *testing.B) {
	testnet.RequireRoot(b)
	n := newCNINode(b, 70)
	n.pluginLogLevel = "info" // the product's default
	n.run = tmpfsDir(b)
	timed := newTimedExec(nil)
	n.cni = libcni.NewCNIConfigWithCacheDir(n.cni.Path, b.TempDir(), timed)
	n.startAgent()
	primary := n.list("bridge", "1.0.0", false, false)
	responder := filepath.Join(b.TempDir(), "ask.sock")
	respondAtOnce(b, responder)
	// nftcni's entry with a run dir whose plugin socket is another such
	// responder: its answer is a decision in the agent's own wire format.
	stubRun := b.TempDir()
	respondAtOnce(b, filepath.Join(stubRun, wire.SocketName))
	stubEntry, err := sjson.SetBytes(n.entry(false), "cni_agent_run_dir", stubRun)
	if err != nil {
		b.Fatal(err)
	}
	lists := map[string]*libcni.NetworkConfigList{
		"primary":    primary,
		"tuning":     withPlugin(b, primary, "tuning", `{"type": "tuning"}`),
		"null":       withPlugin(b, primary, "nullplugin", `{"type": "nullplugin"}`),
		"ask":        withPlugin(b, primary, "askplugin", `{"type": "askplugin", "socket": "`+responder+`"}`),
		"excluded":   n.list("bridge", "1.0.0", true, false),
		"plain":      n.list("bridge", "1.0.0", true, false),
		"plain-stub": withPlugin(b, primary, templates.PluginType, string(stubEntry)),
		"enrolled":   n.list("bridge", "1.0.0", true, false),
	}
	appended := map[string]string{"tuning": "tuning", "null": "nullplugin", "ask": "askplugin", "excluded": "nftcni", "plain": "nftcni", "plain-stub": "nftcni", "enrolled": "nftcni"}
	execs := map[string]string{"hello-exec": filepath.Join(binDir, "hello"), "nftcni-version-exec": filepath.Join(binDir, "nftcni"),
		"tuning-version-exec": filepath.Join(referencePlugins(b), "tuning")}
	order := []string{"primary", "tuning", "null", "ask", "excluded", "plain", "plain-stub", "enrolled", "hello-exec", "nftcni-version-exec", "tuning-version-exec"}
	targets := []string{"enrolled", "plain"}
	// Whose time "plain" spends over askplugin: the plugin's (plain-stub
	// over ask) and the agent's (plain over plain-stub).
	shares := [][2]string{{"plain-stub", "ask"}, {"plain", "plain-stub"}}
	// Another build of the plugin (NFTCNI_BENCH_BASE_PLUGIN: the same
	// command at the commit to compare with) runs as two more variants on
	// the same agent: a change to the plugin is then measured within one
	// run, where runs apart differ by about as much as such a change.
	if base := os.Getenv("NFTCNI_BENCH_BASE_PLUGIN"); base != "" {
		copyFile(b, base, filepath.Join(binDir, "nftcnibase"))
		entry, err := sjson.SetBytes(n.entry(false), "type", "nftcnibase")
		if err != nil {
			b.Fatal(err)
		}
		for _, v := range []string{"plain-base", "enrolled-base"} {
			lists[v] = withPlugin(b, primary, "nftcnibase", string(entry))
			appended[v] = "nftcnibase"
		}
		order = append(order, "plain-base", "enrolled-base")
		targets = append(targets, "plain-base", "enrolled-base")
	}
	pods := map[string]*testnet.NS{}
	for v := range lists {
		pods[v] = testnet.NewNS(b, "nftbench")
	}
	samples := map[string][]time.Duration{}
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		for j := range order {
			v := order[(i+j)%len(order)] // rotate who goes first
			if bin, ok := execs[v]; ok {
				start := time.Now()
				_, err := (&invoke.RawExec{Stderr: os.Stderr}).ExecPlugin(context.Background(), bin,
					[]byte(`{"cniVersion":"1.0.0"}`), []string{"CNI_COMMAND=VERSION"})
				samples[v] = append(samples[v], time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
				continue
			}
			namespace, name := plainNS, fmt.Sprintf("%s-%d", v, i)
			switch v {
			case "enrolled", "enrolled-base":
				namespace = meshNS
			case "excluded":
				namespace = "kube-system" // passes through without asking the agent
			case "plain-stub":
				namespace = meshNS // the responder answers "none" whatever the pod
			}
			n.pod(namespace, name, nil)
			rt := runtimeConf(pods[v], namespace, name, nil)
			start := time.Now()
			_, err := n.add(lists[v], rt)
			took := time.Since(start)
			if err != nil {
				b.Fatalf("%s ADD: %v\nagent log:\n%s", v, err, n.log)
			}
			samples[v] = append(samples[v], took)
			if p, ok := appended[v]; ok {
				samples[v+"-exec"] = append(samples[v+"-exec"], timed.last(p))
			}
			if err := n.del(lists[v], rt); err != nil {
				b.Fatalf("%s DEL: %v", v, err)
			}
			n.store.DeletePod(namespace, name)
		}
	}
	if got := len(n.enroller().Members()); got != 0 {
		b.Fatalf("agent still holds %d pods", got)
	}
	rows := slices.Clone(order)
	for v := range appended {
		rows = append(rows, v+"-exec")
	}
	sort.Strings(rows)
	q := reportQuantiles(b, rows, samples)
	for v := range appended {
		b.ReportMetric(q(v, 0.5)-q("primary", 0.5), "added-"+v+"-ms-median")
	}
	// The targets' ratios with their spread: the same medians over
	// bootstrap resamples of the rounds (each round runs every variant).
	for _, v := range targets {
		reportExecRatio(b, samples, v, "tuning", v+"-vs-tuning-exec-x")
	}
	for _, s := range shares {
		reportExecRatio(b, samples, s[0], s[1], s[0]+"-vs-"+s[1]+"-exec-x")
	}
	if len(samples["enrolled-base-exec"]) > 0 {
		for _, v := range []string{"enrolled", "plain"} {
			reportExecRatio(b, samples, v, v+"-base", v+"-vs-base-exec-x")
		}
	}
	reportEnrolTimings(b, n.log.String())
	b.ReportMetric(q("enrolled", 0.5)*1e6, "ns/op")
}

// reportExecRatio reports variant v's appended-plugin exec against base's,
// paired by round, as metric name with its 90% bootstrap interval (name-p5,
// name-p95).
func reportExecRatio(b *testing.B, samples map[string][]time.Duration, v, base, name string) {
	r, lo, hi := addedRatio(samples, v+"-exec", base+"-exec", "")
	b.ReportMetric(r, name)
	b.ReportMetric(lo, name+"-p5")
	b.ReportMetric(hi, name+"-p95")
}

// tmpfsDir is a directory on a tmpfs, as the agent's run dir is on a node
// (/var/run): its records are written with fsync, which a tmpfs makes free
// and this machine's ext4 /tmp does not.
func tmpfsDir(t testing.TB) string {
	dir, err := os.MkdirTemp("/dev/shm", "nftcni-bench-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// respondAtOnce serves askplugin at path until the benchmark ends: every
// question (with its descriptor, closed at once) gets a short answer, from
// a goroutine per connection on Go's poller, as the agent serves its
// plugin. The answer is in the plugin protocol's own format, which nftcni
// can be pointed at too: a decision not to enrol, or done to a DEL.
func respondAtOnce(b *testing.B, path string) {
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	answer, err := wire.Encode(&wire.Message{Kind: wire.KindDecision, Decision: &wire.Verdict{Mode: wire.ModeNone, Reason: "namespace plain does not enrol its pods"}})
	if err != nil {
		b.Fatal(err)
	}
	done, err := wire.Encode(&wire.Message{Kind: wire.KindDone})
	if err != nil {
		b.Fatal(err)
	}
	go func() {
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				q, err := readAsk(c)
				if err != nil {
					return
				}
				a := answer
				if m, err := wire.Decode(q); err == nil && m.Kind == wire.KindDel { // nftcni's DEL
					a = done
				}
				if _, err := c.Write(a); err == nil {
					_, _ = c.Read(make([]byte, 64)) // until the plugin closes
				}
			}()
		}
	}()
}

// readAsk reads one askplugin question from c and closes the descriptors
// it carried.
func readAsk(c *net.UnixConn) ([]byte, error) {
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	fds, _ := unixsock.Rights(oob[:oobn])
	wire.CloseAll(fds)
	return buf[:n], nil
}

// reportEnrolTimings reports the medians of the phases the agent logs for
// each enrolled ADD ("pod enrolled": ready_ms from the decision to the
// plugin told it may answer, done_ms to the annotation written, and the
// plugin's decided_ms and programmed_ms from its start),
// which say whose time an enrolled ADD spends.
func reportEnrolTimings(b *testing.B, log string) {
	fields := []string{"ready_ms", "done_ms", "plugin_decided_ms", "plugin_programmed_ms"}
	vals := map[string][]float64{}
	for _, l := range strings.Split(log, "\n") {
		if !strings.Contains(l, `msg="pod enrolled"`) {
			continue
		}
		for _, f := range strings.Fields(l) {
			k, v, ok := strings.Cut(f, "=")
			if x, err := strconv.ParseFloat(v, 64); ok && err == nil && slices.Contains(fields, k) {
				vals[k] = append(vals[k], x)
			}
		}
	}
	for _, k := range fields {
		if s := vals[k]; len(s) > 0 {
			slices.Sort(s)
			b.ReportMetric(s[len(s)/2], "enrolled-"+strings.ReplaceAll(strings.TrimSuffix(k, "_ms"), "_", "-")+"-ms-median")
		}
	}
}

// withPlugin appends plugin (its conf entry) to a chain.
func withPlugin(b *testing.B, l *libcni.NetworkConfigList, plugin, entry string) *libcni.NetworkConfigList {
	doc, err := conflist.Insert(l.Bytes, plugin, []byte(entry))
	if err != nil {
		b.Fatal(err)
	}
	out, err := libcni.NetworkConfFromBytes(doc)
	if err != nil {
		b.Fatal(err)
	}
	return out
}

// reportQuantiles reports each variant's median and p90 in ms and returns
// the quantile function, in ms, for derived figures.
func reportQuantiles(b *testing.B, order []string, samples map[string][]time.Duration) func(v string, p float64) float64 {
	q := func(v string, p float64) float64 { return float64(quantile(samples[v], p)) / 1e6 }
	for _, v := range order {
		if len(samples[v]) > 0 {
			b.ReportMetric(q(v, 0.5), v+"-ms-median")
			b.ReportMetric(q(v, 0.9), v+"-ms-p90")
		}
	}
	return q
}

// median of xs: of an even count, the mean of the middle two. For the
// medians over rounds (few, often even); quantile is for pooled samples.
func median[T ~float64 | ~int64](xs []T) T {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

// addedRatio compares what two variants add over base, round by round: the
// median over rounds of (v − base) divided by that of (ref − base), with
// the 5th and 95th percentiles of the same ratio over bootstrap resamples
// of the rounds (a round keeps its variants together, so slow drift on the
// machine cancels). Sandbox starts here vary by ±10 ms around 50–200 ms,
// so an "added" of a few ms needs its interval beside it. With base ""
// it compares the variants themselves (the appended plugin's exec).
// NaN when a variant has no rounds.
func addedRatio(samples map[string][]time.Duration, v, ref, base string) (ratio, lo, hi float64) {
	n := min(len(samples[v]), len(samples[ref]))
	if base != "" {
		n = min(n, len(samples[base]))
	}
	if n == 0 { // a variant left out (NFTCNI_BENCH_VARIANTS)
		return math.NaN(), math.NaN(), math.NaN()
	}
	at := func(variant string, r int) float64 {
		if base == "" {
			return float64(samples[variant][r])
		}
		return float64(samples[variant][r] - samples[base][r])
	}
	of := func(rounds []int) float64 {
		dv, dr := make([]float64, len(rounds)), make([]float64, len(rounds))
		for i, r := range rounds {
			dv[i], dr[i] = at(v, r), at(ref, r)
		}
		return median(dv) / median(dr)
	}
	all := make([]int, n)
	for i := range all {
		all[i] = i
	}
	rng := rand.New(rand.NewPCG(1, 2)) // the same resamples every run
	boot := make([]float64, 1000)
	for i := range boot {
		rounds := make([]int, n)
		for j := range rounds {
			rounds[j] = rng.IntN(n)
		}
		boot[i] = of(rounds)
	}
	slices.Sort(boot)
	return of(all), boot[len(boot)*5/100], boot[len(boot)*95/100]
}

// BenchmarkRunPodSandbox measures what nftcni adds to a pod's start through
// a real runtime: CRI RunPodSandbox on containerd (1.6 and 2.x), the call
// kubelet makes, which creates the netns, runs the CNI chain and starts
// the pause container. Three chains: bridge alone, bridge + reference
// tuning with nothing to do (any chained plugin's cost), and bridge +
// nftcni with the agent, where pods outside the mesh and enrolled pods
// alternate. Rounds interleave the variants. Reported: median and p90 in
// ms, what nftcni adds over bridge alone, and that against what tuning
// adds, paired by round with its bootstrap interval; the same from
// containerd's own timer around the CNI ADD, which leaves out the pause
// container's start and its noise; the appended plugin's own run, exec to
// exit on the kernel's clock (execClock), the same comparison without the
// other plugins' noise; and StopPodSandbox, the pod's CNI DEL.
func BenchmarkRunPodSandbox(b *testing.B) {
	for i, gen := range containerdtest.Generations(b) {
		b.Run(gen.Name, func(b *testing.B) {
			variants, nftcniNode := criVariants(b, gen, i)
			order := []string{"primary", "tuning", "plain", "enrolled"}
			samples := map[string][]time.Duration{}
			setups := map[string][]time.Duration{} // containerd's own timing of each CNI ADD
			// The appended plugin's own run inside containerd, exec to exit.
			clock := newExecClock(b, "tuning", "nftcni")
			appended := map[string]string{"tuning": "tuning", "plain": "nftcni", "enrolled": "nftcni"}
			stops := map[string][]time.Duration{} // StopPodSandbox: the CNI DEL with the netns there
			b.StopTimer()
			missed := 0 // rounds without every appended plugin's run
			for r := 0; r < b.N; r++ {
				runs := map[string]time.Duration{}
				for j := range order {
					v := order[(r+j)%len(order)]
					node := variants[v].node
					name := fmt.Sprintf("bench-%d", r%benchPods)
					cfg := node.ctrd.Pod(variants[v].ns, name, fmt.Sprintf("uid-%s-%s", variants[v].ns, name), nil)
					setup0 := networkSetup(b, node)
					from, start := monotonic(), time.Now()
					id, err := node.ctrd.RunOn(variants[v].handler, cfg)
					took, to := time.Since(start), monotonic()
					if err != nil {
						b.Fatalf("%s RunPodSandbox: %v\n%s", v, err, tail(node.ctrd.Log(), 20))
					}
					samples[v] = append(samples[v], took)
					if p, ok := appended[v]; ok {
						if run, err := clock.run(p, from, to, 2*time.Second); err == nil {
							runs[v+"-exec"] = run
						} else {
							b.Logf("round %d, %s: %v", r, v, err)
						}
					}
					if setup := networkSetup(b, node) - setup0; setup > 0 {
						setups[v] = append(setups[v], setup)
					}
					start = time.Now()
					if err := node.ctrd.Stop(id); err != nil {
						b.Fatalf("%s StopPodSandbox: %v", v, err)
					}
					stops[v+"-stop"] = append(stops[v+"-stop"], time.Since(start))
					if err := node.ctrd.Remove(id); err != nil {
						b.Fatalf("%s RemovePodSandbox: %v", v, err)
					}
				}
				// The runs are compared round by round: a round keeps all
				// of them or none.
				if len(runs) < len(appended) {
					missed++
					continue
				}
				for k, run := range runs {
					samples[k] = append(samples[k], run)
				}
			}
			if missed > b.N/20 {
				b.Fatalf("the exec clock missed a run in %d of %d rounds", missed, b.N)
			}
			b.ReportMetric(float64(missed), "exec-rounds-missed")
			q := reportQuantiles(b, order, samples)
			reportQuantiles(b, []string{"primary-stop", "tuning-stop", "plain-stop", "enrolled-stop"}, stops)
			reportQuantiles(b, []string{"tuning-exec", "plain-exec", "enrolled-exec"}, samples)
			b.ReportMetric(q("enrolled", 0.5)-q("primary", 0.5), "added-enrolled-ms-median")
			b.ReportMetric(q("plain", 0.5)-q("primary", 0.5), "added-plain-ms-median")
			b.ReportMetric(q("tuning", 0.5)-q("primary", 0.5), "added-tuning-ms-median")
			for _, v := range []string{"enrolled", "plain"} {
				r, lo, hi := addedRatio(samples, v, "tuning", "primary")
				b.ReportMetric(r, v+"-vs-tuning-added-x")
				b.ReportMetric(lo, v+"-vs-tuning-added-x-p5")
				b.ReportMetric(hi, v+"-vs-tuning-added-x-p95")
				r, lo, hi = addedRatio(samples, v+"-exec", "tuning-exec", "")
				b.ReportMetric(r, v+"-vs-tuning-exec-x")
				b.ReportMetric(lo, v+"-vs-tuning-exec-x-p5")
				b.ReportMetric(hi, v+"-vs-tuning-exec-x-p95")
			}
			if gen.V2 && len(setups["enrolled"]) != b.N {
				b.Fatalf("containerd timed %d of %d enrolled CNI ADDs", len(setups["enrolled"]), b.N)
			}
			if len(setups["enrolled"]) == b.N {
				// The same comparison on containerd's timer around the CNI
				// chain: the pause container's start is out of it.
				sq := reportQuantiles(b, nil, setups)
				for _, v := range order {
					b.ReportMetric(sq(v, 0.5), v+"-cni-setup-ms-median")
				}
				for _, v := range []string{"enrolled", "plain"} {
					r, lo, hi := addedRatio(setups, v, "tuning", "primary")
					b.ReportMetric(r, v+"-vs-tuning-cni-setup-added-x")
					b.ReportMetric(lo, v+"-vs-tuning-cni-setup-added-x-p5")
					b.ReportMetric(hi, v+"-vs-tuning-cni-setup-added-x-p95")
				}
			}
			reportEnrolTimings(b, nftcniNode.alog.String())
			b.ReportMetric(q("enrolled", 0.5)*1e6, "ns/op")
		})
	}
}

// networkSetup reads containerd's running total of its CNI ADD time.
func networkSetup(b *testing.B, n *criNode) time.Duration {
	d, err := n.ctrd.NetworkSetup()
	if err != nil {
		b.Fatalf("containerd's metrics: %v\n%s", err, tail(n.ctrd.Log(), 40))
	}
	return d
}

// criVariant is where one variant of BenchmarkRunPodSandbox runs its pods.
type criVariant struct {
	node    *criNode
	handler string // the runtime handler, "" for the node's default
	ns      string // the pods' namespace: mesh is enrolled
}

// criVariants places BenchmarkRunPodSandbox's variants and returns them
// with the node running nftcni. On containerd 2.x they share one
// containerd, one runtime handler per chain, each handler on its own CNI
// conf dir: every variant pays the same runtime, and only its chain
// differs. containerd 1.6 has no per-handler CNI config: a node per chain
// there, so differences between its three instances are in its figures.
func criVariants(b *testing.B, gen containerdtest.Generation, i int) (map[string]criVariant, *criNode) {
	runDir := tmpfsDir(b) // a node's /run
	if gen.V2 {
		n := placeCRINode(b, 32+3*i, "1.0.0", "nftcni", "--run-dir", runDir)
		n.startContainerd(gen, map[string]string{
			"primary": filepath.Dir(n.writeConflist(filepath.Join(b.TempDir(), "net.d"), "")),
			"tuning":  filepath.Dir(n.writeConflist(filepath.Join(b.TempDir(), "net.d"), "tuning")),
		})
		return map[string]criVariant{"primary": {n, "primary", "plain"}, "tuning": {n, "tuning", "plain"},
			"plain": {n, "", "plain"}, "enrolled": {n, "", "mesh"}}, n
	}
	n := newCRINode(b, gen, 32+3*i, "1.0.0", "nftcni", "--run-dir", runDir)
	return map[string]criVariant{
		"primary":  {newCRINode(b, gen, 30+3*i, "1.0.0", ""), "", "plain"},
		"tuning":   {newCRINode(b, gen, 31+3*i, "1.0.0", "tuning"), "", "plain"},
		"plain":    {n, "", "plain"},
		"enrolled": {n, "", "mesh"},
	}, n
}

// The median of an even number of rounds is the mean of the middle two:
// with two rounds, taking the upper one reported the slower round's ratio.
func TestAddedRatioMedianOfEvenRounds(t *testing.T) {
	s := map[string][]time.Duration{"v": {2, 4}, "ref": {1, 1}}
	if r, _, _ := addedRatio(s, "v", "ref", ""); r != 3 {
		t.Errorf("two rounds, v 2 and 4 over ref 1: ratio %v, want 3", r)
	}
	s = map[string][]time.Duration{"v": {2, 4, 9}, "ref": {1, 1, 1}}
	if r, _, _ := addedRatio(s, "v", "ref", ""); r != 4 {
		t.Errorf("three rounds, v 2, 4, 9 over ref 1: ratio %v, want 4", r)
	}
}

// Over a full design (n rounds, 2n for an odd n) each variant runs once in
// each position per n rounds and follows each other variant equally often.
// A rotation failed the second: the bare node always followed Istio's CNI.
func TestRoundOrderIsBalanced(t *testing.T) {
	for n := 1; n <= 6; n++ {
		variants := make([]string, n)
		for i := range variants {
			variants[i] = string(rune('a' + i))
		}
		rounds := n
		if n%2 == 1 {
			rounds = 2 * n
		}
		at := map[[2]string]int{}    // {variant, position} -> rounds
		after := map[[2]string]int{} // {predecessor, variant} -> rounds
		for r := range rounds {
			order := roundOrder(variants, r)
			if got := slices.Sorted(slices.Values(order)); !slices.Equal(got, variants) {
				t.Fatalf("%d variants, round %d: %v is not each variant once", n, r, order)
			}
			for i, v := range order {
				at[[2]string{v, fmt.Sprint(i)}]++
				if i > 0 {
					after[[2]string{order[i-1], v}]++
				}
			}
		}
		for _, v := range variants {
			for i := range n {
				if c := at[[2]string{v, fmt.Sprint(i)}]; c != rounds/n {
					t.Errorf("%d variants over %d rounds: %s at position %d %d times, want %d", n, rounds, v, i, c, rounds/n)
				}
			}
			for _, w := range variants {
				if c := after[[2]string{w, v}]; w != v && c != rounds/n {
					t.Errorf("%d variants over %d rounds: %s after %s %d times, want %d", n, rounds, v, w, c, rounds/n)
				}
			}
		}
	}
}
