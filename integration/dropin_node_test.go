package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/nodetest"
)

// TestNodeDropIn: drop-in mode under a real kubelet and containerd 2.x,
// the chart installed after the runtime is up, as on any node. The agent
// reads the runtime the kubelet reported in its Node, writes its drop-in
// into the primary network's dir and makes containerd reload: an ambient
// pod starts captured (its capture proof) and a plain pod's traffic is its
// own. helm uninstall leaves the primary byte-identical and no drop-in, and
// pods still start (containerd no longer calls the removed plugin).
func TestNodeDropIn(t *testing.T) {
	gen := containerd2(t)
	n := nodetest.Start(t, gen)
	primary := filepath.Join(n.ConfDir, nodetest.ConfFile)
	orig, err := os.ReadFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	installInMode(t, n, "dropin")
	dropIn := filepath.Join(n.ConfDir, "nodenet", "nftcni.conf")
	if b, err := os.ReadFile(dropIn); err != nil || !strings.Contains(string(b), `"nftcni"`) {
		t.Fatalf("the drop-in: %v\n%s", err, b)
	}
	if b, _ := os.ReadFile(primary); string(b) != string(orig) {
		t.Errorf("drop-in mode changed the primary's conflist:\n%s", b)
	}
	agent := waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node")
	if log := agentPodLog(t, n, agent); !strings.Contains(log, "containerd://2.") {
		t.Errorf("the agent's log never names the runtime the kubelet reported:\n%s", grepLines(log, "runtime"))
	}
	deployZtunnel(t, n)
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")
	mkNamespace(t, n, "amb", map[string]string{"istio.io/dataplane-mode": "ambient"})
	mkNamespace(t, n, "plain", nil)
	plain := runApp(t, n, "plain", "app", false)
	amb := runApp(t, n, "amb", "app", true)
	if got := askApp(t, n, amb, "/dial?addr="+plain+":8081"); !strings.HasPrefix(got, "ztunnel:15001 dst="+plain+":8081") {
		t.Errorf("the ambient pod's outbound: %q, want ztunnel:15001", got)
	}
	if got := askApp(t, n, plain, "/dial?addr="+plain+":8081"); got != "app:8081" {
		t.Errorf("the plain pod (outside the mesh): outbound %q, want the real server's app:8081", got)
	}
	if p, err := n.Client.CoreV1().Pods("amb").Get(t.Context(), "app", metav1.GetOptions{}); err != nil || p.Annotations["ambient.istio.io/redirection"] != "enabled" {
		t.Errorf("the ambient pod is not annotated enrolled: %v", err)
	}

	if out, err := n.Helm("uninstall", "nftcni", "--namespace", "kube-system", "--wait", "--timeout", "120s"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	n.WaitFor("the drop-in and the plugin gone after uninstall", 60*time.Second, func() bool {
		_, confErr := os.Stat(dropIn)
		_, binErr := os.Stat(filepath.Join(n.BinDir, "nftcni"))
		return os.IsNotExist(confErr) && os.IsNotExist(binErr)
	})
	if b, _ := os.ReadFile(primary); string(b) != string(orig) {
		t.Errorf("after uninstall the primary differs:\n%s", b)
	}
	runApp(t, n, "plain", "after", false)
}
