package templates

import (
	"testing"

	"github.com/tidwall/gjson"
)

func TestPluginEntrySetsValuesAtPaths(t *testing.T) {
	v := Values{
		LogLevel:            "debug",
		AgentRunDir:         `/run/"quoted"\dir`, // must not break the JSON
		ExcludeNamespaces:   []string{"kube-system", "istio-system"},
		PodNamespace:        "istio-system",
		StatusRequiresAgent: true,
		AgentWaitSeconds:    ptr(12.5),
	}
	b, err := PluginEntry(v)
	if err != nil {
		t.Fatal(err)
	}
	if !gjson.ValidBytes(b) {
		t.Fatalf("invalid JSON:\n%s", b)
	}
	for path, want := range map[string]string{
		"type":                  PluginType,
		"plugin_log_level":      "debug",
		"cni_agent_run_dir":     `/run/"quoted"\dir`,
		"exclude_namespaces":    `["kube-system", "istio-system"]`,
		"pod_namespace":         "istio-system",
		"status_requires_agent": "true",
		"agent_wait_seconds":    "12.5",
		"capabilities.io\\.kubernetes\\.cri\\.pod-annotations": "true",
	} {
		got := gjson.GetBytes(b, path)
		s := got.String()
		if got.IsArray() {
			s = got.Raw
		}
		if s != want {
			t.Errorf("%s = %s, want %s", path, s, want)
		}
	}
	e, _ := PluginEntry(Values{})
	if gjson.GetBytes(e, "exclude_namespaces").Raw != "[]" {
		t.Errorf("nil namespaces should render as [], got %s", gjson.GetBytes(e, "exclude_namespaces").Raw)
	}
	if gjson.GetBytes(e, "agent_wait_seconds").Exists() {
		t.Errorf("an unset wait should leave the plugin's default (no field): %s", e)
	}
}

func ptr[T any](v T) *T { return &v }

func TestStandalone(t *testing.T) {
	b, err := Standalone(Values{LogLevel: "info"}, "0.4.0", "nftcni")
	if err != nil {
		t.Fatal(err)
	}
	if gjson.GetBytes(b, "cniVersion").Str != "0.4.0" || gjson.GetBytes(b, "name").Str != "nftcni" ||
		gjson.GetBytes(b, "plugins.#").Int() != 1 || gjson.GetBytes(b, "plugins.0.type").Str != PluginType {
		t.Errorf("standalone list:\n%s", b)
	}
}
