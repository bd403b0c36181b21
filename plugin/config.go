package plugin

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/plugin/wire"
)

// DefaultRunDir is where the agent's socket and policy snapshot live when
// the conflist entry does not say.
const DefaultRunDir = "/var/run/nftcni"

// AgentPodPrefix starts the names of the agent's own DaemonSet pods, which
// always pass straight through: they must start when no agent is running.
const AgentPodPrefix = "nftcni-node-"

// Config is our entry in the conflist, as the runtime hands it to us.
//
// It is read with gjson rather than encoding/json: the first use of
// encoding/json's reflection costs a freshly exec'd process about 25 page
// faults (0.2 ms here), on every pod's ADD. Types are checked all the same:
// a field of the wrong type is an error that names it.
type Config struct {
	CNIVersion string
	Name       string
	// PrevResult is the primary plugins' result. It is handed back as it
	// came, byte for byte: it is already in the config's cniVersion, so
	// "unchanged" needs no conversion, and only the pod's addresses are
	// read from it.
	PrevResult []byte
	// ValidAttachments: GC (CNI 1.1), the attachments the runtime keeps.
	ValidAttachments []wire.Attachment

	LogLevel            string   // plugin_log_level
	RunDir              string   // cni_agent_run_dir
	PolicySnapshot      string   // policy_snapshot: empty means <run dir>/policy.json
	ExcludeNamespaces   []string // exclude_namespaces
	PodNamespace        string   // pod_namespace
	StatusRequiresAgent bool     // status_requires_agent
	// AgentWait (agent_wait_seconds) overrides Plugin.AgentWait when
	// AgentWaitSet.
	AgentWait    time.Duration
	AgentWaitSet bool
	// PodAnnotations is runtimeConfig's io.kubernetes.cri.pod-annotations,
	// filled by containerd and CRI-O when the entry declares that
	// capability; nil when absent.
	PodAnnotations map[string]string

	level level
	prev  *result
}

// ParseConfig reads the plugin's stdin. Errors name the field at fault.
func ParseConfig(stdin []byte) (*Config, error) {
	if !gjson.ValidBytes(stdin) {
		return nil, errors.New("parsing network config: not valid JSON")
	}
	root := gjson.ParseBytes(stdin)
	if !root.IsObject() {
		return nil, errors.New("parsing network config: not a JSON object")
	}
	c := &Config{}
	var err error
	str := func(key string, dst *string) {
		if v := root.Get(key); err == nil && v.Exists() && v.Type != gjson.Null {
			if v.Type != gjson.String {
				err = fmt.Errorf("%s: want a string, have %s", key, v.Raw)
				return
			}
			*dst = v.Str
		}
	}
	str("cniVersion", &c.CNIVersion)
	str("name", &c.Name)
	str("plugin_log_level", &c.LogLevel)
	str("cni_agent_run_dir", &c.RunDir)
	str("policy_snapshot", &c.PolicySnapshot)
	str("pod_namespace", &c.PodNamespace)
	if err != nil {
		return nil, err
	}
	if v := root.Get("status_requires_agent"); v.Exists() && v.Type != gjson.Null {
		if v.Type != gjson.True && v.Type != gjson.False {
			return nil, fmt.Errorf("status_requires_agent: want true or false, have %s", v.Raw)
		}
		c.StatusRequiresAgent = v.Bool()
	}
	if v := root.Get("agent_wait_seconds"); v.Exists() && v.Type != gjson.Null {
		if v.Type != gjson.Number || v.Num < 0 || v.Num > wire.MaxAgentWait.Seconds() {
			return nil, fmt.Errorf("agent_wait_seconds: want a number of seconds from 0 to %.0f, have %s", wire.MaxAgentWait.Seconds(), v.Raw)
		}
		c.AgentWait, c.AgentWaitSet = time.Duration(v.Num*float64(time.Second)), true
	}
	if c.ExcludeNamespaces, err = strings_(root.Get("exclude_namespaces"), "exclude_namespaces"); err != nil {
		return nil, err
	}
	if c.PodAnnotations, err = podAnnotations(root.Get("runtimeConfig")); err != nil {
		return nil, err
	}
	if c.ValidAttachments, err = validAttachments(root.Get(`cni\.dev/valid-attachments`)); err != nil {
		return nil, err
	}
	if p := root.Get("prevResult"); p.Exists() && p.Type != gjson.Null {
		if !p.IsObject() {
			return nil, fmt.Errorf("parsing prevResult: want an object, have %s", p.Raw)
		}
		c.PrevResult = []byte(p.Raw)
		if c.prev, err = parseResult(p); err != nil {
			return nil, fmt.Errorf("parsing prevResult: %w", err)
		}
	}
	if err := c.settle(); err != nil {
		return nil, err
	}
	return c, nil
}

// podAnnotations are the pod's annotations the runtime passed in
// runtimeConfig (nil: none passed).
func podAnnotations(rc gjson.Result) (map[string]string, error) {
	if !rc.IsObject() {
		return nil, nil
	}
	ann := rc.Get(annotationsCapPath)
	if !ann.Exists() || ann.Type == gjson.Null {
		return nil, nil
	}
	if !ann.IsObject() {
		return nil, fmt.Errorf("runtimeConfig.%s: want an object of strings", annotationsCap)
	}
	out := map[string]string{}
	var err error
	ann.ForEach(func(k, v gjson.Result) bool {
		if v.Type != gjson.String {
			err = fmt.Errorf("runtimeConfig.%s.%s: want a string, have %s", annotationsCap, k.Str, v.Raw)
			return false
		}
		out[k.Str] = v.Str
		return true
	})
	return out, err
}

// validAttachments is a GC's list of the attachments the runtime keeps.
func validAttachments(va gjson.Result) ([]wire.Attachment, error) {
	if !va.Exists() || va.Type == gjson.Null {
		return nil, nil
	}
	if !va.IsArray() {
		return nil, errors.New("cni.dev/valid-attachments: want a list")
	}
	var out []wire.Attachment
	for _, a := range va.Array() {
		out = append(out, wire.Attachment{ContainerID: a.Get("containerID").String(), IfName: a.Get("ifname").String()})
	}
	return out, nil
}

// settle fills the defaults and checks the paths and the log level.
func (c *Config) settle() error {
	if c.RunDir == "" {
		c.RunDir = DefaultRunDir
	}
	if !filepath.IsAbs(c.RunDir) {
		return fmt.Errorf("cni_agent_run_dir %q must be an absolute path", c.RunDir)
	}
	c.RunDir = filepath.Clean(c.RunDir)
	if c.PolicySnapshot != "" && !filepath.IsAbs(c.PolicySnapshot) {
		return fmt.Errorf("policy_snapshot %q must be an absolute path", c.PolicySnapshot)
	}
	switch strings.ToLower(c.LogLevel) {
	case "debug":
		c.level = levelDebug
	case "", "info":
		c.level = levelInfo
	case "warn", "warning":
		c.level = levelWarn
	case "error":
		c.level = levelError
	default:
		return fmt.Errorf("plugin_log_level %q: want debug, info, warn or error", c.LogLevel)
	}
	return nil
}

// annotationsCap is the capability containerd and CRI-O fill with the
// pod's annotations.
const annotationsCap = "io.kubernetes.cri.pod-annotations"

// annotationsCapPath is annotationsCap as a gjson path, its dots escaped
// (a constant: gjson.Escape allocates on every exec).
const annotationsCapPath = `io\.kubernetes\.cri\.pod-annotations`

// strings_ reads a list of strings (absent or null: nil).
func strings_(v gjson.Result, key string) ([]string, error) {
	if !v.Exists() || v.Type == gjson.Null {
		return nil, nil
	}
	if !v.IsArray() {
		return nil, fmt.Errorf("%s: want a list of strings, have %s", key, v.Raw)
	}
	var out []string
	for _, e := range v.Array() {
		if e.Type != gjson.String {
			return nil, fmt.Errorf("%s: want a list of strings, have %s", key, v.Raw)
		}
		out = append(out, e.Str)
	}
	return out, nil
}

// SocketPath is the agent's event socket.
func (c *Config) SocketPath() string { return filepath.Join(c.RunDir, wire.SocketName) }

// PolicyPath is the agent's policy snapshot: on persistent storage when
// the entry names it (it must outlive a reboot), else in the run dir.
func (c *Config) PolicyPath() string {
	if c.PolicySnapshot != "" {
		return c.PolicySnapshot
	}
	return filepath.Join(c.RunDir, wire.PolicyName)
}

// result is the part of a CNI result (0.3.0 and later) the plugin reads:
// each address and the name of the interface it is on, if any.
type result struct {
	ips []resultIP
}

type resultIP struct {
	// address is the CIDR as the result gives it. The plugin does not parse
	// it (net/netip's init would cost every exec page faults); the agent
	// does, and drops what is not an address.
	address string
	ifname  string // "" when the address names no interface
	bad     bool   // names an interface the result does not list
}

func parseResult(p gjson.Result) (*result, error) {
	ips := p.Get("ips")
	if ips.Exists() && !ips.IsArray() && ips.Type != gjson.Null {
		return nil, fmt.Errorf("ips: want a list, have %s", ips.Raw)
	}
	ifaces := p.Get("interfaces")
	r := &result{}
	ips.ForEach(func(_, ip gjson.Result) bool {
		e := resultIP{address: ip.Get("address").String()}
		if i := ip.Get("interface"); i.Exists() && i.Type != gjson.Null {
			e.bad = true
			if n := i.Int(); i.Type == gjson.Number && n >= 0 && ifaces.IsArray() {
				if iface := ifaces.Get(strconv.FormatInt(n, 10)); iface.Exists() {
					e.ifname, e.bad = iface.Get("name").String(), false
				}
			}
		}
		r.ips = append(r.ips, e)
		return true
	})
	return r, nil
}

// prevResult is prevResult as parsed (nil if absent): ParseConfig already
// refused one it could not read.
func (c *Config) prevResult() *result { return c.prev }

// K8sArgs are the CNI_ARGS that kubelet-era runtimes pass.
type K8sArgs struct {
	K8S_POD_NAME, K8S_POD_NAMESPACE, K8S_POD_UID, K8S_POD_INFRA_CONTAINER_ID string
}

// parseK8sArgs reads CNI_ARGS ("K=V;K=V"), ignoring keys we do not know,
// as runtimes add their own.
func parseK8sArgs(s string) (*K8sArgs, error) {
	a := &K8sArgs{}
	if s == "" {
		return a, nil
	}
	for _, pair := range strings.Split(s, ";") {
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return nil, fmt.Errorf("parsing CNI_ARGS: invalid pair %q", pair)
		}
		switch k {
		case "K8S_POD_NAME":
			a.K8S_POD_NAME = v
		case "K8S_POD_NAMESPACE":
			a.K8S_POD_NAMESPACE = v
		case "K8S_POD_UID":
			a.K8S_POD_UID = v
		case "K8S_POD_INFRA_CONTAINER_ID":
			a.K8S_POD_INFRA_CONTAINER_ID = v
		}
	}
	return a, nil
}

// podIPs lists the addresses prevResult gives the sandbox interface ifname
// (or no interface at all, as some IPAMs report them).
func podIPs(r *result, ifname string) []string {
	if r == nil {
		return nil
	}
	var out []string
	for _, ip := range r.ips {
		if !ip.bad && (ip.ifname == "" || ip.ifname == ifname) {
			out = append(out, ip.address)
		}
	}
	return out
}
