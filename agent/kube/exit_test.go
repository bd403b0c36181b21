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
	"k8s.io/apimachinery/pkg/runtime/schema"
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
		ds        *appsv1.DaemonSet
		node      *corev1.Node
		dsErr     error // returned by every DaemonSet GET
		nodeErr   error
		uninstall bool
		reason    string
		gets      int // DaemonSet GETs expected
	}{
		{name: "upgrade", ds: daemonSet(linux, false), node: node(linux), reason: "an upgrade or a restart", gets: 1},
		{name: "gone", node: node(linux), uninstall: true, reason: "is gone", gets: 1},
		{name: "being deleted", ds: daemonSet(linux, true), node: node(linux), uninstall: true, reason: "being deleted", gets: 1},
		{name: "node no longer selected", ds: daemonSet(linux, false), node: node(map[string]string{"kubernetes.io/os": "windows"}), uninstall: true, reason: "no longer selects node node-a", gets: 1},
		{name: "node gone", ds: daemonSet(linux, false), uninstall: true, reason: "node node-a is gone", gets: 1},
		{name: "rbac gone", dsErr: apierrors.NewForbidden(gr, "nftcni-node", errors.New("no RBAC")), uninstall: true, reason: "credentials went with the release", gets: 1},
		{name: "token gone", dsErr: apierrors.NewUnauthorized("token revoked"), uninstall: true, reason: "credentials went with the release", gets: 1},
		{name: "api unreachable", dsErr: errors.New("connection refused"), reason: "cannot tell an upgrade from an uninstall", gets: 3},
		{name: "node unreadable", ds: daemonSet(linux, false), nodeErr: apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "node-a", errors.New("no RBAC")), reason: "taken as still selected", gets: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &exitAPI{ds: tc.ds, node: tc.node, dsErr: tc.dsErr, nodeErr: tc.nodeErr}
			d := DecideExit(context.Background(), a, "kube-system", "nftcni-node", "node-a", time.Millisecond)
			if d.Uninstall != tc.uninstall || !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("got uninstall=%v %q, want uninstall=%v and a reason with %q", d.Uninstall, d.Reason, tc.uninstall, tc.reason)
			}
			if a.gets != tc.gets {
				t.Errorf("%d DaemonSet GETs, want %d", a.gets, tc.gets)
			}
		})
	}
}

func TestDecideExitWithoutANamespaceKeeps(t *testing.T) {
	d := DecideExit(context.Background(), &exitAPI{}, "", "nftcni-node", "node-a", time.Millisecond)
	if d.Uninstall {
		t.Errorf("uninstall without knowing where to look: %q", d.Reason)
	}
}

// exitAPI is the two reads DecideExit makes, answered as the API server
// answers them (NotFound for what is absent) or with a given error.
// client-go's typed fake clientset would do too, at minutes of a cold
// build for every API group it registers.
type exitAPI struct {
	API            // the rest: DecideExit calls none of it
	ds             *appsv1.DaemonSet
	node           *corev1.Node
	dsErr, nodeErr error
	gets           int
}

func (a *exitAPI) GetDaemonSet(_ context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	a.gets++
	switch {
	case a.dsErr != nil:
		return nil, a.dsErr
	case a.ds == nil || a.ds.Namespace != namespace || a.ds.Name != name:
		return nil, apierrors.NewNotFound(schema.GroupResource{Group: "apps", Resource: "daemonsets"}, name)
	}
	return a.ds.DeepCopy(), nil
}

func (a *exitAPI) GetNode(_ context.Context, name string) (*corev1.Node, error) {
	switch {
	case a.nodeErr != nil:
		return nil, a.nodeErr
	case a.node == nil || a.node.Name != name:
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "nodes"}, name)
	}
	return a.node.DeepCopy(), nil
}
