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
	if e, _ := PluginEntry(Values{}); gjson.GetBytes(e, "exclude_namespaces").Raw != "[]" {
		t.Errorf("nil namespaces should render as [], got %s", gjson.GetBytes(e, "exclude_namespaces").Raw)
	}
}

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
