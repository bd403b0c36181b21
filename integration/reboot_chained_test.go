package integration

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/nodetest"
)

// TestNodeRebootChained is istio#60882's race in chained mode: nftcni
// patched the primary's conflist, the node reboots, and the primary's
// installer rewrites its file with different bytes (our entry gone) before
// the node's services start, so the pods kubelet restarts run through a
// chain without nftcni until the agent is back. What must hold: no
// enrolled pod's application runs un-captured (its capture proof, an init
// container as istio-validation is, only passes once it is captured, and
// the app starts after it), the agent puts its entry back in the primary's
// new file (keeping the new bytes), and pods outside the mesh start
// without waiting for the agent. The test reports how long the ambient
// pod's sandbox ran un-captured.
func TestNodeRebootChained(t *testing.T) {
	gen := containerd2(t)
	n := nodetest.Start(t, gen)
	ctx := context.Background()
	installChained(t, n)
	primary := filepath.Join(n.ConfDir, nodetest.ConfFile)
	if b, _ := os.ReadFile(primary); !strings.Contains(string(b), `"nftcni"`) {
		t.Fatalf("the primary's conflist is not patched in chained mode:\n%s", b)
	}
	deployZtunnel(t, n)
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")
	mkNamespace(t, n, "amb", map[string]string{"istio.io/dataplane-mode": "ambient"})
	mkNamespace(t, n, "plain", nil)
	plain := runApp(t, n, "plain", "app", false)
	runApp(t, n, "amb", "app", true)
	ids := map[string]string{"amb/app": containerID(t, n, "amb/app"), "plain/app": containerID(t, n, "plain/app")}

	// The reboot; the primary rewrites its file with other bytes (an MTU
	// it did not set before) before anything else starts.
	rewritten := strings.Replace(n.PrimaryConflist(), `"hairpinMode": true,`, `"hairpinMode": true, "mtu": 1400,`, 1)
	if rewritten == n.PrimaryConflist() {
		t.Fatal("the primary's conflist has no hairpinMode to put an MTU beside")
	}
	n.Reboot(func() {
		if err := os.WriteFile(primary, []byte(rewritten), 0o644); err != nil {
			t.Fatal(err)
		}
	})
	rebooted := time.Now()

	// Pods outside the mesh start as before (nftcni is not in the chain
	// until the agent is back).
	n.WaitFor("the plain pod running again", 120*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("plain").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && podReady(p) && len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].ContainerID != ids["plain/app"]
	})

	// The ambient pod's app runs only once captured: its capture proof
	// (an init container) fails while it is not, and passes once it is.
	var amb string
	proofFailures := int32(0)
	n.WaitFor("the ambient pod running again, captured", 180*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("amb").Get(ctx, "app", metav1.GetOptions{})
		if err != nil || len(p.Status.InitContainerStatuses) != 1 {
			return false
		}
		proofFailures = p.Status.InitContainerStatuses[0].RestartCount
		if !podReady(p) || len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].ContainerID == ids["amb/app"] {
			return false
		}
		amb = p.Status.PodIP
		return true
	})
	ask := func(podIP, path string) string { t.Helper(); return askApp(t, n, podIP, path) }
	if got := ask(amb, "/dial?addr="+plain+":8081"); !strings.HasPrefix(got, "ztunnel:15001") {
		t.Errorf("after the reboot the ambient pod's outbound: %q, want ztunnel:15001", got)
	}
	t.Logf("after the reboot the ambient pod's capture proof failed %d times before it passed: its sandbox ran without nftcni until the agent was back and enrolled it late; its app started captured, Ready %v after the reboot",
		proofFailures, time.Since(rebooted).Round(time.Second))
	// The agent put its entry back into the primary's new file.
	if b, _ := os.ReadFile(primary); !strings.Contains(string(b), `"nftcni"`) || !strings.Contains(string(b), `"mtu": 1400`) {
		t.Errorf("the primary's conflist after the reboot (want its new bytes and our entry):\n%s", b)
	}
}
