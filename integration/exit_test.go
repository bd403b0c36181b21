package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/integration/kubetest"
)

// createManifest creates the objects of deploy/nftcni.yaml (the chart with
// its defaults) whose kind is in kinds (nil: all) on api, and returns the
// manifest.
func createManifest(t testing.TB, api *kubetest.Server, kinds []string) []byte {
	t.Helper()
	manifest, err := os.ReadFile("../deploy/nftcni.yaml")
	if err != nil {
		t.Fatal(err)
	}
	create := creator(t, api)
	for _, o := range objects(t, manifest) {
		if kinds != nil && !slices.Contains(kinds, o.GetKind()) {
			continue
		}
		if err := create(o, metav1.CreateOptions{}); err != nil {
			t.Fatalf("creating %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	return manifest
}

// TestAgentUnderChartRBACKeepsOnUpgradeAndUninstallsOnRemoval runs the agent
// as the chart's service account with exactly the chart's RBAC (from
// deploy/nftcni.yaml, created for real on a real kube-apiserver) and stops it
// in each situation a DaemonSet pod is stopped in:
//   - its DaemonSet present and selecting the node (upgrade, restart): the
//     conflist entry and the binary stay;
//   - the node no longer selected: removed;
//   - its RBAC deleted before the pod stops (Helm's order): removed;
//   - its DaemonSet deleted (helm uninstall): removed.
//
// Starting at all proves the RBAC suffices for the informers.
func TestAgentUnderChartRBACKeepsOnUpgradeAndUninstallsOnRemoval(t *testing.T) {
	api := kubetest.Start(t)
	ctx := context.Background()
	cs := api.Client
	create := creator(t, api)
	manifest := createManifest(t, api, nil)
	linux := map[string]string{"kubernetes.io/os": "linux"}
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: linux}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	setNodeOS := func(os string) {
		t.Helper()
		n, err := cs.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
		if err == nil {
			n.Labels["kubernetes.io/os"] = os
			_, err = cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		}
		if err != nil {
			t.Fatal(err)
		}
	}

	h := newHost(t)
	plugin := filepath.Join(h.bin, "nftcni")
	// stop runs an agent as the chart's service account until ready, lets
	// change happen, stops it, and returns its exit decision's log line.
	stop := func(change func()) string {
		t.Helper()
		cmd, addr, logs := startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-a", "--pod-namespace", "kube-system")
		waitReady(t, addr)
		if n := h.entries(t); n != 1 {
			t.Fatalf("%d entries while running", n)
		}
		if change != nil {
			change()
		}
		if err := logs.stop(t, cmd); err != nil {
			t.Fatalf("agent exit: %v\n%s", err, logs)
		}
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, `msg="on exit"`) {
				return l
			}
		}
		t.Fatalf("no exit decision logged:\n%s", logs)
		return ""
	}
	kept := func(what, decision string) {
		t.Helper()
		if n := h.entries(t); n != 1 {
			t.Errorf("%s: %d entries after the agent stopped, want 1 (%s)", what, n, decision)
		}
		if _, err := os.Stat(plugin); err != nil {
			t.Errorf("%s: plugin binary gone: %v (%s)", what, err, decision)
		}
	}
	removed := func(what, decision string) {
		t.Helper()
		if got, _ := os.ReadFile(h.path()); string(got) != string(h.orig) {
			t.Errorf("%s: the primary's config was not restored (%s):\n%s", what, decision, got)
		}
		if _, err := os.Stat(plugin); !os.IsNotExist(err) {
			t.Errorf("%s: plugin binary still installed (%s)", what, decision)
		}
	}

	// expect stops an agent after change and checks its decision and its effect.
	expect := func(what string, change func(), uninstall bool, reason string) {
		t.Helper()
		d := stop(change)
		if !strings.Contains(d, fmt.Sprintf("uninstall=%v", uninstall)) || !strings.Contains(d, reason) {
			t.Errorf("%s: decision %s, want uninstall=%v and %q", what, d, uninstall, reason)
		}
		if uninstall {
			removed(what, d)
		} else {
			kept(what, d)
		}
	}

	expect("upgrade", nil, false, "an upgrade or a restart")

	expect("node deselected", func() { setNodeOS("windows") }, true, "no longer selects node node-a")
	setNodeOS("linux")

	expect("RBAC gone first", func() {
		if err := cs.RbacV1().RoleBindings("kube-system").Delete(ctx, "nftcni", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}, true, "credentials went with the release")
	for _, o := range objects(t, manifest) {
		if o.GetKind() == "RoleBinding" {
			if err := create(o, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}

	expect("helm uninstall", func() {
		if err := cs.AppsV1().DaemonSets("kube-system").Delete(ctx, "nftcni-node", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}, true, "is gone")
}
