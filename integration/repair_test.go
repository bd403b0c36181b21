package integration

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
)

// sidecarPod creates a sidecar pod on node-a whose istio-validation init
// container is in state st (as kubelet reports it), with restart policy rp.
func sidecarPod(t *testing.T, api *kubetest.Server, name string, rp corev1.RestartPolicy, st corev1.ContainerStatus) {
	t.Helper()
	ctx := context.Background()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "shop",
		Annotations: map[string]string{"sidecar.istio.io/status": `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}},
		Spec: corev1.PodSpec{NodeName: "node-a", RestartPolicy: rp,
			InitContainers: []corev1.Container{{Name: "istio-validation", Image: "proxyv2"}},
			Containers:     []corev1.Container{{Name: "app", Image: "app"}, {Name: "istio-proxy", Image: "proxyv2"}}}}
	p, err := api.Client.CoreV1().Pods("shop").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st.Name = "istio-validation"
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{st}
	if _, err := api.Client.CoreV1().Pods("shop").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func failed(code int32) *corev1.ContainerStateTerminated {
	return &corev1.ContainerStateTerminated{ExitCode: code, Reason: "Error"}
}

// Istio's repair on a real API server with the chart's RBAC, as the agent
// process runs it: sidecar pods whose capture check failed are deleted
// (deletePods) — crash-looping ones as Istio does, and one that will never
// run the check again (restartPolicy Never), which Istio misses — or
// labelled (labelPods); a pod whose check passed is left alone.
func TestRepairDeletesAndLabelsBrokenSidecarPods(t *testing.T) {
	for _, mode := range []string{"delete", "label"} {
		t.Run(mode, func(t *testing.T) {
			api := kubetest.Start(t)
			ctx := context.Background()
			if _, err := api.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			// The chart's RBAC as rendered with the mode's value (it grants
			// pods delete only with repair.deletePods).
			create := creator(t, api)
			value := map[string]string{"delete": "repair.deletePods=true", "label": "repair.labelPods=true"}[mode]
			for _, o := range objects(t, render(t, "", value)) {
				if slices.Contains([]string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}, o.GetKind()) {
					if err := create(o, metav1.CreateOptions{}); err != nil {
						t.Fatal(err)
					}
				}
			}
			sidecarPod(t, api, "looping", corev1.RestartPolicyAlways, corev1.ContainerStatus{
				State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
				LastTerminationState: corev1.ContainerState{Terminated: failed(126)}})
			sidecarPod(t, api, "job", corev1.RestartPolicyNever, corev1.ContainerStatus{State: corev1.ContainerState{Terminated: failed(126)}})
			sidecarPod(t, api, "healthy", corev1.RestartPolicyAlways, corev1.ContainerStatus{
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed"}}})

			h := newHost(t)
			_, _, alog := startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-a", "--readiness-taint", "", "--readiness-condition", "",
				"--repair-repair-pods=false", "--repair-"+mode+"-pods")
			get := func(name string) (*corev1.Pod, error) {
				return api.Client.CoreV1().Pods("shop").Get(ctx, name, metav1.GetOptions{})
			}
			defer func() {
				if t.Failed() {
					t.Logf("agent log:\n%s", alog)
				}
			}()
			for _, name := range []string{"looping", "job"} {
				eventually(t, mode+" of "+name, func() bool {
					p, err := get(name)
					if mode == "delete" { // no kubelet here to finish a bound pod's graceful deletion
						return apierrors.IsNotFound(err) || (err == nil && p.DeletionTimestamp != nil)
					}
					return err == nil && p.Labels["cni.istio.io/uninitialized"] == "true"
				})
			}
			p, err := get("healthy")
			if err != nil || p.DeletionTimestamp != nil || p.Labels["cni.istio.io/uninitialized"] != "" {
				t.Errorf("the healthy pod was repaired: %v %v", err, p.GetLabels())
			}
		})
	}
}

// Istio's default, repairPods: a running sidecar pod whose capture check
// crash-loops (it started before the CNI was ready) gets its ruleset in
// place, in its netns found through /proc, so its check passes when
// kubelet runs it again; the pod is neither deleted nor labelled.
func TestRepairProgramsABrokenSidecarPodInPlace(t *testing.T) {
	api := kubetest.Start(t)
	ctx := context.Background()
	if _, err := api.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createManifest(t, api, []string{"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
	pair := testnet.NewPair(t, 37)
	ann := map[string]string{"sidecar.istio.io/status": `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "early", Namespace: "shop", Annotations: ann},
		Spec: corev1.PodSpec{NodeName: "node-a",
			InitContainers: []corev1.Container{{Name: "istio-validation", Image: "proxyv2"}},
			Containers:     []corev1.Container{{Name: "app", Image: "app"}, {Name: "istio-proxy", Image: "proxyv2", Args: []string{"proxy", "sidecar"}}}}}
	p, err := api.Client.CoreV1().Pods("shop").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The API server gave the pod its UID: its process runs in the cgroup
	// path a runtime gives it.
	testnet.PodProcess(t, pair.Pod, string(p.UID))
	p.Status.PodIP, p.Status.PodIPs = pair.PodIP4.String(), []corev1.PodIP{{IP: pair.PodIP4.String()}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "istio-validation",
		State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
		LastTerminationState: corev1.ContainerState{Terminated: failed(126)}}}
	if _, err := api.Client.CoreV1().Pods("shop").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h := newHost(t)
	_, _, alog := startAgent(t, h, "--kubeconfig", api.AgentKubeconfig, "--node-name", "node-a", "--readiness-taint", "", "--readiness-condition", "")
	spec, err := capture.ParseSidecar(ann, capture.SidecarProxy{UID: 1337, GID: 1337})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the sidecar ruleset in the pod's netns", func() bool { return nft.Verify(pair.Pod.FD, capture.Sidecar(spec)) == nil })
	got, err := api.Client.CoreV1().Pods("shop").Get(ctx, "early", metav1.GetOptions{})
	if err != nil || got.DeletionTimestamp != nil || got.Labels["cni.istio.io/uninitialized"] != "" {
		t.Errorf("repaired in place, yet deleted or labelled: %v %+v\n%s", err, got.GetLabels(), alog)
	}
}
