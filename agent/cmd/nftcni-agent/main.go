// Command nftcni-agent is the node agent: it installs the nftcni plugin and
// its CNI config and keeps them repaired, serves enrolment decisions to the
// plugin, watches pods, and hands enrolled pods' netns to ztunnel.
//
//	nftcni-agent install --once   install and exit
//	nftcni-agent uninstall        remove everything nftcni added
//	nftcni-agent run              install, then watch and repair until stopped
//	nftcni-agent inspect POD      live ruleset, drift, enrolment and ztunnel state of a pod
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/nftcni/nftcni/agent/health"
	"github.com/nftcni/nftcni/agent/inspect"
	"github.com/nftcni/nftcni/agent/install"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/readiness"
	"github.com/nftcni/nftcni/agent/runlock"
	"github.com/nftcni/nftcni/plugin/wire"
	"github.com/nftcni/nftcni/templates"
)

const usage = `usage: nftcni-agent <command> [flags]

commands:
  run        install the plugin and its CNI config, then watch and repair them
  install    install once (with --once) and exit
  uninstall  remove the plugin entry, our files and the plugin binary
  inspect    show a pod's (or the host's) live ruleset, whether it drifted, its enrolment and ztunnel state
  version    print the version

Run "nftcni-agent <command> -h" for the flags; each has an env var twin.
`

var version = "dev"

func main() {
	// A node agent is mostly idle and runs on every node: trade a little GC
	// CPU for a smaller heap unless the operator chose (GOGC in the env).
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(50)
	}
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "run":
		err = runCmd(ctx, args)
	case "install":
		err = installCmd(ctx, args)
	case "uninstall":
		err = uninstallCmd(args)
	case "inspect":
		err = inspectCmd(args, os.Stdout)
		if errors.Is(err, inspect.ErrDrift) {
			os.Exit(1)
		}
		if err != nil && !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "nftcni-agent inspect:", err)
			os.Exit(2)
		}
	case "reference": // the configuration reference in Markdown (make docs)
		writeReference(os.Stdout)
	case "version", "--version":
		fmt.Println("nftcni-agent", version)
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nftcni-agent:", err)
		os.Exit(1)
	}
}

// pluginValues are the plugin's settings in its entry, from the flags.
func (c *common) pluginValues() (templates.Values, error) {
	vals := templates.Values{
		LogLevel:            c.pluginLogLevel,
		AgentRunDir:         c.runDir,
		ExcludeNamespaces:   c.namespaces(),
		PodNamespace:        c.podNamespace,
		StatusRequiresAgent: c.statusRequiresAgent,
		PolicySnapshot:      c.policySnapshot(),
	}
	if c.agentWait < 0 || c.agentWait > wire.MaxAgentWait {
		return vals, fmt.Errorf("--plugin-agent-wait %v: want 0 to %v", c.agentWait, wire.MaxAgentWait)
	}
	if c.agentWait != wire.DefaultAgentWait { // the default needs no field: older plugins read none
		s := c.agentWait.Seconds()
		vals.AgentWaitSeconds = &s
	}
	return vals, nil
}

// newInstaller renders our config from the flags and builds the installer.
func newInstaller(c *common, log *slog.Logger, needBinary bool) (*install.Installer, error) {
	mode, err := install.ParseMode(c.mode)
	if err != nil {
		return nil, err
	}
	vals, err := c.pluginValues()
	if err != nil {
		return nil, err
	}
	entry, err := templates.PluginEntry(vals)
	if err != nil {
		return nil, err
	}
	cfg := install.Config{
		ConfDir: c.confDir, BinDirs: c.bins(), ConfName: c.confName,
		Mode: mode, Entry: entry, Runtime: c.runtime, Log: log,
	}
	if mode == install.Standalone {
		if cfg.Standalone, err = templates.Standalone(vals, c.standaloneCNIVersion, "nftcni"); err != nil {
			return nil, err
		}
	}
	if needBinary {
		cfg.PluginBinary = c.plugin()
	}
	return install.New(cfg)
}

// setup parses a command's flags (the common ones plus extra) and builds
// the logger and the installer.
func setup(name string, args []string, needBinary bool, extra func(*flagSet)) (*common, *slog.Logger, *install.Installer, error) {
	c := &common{}
	f := newFlagSet(name)
	c.register(f)
	if extra != nil {
		extra(f)
	}
	if err := f.parse(args); err != nil {
		return nil, nil, nil, err
	}
	log, err := c.logger(os.Stderr)
	if err != nil {
		return nil, nil, nil, err
	}
	in, err := newInstaller(c, log, needBinary)
	return c, log, in, err
}

func onceFlag(f *flagSet, p *bool) {
	f.boolean(p, "once", "INSTALL_ONCE", false, "install once and exit instead of watching")
}

func installCmd(ctx context.Context, args []string) error {
	var once bool
	c, log, in, err := setup("install", args, true, func(f *flagSet) { onceFlag(f, &once) })
	if err != nil {
		return err
	}
	if !once {
		return in.Run(ctx, install.DefaultLoopConfig(), nil, nil)
	}
	if err := in.RemoveOtherModes(); err != nil {
		log.Warn("could not remove config left by another install mode", "err", err)
	}
	res, err := in.Install()
	for _, sk := range res.Skipped {
		log.Warn("SKIPPING invalid CNI config: containerd fails its whole CNI config load on a file like this", "path", sk.Path, "err", sk.Err)
	}
	if err != nil {
		return err
	}
	log.Info("installed", "mode", c.mode, "config", res.Config, "primary", res.Primary, "wrote", len(res.Wrote))
	return nil
}

func uninstallCmd(args []string) error {
	_, _, in, err := setup("uninstall", args, false, nil)
	if err != nil {
		return err
	}
	return in.Uninstall()
}

// runFlags are run's own flags, beside the common ones.
type runFlags struct {
	healthAddr, monitoringPort, onExit, daemonSet string
	a                                             ambientFlags
	gate                                          gateFlags
}

// gateFlags configure the readiness gate (package readiness), on Kubernetes.
type gateFlags struct {
	taint, condition string
	needZtunnel      bool
	retaint          bool
	grace            time.Duration
}

func (r *runFlags) register(f *flagSet) {
	f.str(&r.healthAddr, "health-addr", "HEALTH_ADDR", ":8000", "address for /healthz and /readyz")
	f.str(&r.monitoringPort, "monitoring-port", "MONITORING_PORT", "15014", "port for Prometheus /metrics; 0 or less disables it")
	f.str(&r.onExit, "on-exit", "ON_EXIT", "auto", "what to do with the installed plugin on shutdown: auto (on Kubernetes: keep while the agent's DaemonSet still selects this node, an upgrade or restart; uninstall once it is gone; elsewhere: keep) | keep | uninstall")
	f.str(&r.daemonSet, "daemonset-name", "DAEMONSET_NAME", "nftcni-node", "the agent's DaemonSet in POD_NAMESPACE, looked up by --on-exit auto")
	r.a.register(f)
	f.str(&r.gate.taint, "readiness-taint", "READINESS_TAINT", readiness.DefaultTaint, "taint (key[=value]:Effect) the agent removes from its node once it is ready; \"\" leaves taints alone. The default is Istio's, which nodes may be created with so that pods wait for the mesh CNI")
	f.str(&r.gate.condition, "readiness-condition", "READINESS_CONDITION", readiness.DefaultCondition, "node condition type the agent keeps True while it is ready and False with the reason otherwise (for SIG Node's node-readiness-controller); \"\" writes none")
	f.boolean(&r.gate.needZtunnel, "readiness-requires-ztunnel", "READINESS_REQUIRES_ZTUNNEL", true, "count the agent ready only once a ztunnel has connected and acked its snapshot")
	f.boolean(&r.gate.retaint, "readiness-retaint", "READINESS_RETAINT", false, "taint the node again when the agent stays unready for --readiness-grace (continuous mode)")
	f.duration(&r.gate.grace, "readiness-grace", "READINESS_GRACE", 30*time.Second, "how long the agent may stay unready before --readiness-retaint taints the node again")
}

func runCmd(ctx context.Context, args []string) error {
	var r runFlags
	c, log, in, err := setup("run", args, true, r.register)
	if err != nil {
		return err
	}
	healthAddr, monitoringPort, onExit, a := r.healthAddr, r.monitoringPort, r.onExit, &r.a
	if err := node.CheckExit(onExit); err != nil {
		return err
	}
	policy, err := a.policy(c.namespaces())
	if err != nil {
		return err
	}
	// One agent per run dir, before anything is touched: a second one would
	// replace the live sockets (ztunnel staying with the first) and remove
	// them when it stops.
	lock, err := runlock.Acquire(c.runDir)
	if err != nil {
		return err
	}
	defer lock.Release()
	log.Info("nftcni-agent starting", "version", version, "mode", c.mode, "cni-conf-dir", c.confDir,
		"cni-bin-dir", c.bins(), "plugin-binary", c.plugin(), "run-dir", c.runDir, "on-exit", onExit)
	selectors := "Istio's defaults (istio.io/dataplane-mode=ambient on pod or namespace)"
	if a.selectors != "" {
		selectors = a.selectors
	}
	log.Info("enrolment policy", "selectors", selectors, "exclude-namespaces", c.namespaces(),
		"system-namespace", a.systemNamespace, "dns-capture", a.dnsCapture, "ipv6", a.ipv6,
		"status-requires-agent", c.statusRequiresAgent)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := install.NewMetrics(reg)
	state := &install.State{}
	addr, err := health.Serve(ctx, healthAddr, health.Handler(state.Ready), log)
	if err != nil {
		return fmt.Errorf("health server on %s: %w", healthAddr, err)
	}
	log.Info("serving /healthz and /readyz", "addr", addr.String())
	if port, err := strconv.Atoi(monitoringPort); err != nil {
		return fmt.Errorf("--monitoring-port %q: %w", monitoringPort, err)
	} else if port > 0 {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		maddr, err := health.Serve(ctx, ":"+monitoringPort, mux, log)
		if err != nil {
			return fmt.Errorf("metrics server on :%s: %w", monitoringPort, err)
		}
		log.Info("serving Prometheus /metrics", "addr", maddr.String())
	}

	cfg, err := nodeConfig(c, a, policy, lock, reg, log)
	if err != nil {
		return err
	}
	if in.Mode() == install.DropIn && c.runtime == "" && cfg.Kube != nil && cfg.NodeName != "" {
		learnRuntime(ctx, in, cfg.Kube, cfg.NodeName, log)
	}
	return node.Run(ctx, node.Agent{Config: cfg, Installer: in, InstallMetrics: metrics, State: state,
		Gate:             readiness.Config{Taint: r.gate.taint, Condition: r.gate.condition, Retaint: r.gate.retaint, Grace: r.gate.grace},
		GateNeedsZtunnel: r.gate.needZtunnel, OnExit: onExit, DaemonSet: r.daemonSet, PodNamespace: c.podNamespace})
}

// learnRuntime tells the installer the node's container runtime as the
// kubelet reported it, so that drop-in mode is refused where the runtime
// would never read the drop-in. Without it, the mode goes ahead.
func learnRuntime(ctx context.Context, in *install.Installer, kc kubesrc.API, nodeName string, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := kc.GetNode(ctx, nodeName)
	if err != nil {
		log.Warn("cannot read the node's container runtime; drop-in mode assumes it reads drop-ins (containerd 2.1 or later)", "node", nodeName, "err", err)
		return
	}
	rt := n.Status.NodeInfo.ContainerRuntimeVersion
	log.Info("container runtime", "node", nodeName, "runtime", rt)
	in.SetRuntime(rt)
}
