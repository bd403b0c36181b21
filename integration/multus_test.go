package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/nodetest"
	"github.com/nftcni/nftcni/internal/testnet"
)

// multusNetworks is the pod annotation that asks Multus for extra networks.
const multusNetworks = "k8s.v1.cni.cncf.io/networks"

// TestNodeMultus is standalone mode as OpenShift runs it, on a real node:
// Multus's thin plugin is the node's CNI (first in the conf dir, the
// bridge network its cluster network), the chart is installed with the
// OpenShift profile's values (standalone conflist in Multus's conf dir,
// the NetworkAttachmentDefinition nftcni in each namespace), and pods ask
// for the attachment. An ambient pod that asks starts captured (its
// capture proof passes and its traffic lands on ztunnel); a pod outside
// the mesh that asks, and one that does not, start untouched.
func TestNodeMultus(t *testing.T) {
	gen := containerd2(t)
	multus := filepath.Join(testnet.Cached("NFTCNI_MULTUS_BIN", "multus-v4.2.2"), "multus")
	bin, err := os.ReadFile(multus)
	if err != nil {
		msg := fmt.Sprintf("Multus's plugin: %v (make multus-bins; make test does)", err)
		if os.Getenv("NFTCNI_REQUIRE_CRI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	n := nodetest.Start(t, gen)
	ctx := context.Background()
	imageValues := importImages(t, n)

	// Multus as the node's CNI.
	if err := os.WriteFile(filepath.Join(n.BinDir, "multus"), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	multusDir := filepath.Join(n.Dir, "cni/multus.d")
	for _, d := range []string{multusDir, filepath.Join(n.Dir, "cni/multus-cache")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The cluster network is the node's bridge network as one plugin:
	// Multus v4.2.2 loses the host-local ranges of a conflist delegate in
	// its cache, and its DEL then fails (plugin bridge: "no IP ranges
	// specified").
	cluster := filepath.Join(multusDir, "nodenet.conf")
	clusterConf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "nodenet", "type": "bridge", "bridge": %q, "isGateway": true,
  "ipMasq": false, "hairpinMode": true,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}}
`, nodetest.Bridge, nodetest.PodSubnet, filepath.Join(n.Dir, "ipam"))
	if err := os.WriteFile(cluster, []byte(clusterConf), 0o644); err != nil {
		t.Fatal(err)
	}
	conf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "multus-cni-network", "type": "multus",
  "kubeconfig": %q, "confDir": %q, "cniDir": %q, "binDir": %q,
  "clusterNetwork": %q, "logLevel": "verbose", "logFile": %q}
`, filepath.Join(n.Dir, "admin.kubeconfig"), multusDir, filepath.Join(n.Dir, "cni/multus-cache"), n.BinDir,
		cluster, filepath.Join(n.Dir, "logs/multus.log"))
	if err := os.WriteFile(filepath.Join(n.ConfDir, "00-multus.conf"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(n.Dir, "logs/multus.log"))
			t.Logf("multus log:\n%s", tail(string(b), 40))
		}
	})
	installNADCRDOn(t, n.Config)
	mkNamespace(t, n, "amb", map[string]string{"istio.io/dataplane-mode": "ambient"})
	mkNamespace(t, n, "plain", nil)

	chart, _ := filepath.Abs("../deploy/charts/nftcni")
	values := append(imageValues, "-f", filepath.Join(chart, "profiles/openshift.yaml"), "--set", "pullPolicy=Never",
		"--set", "cniBinDir="+n.BinDir, "--set", "cniConfDir="+multusDir, "--set", "multus.namespaces={amb,plain}",
		"--set", "readiness.taint=")
	if out, err := n.Helm(append([]string{"install", "nftcni", chart, "--namespace", "kube-system", "--wait", "--timeout", "120s"}, values...)...); err != nil {
		t.Fatalf("helm install with the OpenShift profile: %v\n%s", err, out)
	}
	waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node")
	if b, err := os.ReadFile(filepath.Join(multusDir, "nftcni.conflist")); err != nil || !strings.Contains(string(b), `"nftcni"`) {
		t.Fatalf("the standalone conflist in Multus's conf dir: %v\n%s", err, b)
	}
	deployZtunnel(t, n)
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")

	attach := map[string]string{multusNetworks: "nftcni"}
	plain := runApp(t, n, "plain", "app", false)
	createAppAnnotated(t, n, "amb", "app", true, attach)
	amb := waitApp(t, n, "amb", "app", true)
	createAppAnnotated(t, n, "plain", "asks", false, attach)
	asks := waitApp(t, n, "plain", "asks", false)
	ask := func(podIP, path string) string { t.Helper(); return askApp(t, n, podIP, path) }
	if got := ask(amb, "/dial?addr="+plain+":8081"); !strings.HasPrefix(got, "ztunnel:15001 dst="+plain+":8081") {
		t.Errorf("the ambient pod attached through Multus: outbound %q, want ztunnel:15001", got)
	}
	if p, err := n.Client.CoreV1().Pods("amb").Get(ctx, "app", metav1.GetOptions{}); err != nil || p.Annotations["ambient.istio.io/redirection"] != "enabled" {
		t.Errorf("the ambient pod is not annotated enrolled: %v %v", err, p.Annotations)
	}
	for name, ip := range map[string]string{"plain/app": plain, "plain/asks": asks} {
		if got := ask(ip, "/dial?addr="+plain+":8081"); got != "app:8081" {
			t.Errorf("%s (outside the mesh): outbound %q, want the real server's app:8081", name, got)
		}
	}
	// Deleting the pod runs Multus's DEL, and nftcni's with it.
	grace := int64(1)
	if err := n.Client.CoreV1().Pods("amb").Delete(ctx, "app", metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			evs, _ := n.Client.CoreV1().Events("amb").List(ctx, metav1.ListOptions{})
			for _, e := range evs.Items {
				t.Logf("event %s/%s: %s %s", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
			}
		}
	})
	n.WaitFor("the ambient pod gone (Multus's DEL, and nftcni's, succeeded)", 90*time.Second, func() bool {
		_, err := n.Client.CoreV1().Pods("amb").Get(ctx, "app", metav1.GetOptions{})
		return err != nil
	})

	// helm uninstall takes our network out of Multus's conf dir and leaves
	// Multus's own files as they were.
	before := map[string][]byte{}
	for _, f := range []string{filepath.Join(n.ConfDir, "00-multus.conf"), cluster} {
		before[f], _ = os.ReadFile(f)
	}
	if out, err := n.Helm("uninstall", "nftcni", "--namespace", "kube-system", "--wait", "--timeout", "120s"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	n.WaitFor("the standalone conflist and the plugin gone after uninstall", 60*time.Second, func() bool {
		_, confErr := os.Stat(filepath.Join(multusDir, "nftcni.conflist"))
		_, binErr := os.Stat(filepath.Join(n.BinDir, "nftcni"))
		return os.IsNotExist(confErr) && os.IsNotExist(binErr)
	})
	for f, b := range before {
		if got, _ := os.ReadFile(f); string(got) != string(b) {
			t.Errorf("uninstall changed %s", f)
		}
	}
}
