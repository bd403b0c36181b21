// Package readiness tells the cluster when this node can take pods that
// must be in the mesh: it removes a taint from the agent's own node once
// the agent is ready, and publishes a node condition saying whether it is
// and why not.
//
// Istio's answer (the cni.istio.io/not-ready taint, removed by istiod once
// a pod labelled k8s-app=istio-cni-node is Ready) untaints on the agent's
// readiness alone, while ztunnel may still be missing (istio/istio#61490).
// Here the agent removes the taint itself and, by default, only once a
// ztunnel has connected and acked its snapshot, as Cilium's agent removes
// its own taint. The condition is what SIG Node's node-readiness-controller
// consumes: a NodeReadinessRule can require it instead of the taint.
package readiness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nftcni/nftcni/istio"
)

// Defaults: Istio's taint, and our condition.
const (
	DefaultTaint     = istio.NotReadyTaint + ":NoSchedule"
	DefaultCondition = "nftcni.io/NetworkReady"
)

// API is what the gate asks of the API server (package kube implements it).
type API interface {
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
	PatchNode(ctx context.Context, name string, pt types.PatchType, patch []byte) error
	PatchNodeStatus(ctx context.Context, name string, pt types.PatchType, patch []byte) error
}

// Check is one part of the agent that must be ready; a non-nil error says
// what is missing.
type Check struct {
	Name  string
	Ready func() error
}

// Config says what the gate does.
type Config struct {
	Node string
	// Taint is "key:Effect" (or "key=value:Effect"); "" leaves taints alone.
	Taint string
	// Condition is the node condition type written; "" writes none.
	Condition string
	// Retaint puts the taint back when the agent stays unready for Grace
	// (continuous mode); off, the taint is only ever removed.
	Retaint bool
	Grace   time.Duration
	// Every is how often readiness is evaluated (default 1 s).
	Every time.Duration
}

// ParseTaint reads "key[=value]:Effect".
func ParseTaint(s string) (*corev1.Taint, error) {
	kv, effect, ok := strings.Cut(s, ":")
	if !ok || kv == "" {
		return nil, fmt.Errorf("taint %q: want key[=value]:Effect", s)
	}
	t := &corev1.Taint{Effect: corev1.TaintEffect(effect)}
	t.Key, t.Value, _ = strings.Cut(kv, "=")
	switch t.Effect {
	case corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule, corev1.TaintEffectNoExecute:
	default:
		return nil, fmt.Errorf("taint %q: effect %q is not NoSchedule, PreferNoSchedule or NoExecute", s, effect)
	}
	return t, nil
}

// Gate evaluates the checks and acts on the node.
type Gate struct {
	cfg    Config
	taint  *corev1.Taint
	api    API
	checks []Check
	log    *slog.Logger
}

// New returns a gate; it does nothing until Run.
func New(cfg Config, api API, checks []Check, log *slog.Logger) (*Gate, error) {
	g := &Gate{cfg: cfg, api: api, checks: checks, log: log}
	if cfg.Taint != "" {
		t, err := ParseTaint(cfg.Taint)
		if err != nil {
			return nil, err
		}
		g.taint = t
	}
	if g.cfg.Every <= 0 {
		g.cfg.Every = time.Second
	}
	return g, nil
}

// state is the outcome of one evaluation.
func (g *Gate) state() (ready bool, why string) {
	var missing []string
	for _, c := range g.checks {
		if err := c.Ready(); err != nil {
			missing = append(missing, c.Name+": "+err.Error())
		}
	}
	if len(missing) == 0 {
		return true, "the agent is ready: " + g.names()
	}
	return false, strings.Join(missing, "; ")
}

func (g *Gate) names() string {
	var n []string
	for _, c := range g.checks {
		n = append(n, c.Name)
	}
	return strings.Join(n, ", ")
}

// Run evaluates readiness every interval until ctx ends: the condition is
// written when readiness changes (and at start), the taint removed when
// ready and, with Retaint, put back after Grace unready. API errors are
// retried on the next evaluation.
func (g *Gate) Run(ctx context.Context) {
	t := time.NewTicker(g.cfg.Every)
	defer t.Stop()
	var written *bool // the condition status last written
	var lastWhy string
	var since time.Time // when the condition's status last changed
	var lastErr string  // API errors are logged when they change, not every second
	warn := func(msg string, err error, args ...any) {
		if err.Error() != lastErr {
			lastErr = err.Error()
			g.log.Warn(msg, append(args, "err", err)...)
		}
	}
	unreadySince := time.Now()
	for {
		ready, why := g.state()
		if ready {
			unreadySince = time.Time{}
		} else if unreadySince.IsZero() {
			unreadySince = time.Now()
		}
		if g.cfg.Condition != "" && (written == nil || *written != ready || (!ready && why != lastWhy)) {
			if written == nil || *written != ready {
				since = time.Now()
			}
			if err := g.writeCondition(ctx, ready, why, since); err != nil {
				warn("could not write the node condition; retrying", err, "node", g.cfg.Node, "condition", g.cfg.Condition)
			} else {
				written, lastWhy = &ready, why
				g.log.Info("node condition written", "node", g.cfg.Node, "condition", g.cfg.Condition, "ready", ready, "why", why)
			}
		}
		if g.taint != nil {
			want := !ready && g.cfg.Retaint && !unreadySince.IsZero() && time.Since(unreadySince) >= g.cfg.Grace
			if ready || want {
				if changed, err := g.setTaint(ctx, want); err != nil {
					warn("could not update the node's taint; retrying", err, "node", g.cfg.Node, "taint", g.cfg.Taint)
				} else if changed && want {
					g.log.Warn("agent unready past the grace period: node tainted again", "node", g.cfg.Node, "taint", g.cfg.Taint, "why", why, "grace", g.cfg.Grace)
				} else if changed {
					g.log.Info("agent ready: node untainted", "node", g.cfg.Node, "taint", g.cfg.Taint)
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// setTaint makes the node carry the taint (on) or not, and says whether it
// had to change it. The change is a JSON patch guarded by the node's
// resourceVersion, so a concurrent edit of the taints is never lost: it
// fails, and the next evaluation starts from the new state.
func (g *Gate) setTaint(ctx context.Context, on bool) (bool, error) {
	n, err := g.api.GetNode(ctx, g.cfg.Node)
	if err != nil {
		return false, err
	}
	match := func(t corev1.Taint) bool { return t.Key == g.taint.Key && t.Effect == g.taint.Effect }
	has := slices.ContainsFunc(n.Spec.Taints, match)
	if has == on {
		return false, nil
	}
	taints := slices.DeleteFunc(slices.Clone(n.Spec.Taints), match)
	if on {
		t := *g.taint
		now := metav1.Now()
		t.TimeAdded = &now
		taints = append(taints, t)
	}
	if taints == nil {
		taints = []corev1.Taint{}
	}
	patch, err := json.Marshal([]map[string]any{
		{"op": "test", "path": "/metadata/resourceVersion", "value": n.ResourceVersion},
		{"op": "add", "path": "/spec/taints", "value": taints}, // add replaces an existing member
	})
	if err != nil {
		return false, err
	}
	if err := g.api.PatchNode(ctx, g.cfg.Node, types.JSONPatchType, patch); err != nil {
		return false, err
	}
	return true, nil
}

// writeCondition merges the condition into the node's status.
func (g *Gate) writeCondition(ctx context.Context, ready bool, why string, since time.Time) error {
	status, reason := corev1.ConditionFalse, "AgentNotReady"
	if ready {
		status, reason = corev1.ConditionTrue, "AgentReady"
	}
	now := metav1.Now()
	c := corev1.NodeCondition{Type: corev1.NodeConditionType(g.cfg.Condition), Status: status, Reason: reason,
		Message: why, LastHeartbeatTime: now, LastTransitionTime: metav1.NewTime(since)}
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{c}}})
	if err != nil {
		return err
	}
	return g.api.PatchNodeStatus(ctx, g.cfg.Node, types.StrategicMergePatchType, patch)
}

// ErrNoZtunnel is the ztunnel check's answer while none is connected.
var ErrNoZtunnel = errors.New("no ztunnel connected with its snapshot acked")
