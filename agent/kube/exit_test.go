package kube

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

func daemonSet(selector map[string]string, deleting bool) *appsv1.DaemonSet {
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "nftcni-node", Namespace: "kube-system"}}
	ds.Spec.Template.Spec.NodeSelector = selector
	if deleting {
		now := metav1.Now()
		ds.DeletionTimestamp = &now
	}
	return ds
}

func node(labels map[string]string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: labels}}
}

// The cases the real API server cannot easily produce (errors, a DaemonSet
// being deleted) run here; integration/exit_test.go runs the rest against a
// real kube-apiserver with the chart's RBAC.
func TestDecideExit(t *testing.T) {
	linux := map[string]string{"kubernetes.io/os": "linux"}
	gr := schema.GroupResource{Group: "apps", Resource: "daemonsets"}
	for _, tc := range []struct {
		name      string
		objs      []runtime.Object
		dsErr     error // returned by every DaemonSet GET
		nodeErr   error
		uninstall bool
		reason    string
		gets      int // DaemonSet GETs expected
	}{
		{name: "upgrade", objs: []runtime.Object{daemonSet(linux, false), node(linux)}, reason: "an upgrade or a restart", gets: 1},
		{name: "gone", objs: []runtime.Object{node(linux)}, uninstall: true, reason: "is gone", gets: 1},
		{name: "being deleted", objs: []runtime.Object{daemonSet(linux, true), node(linux)}, uninstall: true, reason: "being deleted", gets: 1},
		{name: "node no longer selected", objs: []runtime.Object{daemonSet(linux, false), node(map[string]string{"kubernetes.io/os": "windows"})}, uninstall: true, reason: "no longer selects node node-a", gets: 1},
		{name: "node gone", objs: []runtime.Object{daemonSet(linux, false)}, uninstall: true, reason: "node node-a is gone", gets: 1},
		{name: "rbac gone", dsErr: apierrors.NewForbidden(gr, "nftcni-node", errors.New("no RBAC")), uninstall: true, reason: "credentials went with the release", gets: 1},
		{name: "token gone", dsErr: apierrors.NewUnauthorized("token revoked"), uninstall: true, reason: "credentials went with the release", gets: 1},
		{name: "api unreachable", dsErr: errors.New("connection refused"), reason: "cannot tell an upgrade from an uninstall", gets: 3},
		{name: "node unreadable", objs: []runtime.Object{daemonSet(linux, false)}, nodeErr: apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "node-a", errors.New("no RBAC")), reason: "taken as still selected", gets: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := fake.NewClientset(tc.objs...)
			gets := 0
			c.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
				gets++
				return tc.dsErr != nil, nil, tc.dsErr
			})
			if tc.nodeErr != nil {
				c.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.nodeErr })
			}
			d := DecideExit(context.Background(), clientsetAPI{c}, "kube-system", "nftcni-node", "node-a", time.Millisecond)
			if d.Uninstall != tc.uninstall || !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("got uninstall=%v %q, want uninstall=%v and a reason with %q", d.Uninstall, d.Reason, tc.uninstall, tc.reason)
			}
			if gets != tc.gets {
				t.Errorf("%d DaemonSet GETs, want %d", gets, tc.gets)
			}
		})
	}
}

func TestDecideExitWithoutANamespaceKeeps(t *testing.T) {
	d := DecideExit(context.Background(), clientsetAPI{fake.NewClientset()}, "", "nftcni-node", "node-a", time.Millisecond)
	if d.Uninstall {
		t.Errorf("uninstall without knowing where to look: %q", d.Reason)
	}
}

// clientsetAPI is API on client-go's fake clientset, whose reactors give
// the tests their errors.
type clientsetAPI struct{ c kubernetes.Interface }

func (a clientsetAPI) ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	panic("not used by DecideExit")
}

func (a clientsetAPI) PatchPodStatus(ctx context.Context, namespace, name string, patch []byte) error {
	_, err := a.c.CoreV1().Pods(namespace).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	return err
}

func (a clientsetAPI) GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	return a.c.AppsV1().DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
}

func (a clientsetAPI) GetNode(ctx context.Context, name string) (*corev1.Node, error) {
	return a.c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
}

func (a clientsetAPI) PatchNode(ctx context.Context, name string, pt types.PatchType, patch []byte) error {
	_, err := a.c.CoreV1().Nodes().Patch(ctx, name, pt, patch, metav1.PatchOptions{})
	return err
}

func (a clientsetAPI) PatchNodeStatus(ctx context.Context, name string, pt types.PatchType, patch []byte) error {
	_, err := a.c.CoreV1().Nodes().Patch(ctx, name, pt, patch, metav1.PatchOptions{}, "status")
	return err
}

func (a clientsetAPI) DeletePod(ctx context.Context, namespace, name string, uid types.UID, rv string) error {
	return a.c.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}})
}
