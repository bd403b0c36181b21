package integration

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestCRIEveryInstallMode: each install mode the agent offers for a node
// whose runtime runs the primary network (chained, owned, drop-in), as
// containerd's CRI loads it, on containerd 1.6 and 2.x: an enrolled pod
// starts captured (its ruleset, ztunnel has its netns, its outbound lands
// on ztunnel's 15001), a pod outside the mesh starts untouched, and
// uninstall leaves the primary's conflist byte-identical with nothing of
// ours in the conf dir. Drop-ins are read by libcni v1.3+ only: containerd
// 2.x runs nftcni from one, 1.6 never does (the test holds the docs to
// that). Standalone mode is an extra network that only Multus runs:
// TestStandaloneNetwork.
func TestCRIEveryInstallMode(t *testing.T) {
	for i, gen := range containerdtest.Generations(t) {
		for j, mode := range []string{"chained", "owned", "dropin"} {
			t.Run(gen.Name+"/"+mode, func(t *testing.T) { testCRIMode(t, gen, 70+3*i+j, mode) })
		}
	}
}

func testCRIMode(t *testing.T, gen containerdtest.Generation, subnet int, mode string) {
	n := placeCRINode(t, subnet, "1.0.0", "")
	orig, err := os.ReadFile(n.primary)
	if err != nil {
		t.Fatal(err)
	}
	n.podSrc = podSourceDir(t, criPods())
	if mode == "dropin" {
		// Someone else's drop-in too: the network's drop-in dir exists
		// before ours and stays after it, so neither our install nor our
		// uninstall makes or removes the dir (an event containerd reloads on).
		other := filepath.Join(n.h.conf, fmt.Sprintf("crinet%d", subnet), "10-tuning.conf")
		if err := os.MkdirAll(filepath.Dir(other), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(other, []byte(`{"type": "tuning"}`+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The runtime first, as on a node (the agent is a DaemonSet pod), and
	// the agent told the runtime as the kubelet reports it in the Node.
	n.startContainerd(gen, nil)
	rt, err := n.ctrd.RuntimeVersion()
	if err != nil {
		t.Fatal(err)
	}
	readsDropIns := !strings.HasPrefix(gen.Name, "containerd-1.")
	refused := mode == "dropin" && !readsDropIns
	if refused {
		// Never reported as installed: unready, saying why.
		addr := n.launchAgent("--mode", mode, "--container-runtime", rt)
		eventually(t, "the agent unready, naming "+rt, func() bool {
			return strings.Contains(readyz(t, addr), "reads no CNI drop-ins")
		})
		t.Logf("%s: %s", rt, readyz(t, addr))
		n.connectZtunnel()
	} else {
		n.startAgent("--mode", mode, "--container-runtime", rt)
	}

	app, appNS := n.run("mesh", "app", "uid-app", nil)
	if refused {
		if hasTable(t, appNS) {
			t.Errorf("%s ran nftcni from a drop-in: the docs say it reads none", gen.Name)
		}
		if _, err := os.Stat(filepath.Join(n.h.conf, fmt.Sprintf("crinet%d", subnet), "nftcni.conf")); err == nil {
			t.Errorf("the agent wrote a drop-in for %s", rt)
		}
	} else {
		if err := nft.Verify(appNS.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
			t.Errorf("mesh/app's ruleset in %s mode: %v", mode, err)
		}
		n.z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
		if _, err := appNS.Dial(t, "tcp", "192.0.2.1:443", testnet.DialOpts{}); err != nil {
			t.Fatal(err)
		}
		if a, err := testnet.Accept(t, n.z.Pod("uid-app").Outbound, 2*time.Second); err != nil || a.OrigDst.String() != "192.0.2.1:443" {
			t.Errorf("mesh/app's outbound in %s mode: %+v %v, want it on ztunnel's 15001", mode, a, err)
		}
	}
	web, webNS := n.run("plain", "web", "uid-web", nil)
	if hasTable(t, webNS) {
		t.Errorf("plain/web got a ruleset in %s mode", mode)
	}
	upstream := n.h.netns.Listen(t, n.gateway()+":8080", false)
	if _, err := webNS.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("plain/web's connection in %s mode: %v", mode, err)
	}
	n.remove(app)
	n.remove(web)

	// Uninstall: the primary as it was, nothing of ours left, and the
	// runtime no longer calls nftcni (its binary is gone).
	n.killAgent()
	run(t, n.h.agent("uninstall"))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		id, err := n.ctrd.Run(n.ctrd.Pod("plain", "after", "uid-after", nil))
		if err == nil {
			_ = n.ctrd.Stop(id)
			_ = n.ctrd.Remove(id)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no sandbox starts after the uninstall in %s mode: %v", mode, err)
		}
	}
	if got, _ := os.ReadFile(n.primary); !bytes.Equal(got, orig) {
		t.Errorf("after uninstall in %s mode the primary differs:\n%s\nwas:\n%s", mode, got, orig)
	}
	_ = filepath.WalkDir(n.h.conf, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && p != n.primary {
			b, _ := os.ReadFile(p)
			if bytes.Contains(b, []byte(`"nftcni"`)) {
				t.Errorf("after uninstall in %s mode %s is left:\n%s", mode, p, b)
			}
		}
		return nil
	})
}

// readyz is the agent's /readyz answer: "ok" or why it is not ready.
func readyz(t testing.TB, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(b))
}

// TestDropInReadsTheRuntimeFromTheNode: on Kubernetes, drop-in mode reads
// the node's container runtime from the Node the kubelet reports (through
// the chart's RBAC) and refuses one that reads no drop-ins: the agent
// stays unready, saying why, and writes no drop-in. On a runtime that
// reads them the drop-in goes in.
func TestDropInReadsTheRuntimeFromTheNode(t *testing.T) {
	api := kubetest.Start(t)
	createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	for _, c := range []struct {
		node, runtime string
		refused       bool
	}{{"node-old", "containerd://1.7.27", true}, {"node-new", "containerd://2.1.3", false}} {
		n, err := api.Client.CoreV1().Nodes().Create(t.Context(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: c.node}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Status.NodeInfo.ContainerRuntimeVersion = c.runtime
		if _, err := api.Client.CoreV1().Nodes().UpdateStatus(t.Context(), n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		h := newHost(t)
		cmd, addr, logs := startAgent(t, h, "--mode", "dropin", "--kubeconfig", api.AgentKubeconfig, "--node-name", c.node)
		dropIn := filepath.Join(h.conf, "k8s-pod-network", "nftcni.conf")
		if c.refused {
			eventually(t, "the agent unready, naming "+c.runtime, func() bool {
				r := readyz(t, addr)
				return strings.Contains(r, c.runtime) && strings.Contains(r, "reads no CNI drop-ins")
			})
			if _, err := os.Stat(dropIn); err == nil {
				t.Errorf("%s: the agent wrote %s", c.runtime, dropIn)
			}
		} else {
			waitReady(t, addr)
			if _, err := os.Stat(dropIn); err != nil {
				t.Errorf("%s: no drop-in: %v", c.runtime, err)
			}
		}
		if !strings.Contains(logs.String(), c.runtime) {
			t.Errorf("the agent's log never names the node's runtime %s:\n%s", c.runtime, logs)
		}
		_ = logs.stop(t, cmd)
	}
}
