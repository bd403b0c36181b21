package plugin

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/nftcni/nftcni/plugin/wire"
)

// DefaultRunDir is where the agent's socket and policy snapshot live when
// the conflist entry does not say.
const DefaultRunDir = "/var/run/nftcni"

// AgentPodPrefix starts the names of the agent's own DaemonSet pods, which
// always pass straight through: they must start when no agent is running.
const AgentPodPrefix = "nftcni-node-"

// Config is our entry in the conflist, as the runtime hands it to us.
type Config struct {
	CNIVersion string `json:"cniVersion"`
	Name       string `json:"name"`
	// PrevResult is the primary plugins' result. It is handed back as it
	// came, byte for byte: it is already in the config's cniVersion, so
	// "unchanged" needs no conversion, and only the pod's addresses are
	// read from it (prevResult).
	PrevResult json.RawMessage `json:"prevResult,omitempty"`
	// ValidAttachments: GC (CNI 1.1), the attachments the runtime keeps.
	ValidAttachments []wire.Attachment `json:"cni.dev/valid-attachments,omitempty"`

	LogLevel            string   `json:"plugin_log_level"`
	RunDir              string   `json:"cni_agent_run_dir"`
	ExcludeNamespaces   []string `json:"exclude_namespaces"`
	PodNamespace        string   `json:"pod_namespace"`
	StatusRequiresAgent bool     `json:"status_requires_agent"`
	RuntimeConfig       struct {
		// PodAnnotations is filled by containerd and CRI-O when the entry
		// declares the io.kubernetes.cri.pod-annotations capability.
		PodAnnotations map[string]string `json:"io.kubernetes.cri.pod-annotations,omitempty"`
	} `json:"runtimeConfig"`

	level slog.Level
	prev  *result
}

// ParseConfig reads the plugin's stdin. Errors name the field at fault.
func ParseConfig(stdin []byte) (*Config, error) {
	c := &Config{}
	if err := json.Unmarshal(stdin, c); err != nil {
		return nil, fmt.Errorf("parsing network config: %w", err)
	}
	if len(c.PrevResult) > 0 && string(c.PrevResult) != "null" {
		c.prev = &result{}
		if err := json.Unmarshal(c.PrevResult, c.prev); err != nil {
			return nil, fmt.Errorf("parsing prevResult: %w", err)
		}
	}
	if c.RunDir == "" {
		c.RunDir = DefaultRunDir
	}
	if !filepath.IsAbs(c.RunDir) {
		return nil, fmt.Errorf("cni_agent_run_dir %q must be an absolute path", c.RunDir)
	}
	c.RunDir = filepath.Clean(c.RunDir)
	switch strings.ToLower(c.LogLevel) {
	case "debug":
		c.level = slog.LevelDebug
	case "", "info":
		c.level = slog.LevelInfo
	case "warn", "warning":
		c.level = slog.LevelWarn
	case "error":
		c.level = slog.LevelError
	default:
		return nil, fmt.Errorf("plugin_log_level %q: want debug, info, warn or error", c.LogLevel)
	}
	return c, nil
}

// SocketPath is the agent's event socket.
func (c *Config) SocketPath() string { return filepath.Join(c.RunDir, wire.SocketName) }

// PolicyPath is the agent's policy snapshot.
func (c *Config) PolicyPath() string { return filepath.Join(c.RunDir, wire.PolicyName) }

// result is the part of a CNI result (0.3.0 and later) the plugin reads.
type result struct {
	Interfaces []struct {
		Name string `json:"name"`
	} `json:"interfaces"`
	IPs []struct {
		Address   string `json:"address"`
		Interface *int   `json:"interface"`
	} `json:"ips"`
}

// prevResult is prevResult as parsed (nil if absent).
func (c *Config) prevResult() (*result, error) { return c.prev, nil }

// K8sArgs are the CNI_ARGS that kubelet-era runtimes pass.
type K8sArgs struct {
	types.CommonArgs
	K8S_POD_NAME               types.UnmarshallableString
	K8S_POD_NAMESPACE          types.UnmarshallableString
	K8S_POD_UID                types.UnmarshallableString
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
}

// parseK8sArgs reads CNI_ARGS, ignoring keys we do not know.
func parseK8sArgs(s string) (*K8sArgs, error) {
	a := &K8sArgs{}
	a.IgnoreUnknown = true
	if err := types.LoadArgs(s, a); err != nil {
		return nil, fmt.Errorf("parsing CNI_ARGS: %w", err)
	}
	return a, nil
}

// podIPs lists the addresses prevResult gives the sandbox interface ifname
// (or no interface at all, as some IPAMs report them).
func podIPs(r *result, ifname string) []netip.Prefix {
	if r == nil {
		return nil
	}
	var out []netip.Prefix
	for _, ip := range r.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i < 0 || i >= len(r.Interfaces) || r.Interfaces[i].Name != ifname {
				continue
			}
		}
		p, err := netip.ParsePrefix(ip.Address)
		if err != nil {
			continue
		}
		out = append(out, netip.PrefixFrom(p.Addr().Unmap(), p.Bits()))
	}
	return out
}
