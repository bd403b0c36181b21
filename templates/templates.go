// Package templates renders nftcni's CNI configuration from embedded JSON
// templates by setting values at JSON paths with sjson. Nothing is rendered
// as text, so a value can never break the JSON around it.
package templates

import (
	_ "embed"
	"fmt"

	"github.com/tidwall/pretty"
	"github.com/tidwall/sjson"
)

// PluginType is the "type" of our conflist entry and the name of the plugin
// binary the runtime executes.
const PluginType = "nftcni"

//go:embed plugin-entry.json
var pluginEntry []byte

//go:embed standalone.conflist.json
var standalone []byte

// Values are the settings the plugin reads from its conflist entry. Field
// names in the JSON follow istio-cni's where the meaning is the same.
type Values struct {
	LogLevel          string   // plugin_log_level
	AgentRunDir       string   // cni_agent_run_dir: where the agent's socket lives
	ExcludeNamespaces []string // exclude_namespaces: passed straight through
	PodNamespace      string   // pod_namespace: the agent's own namespace (self-bypass)
	// StatusRequiresAgent makes CNI STATUS fail while the agent is down. Off by
	// default: a failing STATUS marks the node NetworkReady=false on containerd.
	StatusRequiresAgent bool // status_requires_agent
	// PolicySnapshot is where the agent keeps the policy snapshot the
	// plugin falls back on (policy_snapshot); empty: in the run dir.
	PolicySnapshot string
	// AgentWaitSeconds (agent_wait_seconds), when set: how long an ADD
	// that must wait for the agent waits for it; unset, the plugin's
	// default (30 s).
	AgentWaitSeconds *float64
}

// PluginEntry renders our plugin object for a network list.
func PluginEntry(v Values) ([]byte, error) {
	doc := append([]byte(nil), pluginEntry...)
	excl := v.ExcludeNamespaces
	if excl == nil {
		excl = []string{}
	}
	sets := []struct {
		path string
		val  any
	}{
		{"plugin_log_level", v.LogLevel},
		{"cni_agent_run_dir", v.AgentRunDir},
		{"exclude_namespaces", excl},
		{"pod_namespace", v.PodNamespace},
		{"status_requires_agent", v.StatusRequiresAgent},
	}
	if v.PolicySnapshot != "" {
		sets = append(sets, struct {
			path string
			val  any
		}{"policy_snapshot", v.PolicySnapshot})
	}
	if v.AgentWaitSeconds != nil {
		sets = append(sets, struct {
			path string
			val  any
		}{"agent_wait_seconds", *v.AgentWaitSeconds})
	}
	for _, s := range sets {
		var err error
		if doc, err = sjson.SetBytes(doc, s.path, s.val); err != nil {
			return nil, fmt.Errorf("template plugin-entry.json: setting %s: %w", s.path, err)
		}
	}
	return pretty.PrettyOptions(doc, &pretty.Options{Width: 80, Indent: "  "}), nil
}

// Standalone renders a network list of its own holding only our plugin, for
// runtimes or meta-plugins (Multus) that call nftcni as a separate network.
func Standalone(v Values, cniVersion, networkName string) ([]byte, error) {
	entry, err := PluginEntry(v)
	if err != nil {
		return nil, err
	}
	doc := append([]byte(nil), standalone...)
	if doc, err = sjson.SetBytes(doc, "cniVersion", cniVersion); err != nil {
		return nil, err
	}
	if doc, err = sjson.SetBytes(doc, "name", networkName); err != nil {
		return nil, err
	}
	if doc, err = sjson.SetRawBytes(doc, "plugins.-1", entry); err != nil {
		return nil, err
	}
	return pretty.PrettyOptions(doc, &pretty.Options{Width: 80, Indent: "  "}), nil
}
