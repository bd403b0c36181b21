package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nftcni/nftcni/agent/install"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/readiness"
)

// Exit policies: what a stopping agent does with what it installed.
const (
	// ExitAuto asks Kubernetes: keep while the agent's DaemonSet still
	// selects the node (a restart or an upgrade), uninstall once it is gone.
	// Off Kubernetes, keep.
	ExitAuto      = "auto"
	ExitKeep      = "keep"
	ExitUninstall = "uninstall"
)

// CheckExit says whether s is an exit policy.
func CheckExit(s string) error {
	switch s {
	case ExitAuto, ExitKeep, ExitUninstall:
		return nil
	}
	return fmt.Errorf("--on-exit %q: want auto, keep or uninstall", s)
}

// Agent is the whole node agent: the enrolment side (Config), then the
// installer, the readiness gate, and the exit policy.
type Agent struct {
	Config
	Installer      *install.Installer
	InstallMetrics *install.Metrics
	// State is the install's validity, which /readyz serves.
	State *install.State
	// Gate is the readiness gate; it runs on Kubernetes when a taint or a
	// condition is set and NodeName is known. Gate.Node is filled in.
	Gate readiness.Config
	// GateNeedsZtunnel counts the agent ready only once a ztunnel has
	// acked its snapshot (when ZDS is served).
	GateNeedsZtunnel bool
	// OnExit is ExitAuto, ExitKeep or ExitUninstall; DaemonSet and
	// PodNamespace name the agent's DaemonSet for ExitAuto.
	OnExit                  string
	DaemonSet, PodNamespace string
}

// Run runs the agent until ctx ends: the enrolment side first, so the
// first pod after installation already finds it; then the readiness gate;
// then the installer, whose loop repairs the install until ctx ends; then
// the exit policy, which keeps everything (new pods wait for the next
// agent) or removes exactly what the agent added, config before binary.
func Run(ctx context.Context, a Agent) error {
	if err := CheckExit(a.OnExit); err != nil {
		return err
	}
	log := a.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n, err := Start(ctx, a.Config)
	if err != nil {
		return err
	}
	if err := a.startGate(ctx, n, log); err != nil {
		n.Stop()
		return err
	}
	runErr := a.Installer.Run(ctx, install.DefaultLoopConfig(), a.InstallMetrics, a.State)
	uninstall := a.OnExit == ExitUninstall
	if a.OnExit == ExitAuto {
		uninstall = a.decideExit(log)
	}
	if !uninstall {
		n.Stop()
		log.Info("shutting down: leaving the plugin and its config in place", "on-exit", a.OnExit)
		return runErr
	}
	log.Info("shutting down: uninstalling nftcni")
	if err := n.Host.Delete(); err != nil {
		runErr = errors.Join(runErr, fmt.Errorf("removing the host probe table: %w", err))
	}
	n.Stop()
	policyErr := os.Remove(a.PolicyPath())
	if errors.Is(policyErr, os.ErrNotExist) {
		policyErr = nil
	}
	return errors.Join(runErr, a.Installer.Uninstall(), policyErr)
}

// startGate runs the readiness gate on Kubernetes until ctx ends.
func (a *Agent) startGate(ctx context.Context, n *Node, log *slog.Logger) error {
	if a.Kube == nil || (a.Gate.Taint == "" && a.Gate.Condition == "") {
		return nil
	}
	if a.NodeName == "" {
		log.Warn("no --node-name (NODE_NAME): the readiness gate is off (no taint removed, no node condition)")
		return nil
	}
	checks := []readiness.Check{{Name: "install", Ready: a.State.Ready}}
	// Without ZDS (sidecar-only meshes) there is no ztunnel to wait for.
	if a.GateNeedsZtunnel && n.ZDS != nil {
		checks = append(checks, readiness.Check{Name: "ztunnel", Ready: func() error {
			if !n.ZDS.Connected() {
				return readiness.ErrNoZtunnel
			}
			return nil
		}})
	}
	cfg := a.Gate
	cfg.Node = a.NodeName
	g, err := readiness.New(cfg, a.Kube, checks, log)
	if err != nil {
		return fmt.Errorf("--readiness-taint: %w", err)
	}
	go g.Run(ctx)
	return nil
}

// decideExit asks Kubernetes whether this stop is an upgrade or an
// uninstall. The run context is over by now, so the lookup has its own
// deadline, well inside the pod's grace period.
func (a *Agent) decideExit(log *slog.Logger) bool {
	if a.Kube == nil {
		log.Info("on exit: not on Kubernetes, keeping the plugin (--on-exit uninstall removes it)")
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := kubesrc.DecideExit(ctx, a.Kube, a.PodNamespace, a.DaemonSet, a.NodeName, time.Second)
	log.Info("on exit", "uninstall", d.Uninstall, "reason", d.Reason)
	return d.Uninstall
}
