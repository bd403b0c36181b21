package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
)

const chart = "../deploy/charts/nftcni"

// helm is the real helm, built from the module proxy by `make helm`.
func helm(t testing.TB, args ...string) []byte {
	t.Helper()
	bin := testnet.Cached("NFTCNI_HELM", "helm-v3.22.0/helm")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("helm not found at %s: run `make helm` (make test does) or set NFTCNI_HELM", bin)
	}
	cmd := exec.Command(bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return out
}

// profiles are the chart's default values ("") and each platform profile.
func profiles(t testing.TB) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chart, "profiles", "*.yaml"))
	if err != nil || len(files) < 5 {
		t.Fatalf("profiles: %v %v", files, err)
	}
	return append([]string{""}, files...)
}

// render is `helm template` as the manifest target runs it.
func render(t testing.TB, profile string, set ...string) []byte {
	args := []string{"template", "nftcni", chart, "--namespace", "kube-system", "--kube-version", "1.37.2"}
	if profile != "" {
		args = append(args, "-f", profile)
	}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return helm(t, args...)
}

func objects(t testing.TB, manifest []byte) []*unstructured.Unstructured {
	t.Helper()
	var out []*unstructured.Unstructured
	r := yaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(manifest)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(doc, &u.Object); err != nil {
			t.Fatalf("rendered YAML: %v\n%s", err, doc)
		}
		if len(u.Object) > 0 {
			out = append(out, u)
		}
	}
}

// The chart lints and renders with the real helm for the defaults and
// every platform profile (and the options that add objects), and the real
// kube-apiserver accepts every rendered object in a server-side dry-run
// create with strict field validation, so a misspelt field fails here.
// Every ConfigMap key is an env var the agent reads.
func TestHelmChartAcceptedByAPIServer(t *testing.T) {
	api := kubetest.Start(t)
	installNADCRD(t, api) // the openshift profile renders NetworkAttachmentDefinitions
	create := creator(t, api)
	envs := agentEnvVars(t)
	for _, p := range profiles(t) {
		name := "default"
		if p != "" {
			name = strings.TrimSuffix(filepath.Base(p), ".yaml")
		}
		t.Run(name, func(t *testing.T) {
			lint := []string{"lint", chart, "--strict", "--kube-version", "1.37.2"}
			if p != "" {
				lint = append(lint, "-f", p)
			}
			helm(t, lint...)
			objs := objects(t, render(t, p, "resourceQuotas.enabled=true", "networkPolicy.enabled=true"))
			kinds := map[string]bool{}
			for _, o := range objs {
				kinds[o.GetKind()] = true
				if err := create(o, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: "Strict"}); err != nil {
					t.Errorf("API server refuses %s %s: %v", o.GetKind(), o.GetName(), err)
				}
				if o.GetKind() == "ConfigMap" {
					data, _, _ := unstructured.NestedStringMap(o.Object, "data")
					for k := range data {
						if !envs[k] {
							t.Errorf("ConfigMap key %s is not an env var of nftcni-agent run", k)
						}
					}
				}
			}
			for _, k := range []string{"DaemonSet", "ConfigMap", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ResourceQuota", "NetworkPolicy"} {
				if !kinds[k] {
					t.Errorf("no %s rendered", k)
				}
			}
			if want := name == "openshift"; kinds["NetworkAttachmentDefinition"] != want {
				t.Errorf("NetworkAttachmentDefinition rendered: %v, want %v (Multus's platforms only)", kinds["NetworkAttachmentDefinition"], want)
			}
		})
	}
}

// The agent's pod is in the node's network namespace with
// ambient.shareHostNetworkNamespace (istio-cni's value), and with
// statusRequiresAgent, under which the kubelet starts no other pod while
// the agent is down (TestNode reboots a node so); by default it is not.
func TestAgentPodInTheNodesNetworkNamespace(t *testing.T) {
	for _, tc := range []struct {
		set     string
		hostNet bool
	}{{"logging.level=info", false}, {"ambient.shareHostNetworkNamespace=true", true}, {"statusRequiresAgent=true", true}} {
		for _, o := range objects(t, render(t, "", tc.set)) {
			if o.GetKind() != "DaemonSet" {
				continue
			}
			hostNet, _, _ := unstructured.NestedBool(o.Object, "spec", "template", "spec", "hostNetwork")
			dns, _, _ := unstructured.NestedString(o.Object, "spec", "template", "spec", "dnsPolicy")
			if hostNet != tc.hostNet || (dns == "ClusterFirstWithHostNet") != tc.hostNet {
				t.Errorf("--set %s: hostNetwork %v, dnsPolicy %q; want hostNetwork %v (with ClusterFirstWithHostNet)", tc.set, hostNet, dns, tc.hostNet)
			}
		}
	}
}

// maxProcs sets the agent's GOMAXPROCS: 1 by default, Go's own with 0.
func TestAgentMaxProcs(t *testing.T) {
	for _, c := range []struct{ set, want string }{{"logging.level=info", "1"}, {"maxProcs=2", "2"}, {"maxProcs=0", ""}} {
		found := false
		for _, o := range objects(t, render(t, "", c.set)) {
			if o.GetKind() != "DaemonSet" {
				continue
			}
			found = true
			cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			got := ""
			for _, c := range cs {
				env, _, _ := unstructured.NestedSlice(c.(map[string]any), "env")
				for _, e := range env {
					if e := e.(map[string]any); e["name"] == "GOMAXPROCS" {
						got, _ = e["value"].(string)
					}
				}
			}
			if got != c.want {
				t.Errorf("--set %s: the agent's GOMAXPROCS %q, want %q", c.set, got, c.want)
			}
		}
		if !found {
			t.Fatalf("--set %s: no DaemonSet rendered", c.set)
		}
	}
}

// readiness.istiodLabel gives the agent's pods istio-cni's k8s-app label,
// which istiod's untaint controller looks for, in every place that selects
// them: the DaemonSet's selector and template, and the NetworkPolicy. The
// refusal to change it on upgrade is in TestNode (it needs a live release).
func TestIstiodLabel(t *testing.T) {
	for _, c := range []struct{ set, want string }{{"readiness.istiodLabel=false", "nftcni-node"}, {"readiness.istiodLabel=true", "istio-cni-node"}} {
		got := map[string]string{}
		for _, o := range objects(t, render(t, "", c.set, "networkPolicy.enabled=true")) {
			for what, path := range map[string][]string{
				"DaemonSet selector": {"spec", "selector", "matchLabels", "k8s-app"},
				"DaemonSet template": {"spec", "template", "metadata", "labels", "k8s-app"},
				"NetworkPolicy pods": {"spec", "podSelector", "matchLabels", "k8s-app"},
			} {
				if v, ok, _ := unstructured.NestedString(o.Object, path...); ok && strings.HasPrefix(what, o.GetKind()) {
					got[what] = v
				}
			}
		}
		if len(got) != 3 {
			t.Fatalf("%s: found %v, want the DaemonSet's selector and template and the NetworkPolicy's pods", c.set, got)
		}
		for what, v := range got {
			if v != c.want {
				t.Errorf("%s: %s k8s-app=%s, want %s", c.set, what, v, c.want)
			}
		}
	}
}

// provider: multus renders a NetworkAttachmentDefinition in each namespace
// of multus.namespaces (istio#54820), which a real API server with the
// NPWG CRD accepts.
func TestMultusNetworkAttachmentDefinitions(t *testing.T) {
	api := kubetest.Start(t)
	installNADCRD(t, api)
	ctx := context.Background()
	if _, err := api.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	create := creator(t, api)
	n := 0
	for _, o := range objects(t, render(t, "", "provider=multus", "multus.namespaces={default,shop}")) {
		if o.GetKind() != "NetworkAttachmentDefinition" {
			continue
		}
		n++
		if err := create(o, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Errorf("creating NetworkAttachmentDefinition %s/%s: %v", o.GetNamespace(), o.GetName(), err)
		}
	}
	dyn, err := dynamic.NewForConfig(api.Config)
	if err != nil {
		t.Fatal(err)
	}
	nads := dyn.Resource(schema.GroupVersionResource{Group: "k8s.cni.cncf.io", Version: "v1", Resource: "network-attachment-definitions"})
	for _, ns := range []string{"default", "shop"} {
		if _, err := nads.Namespace(ns).Get(ctx, "nftcni", metav1.GetOptions{}); err != nil {
			t.Errorf("no NetworkAttachmentDefinition nftcni in %s: %v", ns, err)
		}
	}
	if n != 2 {
		t.Errorf("%d NetworkAttachmentDefinitions rendered, want 2", n)
	}
}

// installNADCRD installs the NPWG NetworkAttachmentDefinition CRD (as
// Multus does) and waits until the API server serves it.
func installNADCRD(t testing.TB, api *kubetest.Server) { t.Helper(); installNADCRDOn(t, api.Config) }

// installNADCRDOn is installNADCRD on any API server.
func installNADCRDOn(t testing.TB, config *rest.Config) {
	t.Helper()
	raw, err := os.ReadFile("testdata/npwg-network-attachment-definition-crd.yaml")
	if err != nil {
		t.Fatal(err)
	}
	objs := objects(t, raw)
	dyn, err := dynamic.NewForConfig(config)
	if err != nil {
		t.Fatal(err)
	}
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	if _, err := crds.Create(context.Background(), objs[0], metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		o, err := crds.Get(context.Background(), objs[0].GetName(), metav1.GetOptions{})
		if err == nil {
			conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
			for _, c := range conds {
				if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the NetworkAttachmentDefinition CRD was not established: %v", err)
		}
	}
}

// creator returns a function that creates any object on api, whatever its
// kind, as kubectl would.
func creator(t testing.TB, api *kubetest.Server) func(*unstructured.Unstructured, metav1.CreateOptions) error {
	dyn, err := dynamic.NewForConfig(api.Config)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(api.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	return func(o *unstructured.Unstructured, opts metav1.CreateOptions) error {
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return err
		}
		var c dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if o.GetNamespace() != "" {
			c = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		_, err = c.Create(context.Background(), o, opts)
		return err
	}
}

// agentEnvVars are the env vars `nftcni-agent run` reads, from its
// generated reference.
func agentEnvVars(t testing.TB) map[string]bool {
	t.Helper()
	b, err := os.ReadFile("../docs/config-reference.md")
	if err != nil {
		t.Fatal(err)
	}
	run, _, _ := strings.Cut(string(b), "## `nftcni-agent install`")
	out := map[string]bool{}
	for _, l := range strings.Split(run, "\n") {
		if f := strings.Split(l, "|"); len(f) > 3 && strings.HasPrefix(strings.TrimSpace(f[2]), "`") {
			out[strings.Trim(strings.TrimSpace(f[2]), "`")] = true
		}
	}
	if len(out) < 20 {
		t.Fatalf("read only %d env vars from the reference", len(out))
	}
	return out
}

// deploy/nftcni.yaml is the chart rendered with its defaults; regenerate
// it with `make manifest` when this fails.
func TestRenderedManifestIsUpToDate(t *testing.T) {
	have, err := os.ReadFile("../deploy/nftcni.yaml")
	if err != nil {
		t.Fatalf("%v: run `make manifest`", err)
	}
	if want := render(t, ""); !bytes.Equal(have, want) {
		t.Fatal("deploy/nftcni.yaml differs from the chart's rendering: run `make manifest`")
	}
}

// The image the chart runs has what the chart expects (the plugin at
// PLUGIN_BINARY, the agent as the entrypoint) and nothing to run a shell,
// iptables or nft with: its last stage is scratch and only copies.
func TestDockerfileMatchesTheChart(t *testing.T) {
	b, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	stages := strings.Split(string(b), "\nFROM ")
	final := stages[len(stages)-1]
	if !strings.HasPrefix(final, "scratch") {
		t.Errorf("the image's last stage is not scratch: FROM %s", strings.SplitN(final, "\n", 2)[0])
	}
	for _, l := range strings.Split(final, "\n") {
		if f := strings.Fields(l); len(f) > 0 && (f[0] == "RUN" || f[0] == "SHELL") {
			t.Errorf("the final stage runs something: %s", l)
		}
	}
	var plugin string
	for _, o := range objects(t, render(t, "")) {
		if o.GetKind() != "DaemonSet" {
			continue
		}
		cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		env, _, _ := unstructured.NestedSlice(cs[0].(map[string]any), "env")
		for _, e := range env {
			if e := e.(map[string]any); e["name"] == "PLUGIN_BINARY" {
				plugin, _ = e["value"].(string)
			}
		}
	}
	dir, name := filepath.Split(plugin)
	if plugin == "" || !strings.Contains(final, "COPY --from=build /out/"+name+" ") || !strings.Contains(final, " "+dir+"\n") {
		t.Errorf("the chart's PLUGIN_BINARY %q is not where the Dockerfile puts the plugin:\n%s", plugin, final)
	}
	if !strings.Contains(final, `ENTRYPOINT ["`+dir+`nftcni-agent"]`) {
		t.Errorf("the image's entrypoint is not the agent in %s", dir)
	}
}

// TestNumericImageTag: a tag of digits only (a short commit hash can be
// one) names the image as given; helm's --set reads it as a number.
func TestNumericImageTag(t *testing.T) {
	out := render(t, "", "tag=9502044")
	if !bytes.Contains(out, []byte(`image: "ghcr.io/nftcni/nftcni:9502044"`)) {
		t.Errorf("with tag=9502044 the image is not ghcr.io/nftcni/nftcni:9502044:\n%s", grepLines(string(out), "image:"))
	}
}
