package integration

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/klog/v2"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

var notReady = corev1.Taint{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule}

// taintedNode creates a node as kubelet --register-with-taints would, with
// Istio's not-ready taint and one of someone else's.
func taintedNode(t *testing.T, api *kubetest.Server, name string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{notReady, {Key: "example.com/other", Value: "x", Effect: corev1.TaintEffectNoSchedule}}}}
	if _, err := api.Client.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// nodeState reads the node's taint keys and the gate's condition.
func nodeState(t *testing.T, api *kubetest.Server, name string) (taints []string, cond *corev1.NodeCondition) {
	t.Helper()
	n, err := api.Client.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range n.Spec.Taints {
		taints = append(taints, tn.Key)
	}
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == "nftcni.io/NetworkReady" {
			cond = &n.Status.Conditions[i]
		}
	}
	return taints, cond
}

// On a real API server with the chart's RBAC: a node created tainted stays
// tainted while no ztunnel is connected (the condition says why), and is
// untainted once one has connected and acked its snapshot; someone else's
// taint stays. The chart's DaemonSet tolerates the taint, so the agent's
// own pod can start on the node it must untaint.
func TestReadinessGateUntaintsOnceZtunnelIsConnected(t *testing.T) {
	api := kubetest.Start(t)
	manifest := createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	for _, o := range objects(t, manifest) {
		if o.GetKind() != "DaemonSet" {
			continue
		}
		var ds appsv1.DaemonSet
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &ds); err != nil {
			t.Fatal(err)
		}
		if !corev1helpers.TolerationsTolerateTaint(klog.Background(), ds.Spec.Template.Spec.Tolerations, &notReady, false) {
			t.Errorf("the chart's DaemonSet does not tolerate %s: its pod could never untaint the node", notReady.ToString())
		}
	}
	taintedNode(t, api, "node-g")
	h := newHost(t)
	startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-g")

	eventually(t, "the condition False, naming ztunnel", func() bool {
		_, c := nodeState(t, api, "node-g")
		return c != nil && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "ztunnel")
	})
	time.Sleep(1500 * time.Millisecond) // a second evaluation or more, ztunnel still absent
	if taints, _ := nodeState(t, api, "node-g"); !slices.Contains(taints, notReady.Key) {
		t.Fatalf("untainted without a ztunnel: %v", taints)
	}

	z := ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	eventually(t, "untainted, the condition True", func() bool {
		taints, c := nodeState(t, api, "node-g")
		return !slices.Contains(taints, notReady.Key) && c != nil && c.Status == corev1.ConditionTrue
	})
	// Someone else's taint stays (and the API server's own node.kubernetes.io/not-ready).
	if taints, _ := nodeState(t, api, "node-g"); !slices.Contains(taints, "example.com/other") {
		t.Errorf("taints after untainting: %v, want someone else's kept", taints)
	}
}

// Continuous mode: the agent unready past the grace period (ztunnel gone)
// taints the node again, and untaints it when ztunnel is back.
func TestReadinessGateRetaintsAfterTheGracePeriod(t *testing.T) {
	api := kubetest.Start(t)
	createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	taintedNode(t, api, "node-r")
	h := newHost(t)
	startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-r", "--readiness-retaint", "--readiness-grace", "1s")
	z := ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	has := func() bool { taints, _ := nodeState(t, api, "node-r"); return slices.Contains(taints, notReady.Key) }
	eventually(t, "untainted", func() bool { return !has() })
	z.Close()
	eventually(t, "tainted again after the grace period", has)
	z = ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	eventually(t, "untainted again", func() bool { return !has() })
}

// Without ZDS (ambient off: --ztunnel-socket none) there is no ztunnel to
// wait for: the node is untainted once the install is in place.
func TestReadinessGateWithoutZtunnel(t *testing.T) {
	api := kubetest.Start(t)
	createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	taintedNode(t, api, "node-s")
	h := newHost(t)
	startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-s", "--ztunnel-socket", "none")
	eventually(t, "untainted without ztunnel configured", func() bool {
		taints, c := nodeState(t, api, "node-s")
		return !slices.Contains(taints, notReady.Key) && c != nil && c.Status == corev1.ConditionTrue
	})
}
