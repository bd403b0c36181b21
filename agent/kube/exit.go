package kube

import (
	"context"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
)

// ExitDecision is what a stopping agent does with the plugin it installed.
type ExitDecision struct {
	Uninstall bool
	Reason    string
}

// DecideExit tells an upgrade or a restart from an uninstall, as istio-cni's
// safe upgrade does. While our DaemonSet exists, is not being deleted and
// still selects this node, another agent is coming: everything stays, so new
// pods wait for it instead of starting outside the mesh. When the DaemonSet
// is gone, being deleted, no longer selects the node, or our credentials went
// with the release (Helm deletes the RBAC right after the DaemonSet, usually
// before its pods have stopped), nothing will serve the plugin again: the
// agent removes itself, so pods do not fail on a plugin nobody answers.
//
// When the API cannot say (unreachable after retries), the plugin stays:
// a node that keeps a dormant entry is repaired by `nftcni-agent uninstall`,
// while one that drops it during an upgrade starts pods uncaptured.
func DecideExit(ctx context.Context, c API, namespace, daemonSet, node string, retry time.Duration) ExitDecision {
	if namespace == "" || daemonSet == "" {
		return ExitDecision{Reason: "no POD_NAMESPACE or DaemonSet name to look up: keeping the plugin"}
	}
	ref := namespace + "/" + daemonSet
	get := func() (*appsv1.DaemonSet, error) {
		return c.GetDaemonSet(ctx, namespace, daemonSet)
	}
	ds, err := get()
	for attempt := 1; attempt < 3 && err != nil && !decisive(err) && ctx.Err() == nil; attempt++ {
		select {
		case <-ctx.Done():
		case <-time.After(retry):
		}
		ds, err = get()
	}
	switch {
	case apierrors.IsNotFound(err):
		return ExitDecision{true, fmt.Sprintf("DaemonSet %s is gone: uninstalled", ref)}
	case apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err):
		return ExitDecision{true, fmt.Sprintf("the agent may no longer read DaemonSet %s (%v): its credentials went with the release", ref, err)}
	case err != nil:
		return ExitDecision{false, fmt.Sprintf("cannot tell an upgrade from an uninstall (DaemonSet %s: %v): keeping the plugin; `nftcni-agent uninstall` removes it", ref, err)}
	case ds.DeletionTimestamp != nil:
		return ExitDecision{true, fmt.Sprintf("DaemonSet %s is being deleted", ref)}
	}
	n, err := c.GetNode(ctx, node)
	switch {
	case apierrors.IsNotFound(err):
		return ExitDecision{true, fmt.Sprintf("node %s is gone from the cluster", node)}
	case err != nil:
		return ExitDecision{false, fmt.Sprintf("DaemonSet %s is present; node %s unreadable (%v), so taken as still selected: keeping the plugin", ref, node, err)}
	}
	match, err := nodeaffinity.GetRequiredNodeAffinity(&corev1.Pod{Spec: ds.Spec.Template.Spec}).Match(n)
	switch {
	case err != nil:
		return ExitDecision{false, fmt.Sprintf("DaemonSet %s is present; its node affinity does not parse (%v): keeping the plugin", ref, err)}
	case !match:
		return ExitDecision{true, fmt.Sprintf("DaemonSet %s no longer selects node %s", ref, node)}
	}
	return ExitDecision{false, fmt.Sprintf("DaemonSet %s is present and selects node %s: an upgrade or a restart", ref, node)}
}

// decisive errors are answers, not failures to get one: no retry.
func decisive(err error) bool {
	return apierrors.IsNotFound(err) || apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err)
}
