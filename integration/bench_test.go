package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/integration/testnet"
)

// BenchmarkCNIAdd measures what nftcni adds to a pod's CNI ADD: the same
// primary chain (loopback + bridge + host-local) run by libcni from the
// node netns, without nftcni, with nftcni for a pod in an excluded
// namespace (no agent contact), for a pod outside the mesh (one round trip
// to the agent), and for an enrolled pod (agent answering from its cache,
// ambient ruleset programmed). They run interleaved in every round, each into
// a fresh netns, so drift on the machine hits them alike. Reported per
// variant: median and p90 of ADD in ms, and the added latency (nftcni
// minus primary only) at the median and p90. "exec" is the floor any
// chained plugin pays: exec'ing nftcni for VERSION, measured in the same
// rounds, and "tuning" appends the reference tuning plugin with nothing to
// tune instead of nftcni: what appending any chained plugin costs here.
func BenchmarkCNIAdd(b *testing.B) {
	testnet.RequireRoot(b)
	n := newCNINode(b, 70)
	n.startAgent()
	lists := map[string]*libcni.NetworkConfigList{
		"primary":  n.list("bridge", "1.0.0", false, false),
		"plain":    n.list("bridge", "1.0.0", true, false),
		"enrolled": n.list("bridge", "1.0.0", true, false),
		"excluded": n.list("bridge", "1.0.0", true, false),
		"tuning":   withTuning(b, n.list("bridge", "1.0.0", false, false)),
	}
	order := []string{"primary", "tuning", "excluded", "plain", "enrolled", "exec"}
	samples := map[string][]time.Duration{}
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		for j := range order {
			v := order[(i+j)%len(order)] // rotate who goes first
			if v == "exec" {
				// The floor: exec'ing the plugin for VERSION, no work at all.
				start := time.Now()
				_, err := (&invoke.RawExec{Stderr: os.Stderr}).ExecPlugin(context.Background(), filepath.Join(binDir, "nftcni"),
					[]byte(`{"cniVersion":"1.0.0"}`), []string{"CNI_COMMAND=VERSION"})
				samples[v] = append(samples[v], time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
				continue
			}
			pod := testnet.NewNS(b, "nftbench")
			namespace, name := plainNS, fmt.Sprintf("%s-%d", v, i)
			switch v {
			case "enrolled":
				namespace = meshNS
			case "excluded":
				namespace = "kube-system" // passes through without asking the agent
			}
			n.pod(namespace, name, nil)
			rt := runtimeConf(pod, namespace, name, nil)
			start := time.Now()
			_, err := n.add(lists[v], rt)
			took := time.Since(start)
			if err != nil {
				b.Fatalf("%s ADD: %v\nagent log:\n%s", v, err, n.log)
			}
			samples[v] = append(samples[v], took)
			if err := n.del(lists[v], rt); err != nil {
				b.Fatalf("%s DEL: %v", v, err)
			}
			_ = exec.Command("ip", "netns", "del", pod.Name).Run()
		}
	}
	if got := len(n.enroller().Members()); got != 0 {
		b.Fatalf("agent still holds %d pods", got)
	}
	q := reportQuantiles(b, order, samples)
	b.ReportMetric(q("enrolled", 0.5)-q("primary", 0.5), "added-enrolled-ms-median")
	b.ReportMetric(q("enrolled", 0.9)-q("primary", 0.9), "added-enrolled-ms-p90")
	b.ReportMetric(q("plain", 0.5)-q("primary", 0.5), "added-plain-ms-median")
	b.ReportMetric(q("excluded", 0.5)-q("primary", 0.5), "added-excluded-ms-median")
	b.ReportMetric(q("tuning", 0.5)-q("primary", 0.5), "added-tuning-ms-median")
	// What nftcni costs beyond being a chained plugin at all.
	b.ReportMetric(q("enrolled", 0.5)-q("tuning", 0.5), "own-enrolled-ms-median")
	b.ReportMetric(q("plain", 0.5)-q("tuning", 0.5), "own-plain-ms-median")
	b.ReportMetric(q("enrolled", 0.5)*1e6, "ns/op")
}

// reportQuantiles reports each variant's median and p90 in ms and returns
// the quantile function, in ms, for derived figures.
func reportQuantiles(b *testing.B, order []string, samples map[string][]time.Duration) func(v string, p float64) float64 {
	q := func(v string, p float64) float64 {
		s := slices.Clone(samples[v])
		slices.Sort(s)
		return float64(s[int(p*float64(len(s)-1))]) / 1e6
	}
	for _, v := range order {
		if len(samples[v]) > 0 {
			b.ReportMetric(q(v, 0.5), v+"-ms-median")
			b.ReportMetric(q(v, 0.9), v+"-ms-p90")
		}
	}
	return q
}

// withTuning appends the reference tuning plugin with nothing to tune: the
// cost of any chained plugin, for comparison.
func withTuning(b *testing.B, l *libcni.NetworkConfigList) *libcni.NetworkConfigList {
	doc, err := conflist.Insert(l.Bytes, "tuning", []byte(`{"type": "tuning"}`))
	if err != nil {
		b.Fatal(err)
	}
	out, err := libcni.NetworkConfFromBytes(doc)
	if err != nil {
		b.Fatal(err)
	}
	return out
}

// BenchmarkRunPodSandbox measures what nftcni adds to a pod's start through
// a real runtime: CRI RunPodSandbox on containerd (1.6 and 2.x), the call
// kubelet makes, which creates the netns, runs the CNI chain and starts
// the pause container. Three nodes run side by side, each with its own
// containerd: bridge alone, bridge + reference tuning with nothing to do
// (any chained plugin's cost), and bridge + nftcni with the agent, where
// pods outside the mesh and enrolled pods alternate. Rounds interleave
// the variants; stop and remove happen outside the timed call. Reported:
// median and p90 in ms, and what nftcni adds over bridge alone.
func BenchmarkRunPodSandbox(b *testing.B) {
	for i, gen := range containerdtest.Generations(b) {
		b.Run(gen.Name, func(b *testing.B) {
			nodes := map[string]*criNode{
				"primary": newCRINode(b, gen, 30+3*i, "1.0.0", ""),
				"tuning":  newCRINode(b, gen, 31+3*i, "1.0.0", "tuning"),
				"nftcni":  newCRINode(b, gen, 32+3*i, "1.0.0", "nftcni"),
			}
			order := []string{"primary", "tuning", "plain", "enrolled"}
			samples := map[string][]time.Duration{}
			b.StopTimer()
			for r := 0; r < b.N; r++ {
				for j := range order {
					v := order[(r+j)%len(order)]
					node, ns := nodes[v], "plain"
					switch v {
					case "plain":
						node = nodes["nftcni"]
					case "enrolled":
						node, ns = nodes["nftcni"], "mesh"
					}
					name := fmt.Sprintf("bench-%d", r%benchPods)
					cfg := node.ctrd.Pod(ns, name, fmt.Sprintf("uid-%s-%s", ns, name), nil)
					start := time.Now()
					id, err := node.ctrd.Run(cfg)
					took := time.Since(start)
					if err != nil {
						b.Fatalf("%s RunPodSandbox: %v\n%s", v, err, tail(node.ctrd.Log(), 20))
					}
					samples[v] = append(samples[v], took)
					node.remove(containerdtest.Sandbox{ID: id})
				}
			}
			q := reportQuantiles(b, order, samples)
			b.ReportMetric(q("enrolled", 0.5)-q("primary", 0.5), "added-enrolled-ms-median")
			b.ReportMetric(q("plain", 0.5)-q("primary", 0.5), "added-plain-ms-median")
			b.ReportMetric(q("tuning", 0.5)-q("primary", 0.5), "added-tuning-ms-median")
			b.ReportMetric(q("enrolled", 0.5)*1e6, "ns/op")
		})
	}
}
