package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
)

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// The agent process against a real kube-apiserver: pods created through
// the plugin are enrolled and annotated; labelling a namespace enrols its
// running pods, unlabelling one takes them out; a deleted pod leaves ztunnel
// and the probe set.
func TestKubernetesEnrolment(t *testing.T) {
	api := kubetest.Start(t)
	ctx := context.Background()
	cs := api.Client
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{istio.LabelDataplaneMode: "ambient"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "legacy"}},
	} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mkPod := func(ns, name string) *corev1.Pod {
		p, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "app", Image: "app"}}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	cart, batch := mkPod("shop", "cart"), mkPod("legacy", "batch")
	mkPod("shop", "elsewhere") // bound to node-a too, never ADDed here
	// Annotated as enrolled by an agent before this one, which this agent
	// cannot find a netns for: ztunnel must be told to keep it.
	ghost, err := cs.CoreV1().Pods("shop").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "ghost", Namespace: "shop",
		Annotations: map[string]string{istio.AnnRedirection: "enabled"}},
		Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "app", Image: "app"}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	n := newAgentNode(t, 66, nil)
	h := n.h
	// As the chart's service account with the chart's RBAC: enough for
	// everything below (informers, the pods/status patch).
	createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	_, addr, _ := startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-a")
	waitReady(t, addr)
	z := ztunneltest.Connect(t, h.zsock)
	if e := z.Wait(zds.KindKeep, string(ghost.UID), 5*time.Second); e.FDs != 0 {
		t.Errorf("Keep carried %d fds", e.FDs)
	}
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	list := n.installed(t)
	rtFor := func(netns *testnet.NS, p *corev1.Pod) *libcni.RuntimeConf {
		rt := runtimeConf(netns, p.Namespace, p.Name, nil)
		for i := range rt.Args {
			if rt.Args[i][0] == "K8S_POD_UID" {
				rt.Args[i][1] = string(p.UID)
			}
		}
		return rt
	}
	redirection := func(ns, name string) string {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return "<" + err.Error() + ">"
		}
		return p.Annotations[istio.AnnRedirection]
	}
	hostNode := &cniNode{node: h.netns}

	cartNS, batchNS := testnet.NewNS(t, "nftpod"), testnet.NewNS(t, "nftpod")
	cartRes, err := n.add(list, rtFor(cartNS, cart))
	if err != nil {
		t.Fatalf("ADD shop/cart: %v", err)
	}
	if _, err := n.add(list, rtFor(batchNS, batch)); err != nil {
		t.Fatalf("ADD legacy/batch: %v", err)
	}
	cartIP := podIPs(t, cartRes)[0].String()
	z.Wait(zds.KindAdd, string(cart.UID), 5*time.Second)
	if !hasTable(t, cartNS) || hasTable(t, batchNS) {
		t.Fatalf("tables after ADD: cart %v batch %v", hasTable(t, cartNS), hasTable(t, batchNS))
	}
	// The annotation follows the ADD (it reports the capture; the ADD does
	// not wait for the API server).
	eventually(t, "shop/cart annotated "+istio.AnnRedirection+"=enabled", func() bool { return redirection("shop", "cart") == "enabled" })
	if set := hostNode.probeSet(t); !strings.Contains(set, cartIP+` comment "`+string(cart.UID)+`"`) {
		t.Errorf("probe set lacks shop/cart:\n%s", set)
	}

	// Late enrolment: label legacy; the agent programs batch's running netns.
	patch := []byte(`{"metadata":{"labels":{"istio.io/dataplane-mode":"ambient"}}}`)
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, "legacy", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindAdd, string(batch.UID), 10*time.Second)
	eventually(t, "legacy/batch's rules", func() bool { return hasTable(t, batchNS) })
	eventually(t, "legacy/batch annotated", func() bool { return redirection("legacy", "batch") == "enabled" })
	if _, err := batchNS.Dial(t, "tcp", "192.0.2.7:80", testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, z.Pod(string(batch.UID)).Outbound, 2*time.Second); err != nil {
		t.Errorf("late-enrolled pod's traffic did not reach ztunnel: %v", err)
	}

	// ztunnel restarts: the new connection's snapshot holds both enrolled
	// pods, each with its netns.
	z.Close()
	z = ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	for _, uid := range []string{string(cart.UID), string(batch.UID)} {
		if z.Pod(uid) == nil {
			t.Errorf("snapshot after ztunnel's reconnect lacks %s (has %v)", uid, z.UIDs())
		}
	}

	// Unenrolment: unlabel shop; cart's rules, annotation, ztunnel hold and
	// probe entry go, and its traffic goes where it was sent.
	unpatch := []byte(`{"metadata":{"labels":{"istio.io/dataplane-mode":null}}}`)
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, "shop", types.MergePatchType, unpatch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindDel, string(cart.UID), 10*time.Second)
	eventually(t, "shop/cart's rules removed", func() bool { return !hasTable(t, cartNS) })
	eventually(t, "shop/cart's annotation removed", func() bool { return redirection("shop", "cart") == "" })
	eventually(t, "shop/cart's probe entry removed", func() bool { return !strings.Contains(hostNode.probeSet(t), cartIP) })
	gw := gateway(t, cartRes)
	upstream := n.node.Listen(t, gw.String()+":8080", false)
	if _, err := cartNS.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("unenrolled pod's traffic did not go direct: %v", err)
	}

	// Pod deleted: ztunnel lets go and the probe set forgets it.
	if err := cs.CoreV1().Pods("legacy").Delete(ctx, "batch", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindDel, string(batch.UID), 10*time.Second)
	eventually(t, "legacy/batch's probe entry removed", func() bool { return !strings.Contains(hostNode.probeSet(t), string(batch.UID)) })
}
