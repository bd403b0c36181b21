// Package repair is Istio's repair controller for sidecar pods, under
// Istio's flag names: a sidecar pod whose istio-validation init container
// failed (its traffic was not captured when it ran: the pod started before
// the CNI was ready on its node) is labelled or deleted, so that it is
// noticed or re-created with capture in place.
//
// Istio only matches an init container that crash-loops (the failure is in
// its last termination state), so a pod that never restarts it —
// restartPolicy Never, a Job's pod — stays broken forever
// (istio/istio#49210). Here a failed init container that its pod will not
// run again matches too.
package repair

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nftcni/nftcni/istio"
)

// Config is istio-cni's repair configuration, with its defaults.
type Config struct {
	Enabled bool
	// RepairPods programs the running pod's ruleset in place (its check
	// then passes when kubelet runs it again); a pod that will not run it
	// again is deleted or labelled instead.
	RepairPods bool
	DeletePods bool
	LabelPods  bool
	LabelKey   string
	LabelValue string
	// SidecarAnnotation: only pods carrying it are looked at.
	SidecarAnnotation  string
	InitContainerName  string
	InitTerminationMsg string // "" matches any message
	InitExitCode       int    // 0 matches any exit code
}

// DefaultConfig is istio-cni's (its ValidationErrorCode is 126).
func DefaultConfig() Config {
	return Config{Enabled: true, RepairPods: true, LabelKey: istio.LabelUninitialized, LabelValue: "true",
		SidecarAnnotation: istio.AnnSidecarStatus, InitContainerName: istio.ValidationContainer, InitExitCode: istio.ValidationErrorCode}
}

// API is what repairing asks of the API server (package kube implements it).
type API interface {
	PatchPodStatus(ctx context.Context, namespace, name string, patch []byte) error
	DeletePod(ctx context.Context, namespace, name string, uid types.UID, resourceVersion string) error
}

// Broken says whether pod's validation init container failed, and how.
func Broken(cfg Config, pod *corev1.Pod) (bool, string) {
	broken, why, _ := broken(cfg, pod)
	return broken, why
}

// broken is Broken, also saying whether the pod will run the check again.
func broken(cfg Config, pod *corev1.Pod) (bool, string, bool) {
	if cfg.SidecarAnnotation != "" {
		if _, ok := pod.Annotations[cfg.SidecarAnnotation]; !ok {
			return false, "", false
		}
	}
	matches := func(t *corev1.ContainerStateTerminated) bool {
		msg := strings.TrimSpace(cfg.InitTerminationMsg)
		return t != nil && t.ExitCode != 0 && (cfg.InitExitCode == 0 || int(t.ExitCode) == cfg.InitExitCode) &&
			(msg == "" || msg == strings.TrimSpace(t.Message))
	}
	for _, c := range pod.Status.InitContainerStatuses {
		if cfg.InitContainerName != "" && c.Name != cfg.InitContainerName {
			continue
		}
		if t := c.State.Terminated; t != nil && (t.Reason == "Completed" || t.ExitCode == 0) {
			continue // it passed now: never broken
		}
		if matches(c.LastTerminationState.Terminated) {
			return true, fmt.Sprintf("init container %s keeps failing (exit code %d)", c.Name, c.LastTerminationState.Terminated.ExitCode), true
		}
		// The case Istio misses: failed, and the pod will not run it again.
		if matches(c.State.Terminated) && pod.Spec.RestartPolicy == corev1.RestartPolicyNever {
			return true, fmt.Sprintf("init container %s failed (exit code %d) and restartPolicy Never will not run it again", c.Name, c.State.Terminated.ExitCode), false
		}
	}
	return false, "", false
}

// InPlace programs a running pod's ruleset (package enrol's RepairSidecar).
type InPlace func(ctx context.Context, pod *corev1.Pod) error

// Repairer acts on broken pods.
type Repairer struct {
	cfg     Config
	api     API
	inPlace InPlace
	log     *slog.Logger
}

// New returns a Repairer; with cfg.Enabled false it does nothing.
func New(cfg Config, api API, inPlace InPlace, log *slog.Logger) *Repairer {
	return &Repairer{cfg: cfg, api: api, inPlace: inPlace, log: log}
}

// Reconcile repairs pod when it is broken: in place (RepairPods) when it
// will run its check again, else by deleting (DeletePods) or labelling it
// (LabelPods), in Istio's order.
func (r *Repairer) Reconcile(ctx context.Context, pod *corev1.Pod) error {
	if r == nil || !r.cfg.Enabled || pod == nil || pod.DeletionTimestamp != nil {
		return nil
	}
	broken, why, retried := broken(r.cfg, pod)
	if !broken {
		return nil
	}
	key := pod.Namespace + "/" + pod.Name
	switch {
	case r.cfg.RepairPods && retried && r.inPlace != nil:
		if err := r.inPlace(ctx, pod); err != nil {
			return fmt.Errorf("repairing pod %s in place: %w", key, err)
		}
		r.log.Warn("programmed the ruleset of a running pod whose traffic capture check failed; the check passes when kubelet runs it again", "pod", key, "why", why)
	case r.cfg.DeletePods:
		// Preconditions: the pod judged broken, not a newer one by its name.
		if err := r.api.DeletePod(ctx, pod.Namespace, pod.Name, pod.UID, pod.ResourceVersion); err != nil {
			return fmt.Errorf("deleting broken pod %s: %w", key, err)
		}
		r.log.Warn("deleted a pod whose traffic capture check failed, to be re-created with capture in place", "pod", key, "why", why)
	case r.cfg.LabelPods:
		if _, ok := pod.Labels[r.cfg.LabelKey]; ok {
			return nil
		}
		// On pods/status, as Istio does: the lower privilege can set labels.
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{r.cfg.LabelKey: r.cfg.LabelValue}}})
		if err != nil {
			return err
		}
		if err := r.api.PatchPodStatus(ctx, pod.Namespace, pod.Name, patch); err != nil {
			return fmt.Errorf("labelling broken pod %s: %w", key, err)
		}
		r.log.Warn("labelled a pod whose traffic capture check failed", "pod", key, "label", r.cfg.LabelKey+"="+r.cfg.LabelValue, "why", why)
	default:
		r.log.Warn("a pod's traffic capture check failed; repair.deletePods or repair.labelPods would act on it", "pod", key, "why", why)
	}
	return nil
}
