package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/plugin/wire"
)

// flagSet is a flag.FlagSet whose flags each have an environment twin in
// istio-cni's style (CNI_CONF_NAME for --cni-conf-name). A flag on the
// command line wins over its env var, which wins over the default.
type flagSet struct {
	*flag.FlagSet
	env map[string]string // flag name -> env var
}

func newFlagSet(name string) *flagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	return &flagSet{FlagSet: fs, env: map[string]string{}}
}

func (f *flagSet) str(p *string, name, env, def, usage string) {
	f.StringVar(p, name, def, usage+" [env "+env+"]")
	f.env[name] = env
}

func (f *flagSet) boolean(p *bool, name, env string, def bool, usage string) {
	f.BoolVar(p, name, def, usage+" [env "+env+"]")
	f.env[name] = env
}

func (f *flagSet) duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	f.DurationVar(p, name, def, usage+" [env "+env+"]")
	f.env[name] = env
}

func (f *flagSet) integer(p *int, name, env string, def int, usage string) {
	f.IntVar(p, name, def, usage+" [env "+env+"]")
	f.env[name] = env
}

func (f *flagSet) parse(args []string) error {
	for name, env := range f.env {
		if v, ok := os.LookupEnv(env); ok {
			if err := f.Set(name, v); err != nil {
				return fmt.Errorf("env %s=%q: %w", env, v, err)
			}
		}
	}
	return f.Parse(args)
}

// common holds the settings every command shares.
type common struct {
	confDir, binDirs, pluginBinary, confName, mode string
	runDir, stateDir, logLevel, logFormat          string
	pluginLogLevel                                 string
	excludeNamespaces, podNamespace                string
	standaloneCNIVersion, runtime                  string
	statusRequiresAgent                            bool
	agentWait                                      time.Duration
}

func (c *common) register(f *flagSet) {
	f.str(&c.confDir, "cni-conf-dir", "CNI_CONF_DIR", "/etc/cni/net.d", "host CNI config dir (as mounted in the agent)")
	f.str(&c.binDirs, "cni-bin-dir", "CNI_BIN_DIR", "/opt/cni/bin", "host CNI bin dir(s), comma-separated; the plugin is copied into each")
	f.str(&c.pluginBinary, "plugin-binary", "PLUGIN_BINARY", "", "nftcni plugin binary to install (default: nftcni beside this executable)")
	f.str(&c.confName, "cni-conf-name", "CNI_CONF_NAME", "", "chained/owned/dropin: primary config file to use (default: the first valid one, as runtimes pick it); standalone/owned: our file's name when it ends in .conflist and the mode writes one")
	f.str(&c.mode, "mode", "INSTALL_MODE", "chained", "chained | standalone | owned | dropin")
	f.str(&c.runtime, "container-runtime", "CONTAINER_RUNTIME", "", "the node's container runtime as Kubernetes reports it (containerd://2.4.2); empty: read from the Node when on Kubernetes. Drop-in mode refuses a runtime that reads no drop-ins (containerd before 2.1)")
	runDirFlag(f, &c.runDir)
	f.str(&c.stateDir, "state-dir", "CNI_AGENT_STATE_DIR", "", "persistent host dir for what must outlive a reboot: the policy snapshot the plugin falls back on until the agent is back (the chart sets /var/lib/nftcni); empty: the run dir, which a reboot empties")
	f.str(&c.logLevel, "log-level", "LOG_LEVEL", "info", "agent log level: debug | info | warn | error")
	f.str(&c.logFormat, "log-format", "LOG_FORMAT", "text", "agent log format: text | json")
	f.str(&c.pluginLogLevel, "plugin-log-level", "PLUGIN_LOG_LEVEL", "info", "plugin log level written into its conflist entry")
	f.str(&c.excludeNamespaces, "exclude-namespaces", "EXCLUDE_NAMESPACES", "kube-system", "comma-separated namespaces whose pods the plugin passes straight through")
	f.str(&c.podNamespace, "pod-namespace", "POD_NAMESPACE", "", "the agent's own namespace, so the plugin never blocks the agent's pod")
	f.str(&c.standaloneCNIVersion, "standalone-cni-version", "STANDALONE_CNI_VERSION", "1.0.0", "cniVersion of the list written in standalone mode")
	f.boolean(&c.statusRequiresAgent, "status-requires-agent", "STATUS_REQUIRES_AGENT", false, "make CNI STATUS fail while the agent is down (marks the node NetworkReady=false on containerd)")
	f.duration(&c.agentWait, "plugin-agent-wait", "PLUGIN_AGENT_WAIT", wire.DefaultAgentWait, "how long the plugin's ADD of a pod that must wait for the agent (one to enrol, a sidecar pod, no policy snapshot) waits for it, or for a ztunnel to connect to it, before failing, 0 to 90s (0: fails at once); written into its entry when not the default")
}

// Flags shared by commands that do not share the rest.

func runDirFlag(f *flagSet, p *string) {
	f.str(p, "run-dir", "CNI_AGENT_RUN_DIR", "/var/run/nftcni", "agent run dir: sockets and state the plugin finds through its conflist entry")
}

func hostNetnsFlag(f *flagSet, p *string) {
	f.str(p, "host-netns", "HOST_NETNS", "/proc/self/ns/net", "the host's network namespace, where the probe SNAT table lives")
}

func ipv6Flag(f *flagSet, p *bool) {
	f.boolean(p, "ambient-ipv6", "AMBIENT_IPV6", true, "add IPv6 rules for pods that have an IPv6 address")
}

// probeSNATFlags are istio-cni's HOST_PROBE_SNAT_IP and _IPV6.
type probeSNATFlags struct{ v4, v6 string }

func (p *probeSNATFlags) register(f *flagSet) {
	f.str(&p.v4, "host-probe-snat-ip", "HOST_PROBE_SNAT_IP", istio.ProbeSNATv4, "the IPv4 address kubelet's probes to enrolled pods are SNATed to, which pods let past ztunnel")
	f.str(&p.v6, "host-probe-snat-ipv6", "HOST_PROBE_SNAT_IPV6", istio.ProbeSNATv6, "the IPv6 address kubelet's probes to enrolled pods are SNATed to")
}

// parse checks the addresses; Istio's defaults stay the zero value, so
// the pods' recorded decisions do not change with them.
func (p *probeSNATFlags) parse() (capture.ProbeSNAT, error) {
	var out capture.ProbeSNAT
	for _, a := range []struct {
		name, v string
		v4      bool
		to      *netip.Addr
	}{{"--host-probe-snat-ip", p.v4, true, &out.V4}, {"--host-probe-snat-ipv6", p.v6, false, &out.V6}} {
		ip, err := netip.ParseAddr(strings.TrimSpace(a.v))
		if err != nil || ip.Is4() != a.v4 || ip.Zone() != "" {
			return out, fmt.Errorf("%s %q: want an IPv%s address", a.name, a.v, map[bool]string{true: "4", false: "6"}[a.v4])
		}
		if ip != out.Addr(a.v4) {
			*a.to = ip
		}
	}
	return out, nil
}

// policySnapshot is the snapshot's path when it lives in the state dir.
func (c *common) policySnapshot() string {
	if c.stateDir == "" {
		return ""
	}
	return filepath.Join(c.stateDir, wire.PolicyName)
}

func (c *common) bins() []string {
	var out []string
	for _, d := range strings.Split(c.binDirs, ",") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}

func (c *common) namespaces() []string {
	out := []string{}
	for _, n := range strings.Split(c.excludeNamespaces, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}

// plugin returns the plugin binary path, defaulting to nftcni beside us.
func (c *common) plugin() string {
	if c.pluginBinary != "" {
		return c.pluginBinary
	}
	exe, err := os.Executable()
	if err != nil {
		return "nftcni"
	}
	return filepath.Join(filepath.Dir(exe), "nftcni")
}

func (c *common) logger(w io.Writer) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch c.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", c.logFormat)
}
