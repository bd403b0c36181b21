package enablement

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/plugin/wire"
)

func ns(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

func pod(namespace string, labels, ann map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: "p", Labels: labels, Annotations: ann}}
}

var (
	ambientNS = ns("mesh", map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient})
	plainNS   = ns("plain", nil)
	v4        = []string{"10.0.0.5/24"}
	dual      = append(v4, "fd00::5/64")
)

func mustCompile(t *testing.T, c Config) *Policy {
	t.Helper()
	p, err := Compile(c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDefaultSelectors(t *testing.T) {
	p := mustCompile(t, DefaultConfig())
	ambient := map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient}
	optOut := map[string]string{istio.LabelDataplaneMode: istio.DataplaneNone}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		ns   *corev1.Namespace
		want wire.Mode
	}{
		{"namespace labelled", pod("mesh", nil, nil), ambientNS, wire.ModeAmbient},
		{"pod opts out", pod("mesh", optOut, nil), ambientNS, wire.ModeNone},
		{"pod labelled, namespace not", pod("plain", ambient, nil), plainNS, wire.ModeAmbient},
		{"neither", pod("plain", nil, nil), plainNS, wire.ModeNone},
		{"unknown namespace, pod labelled", pod("gone", ambient, nil), nil, wire.ModeAmbient},
		{"excluded namespace", pod("kube-system", ambient, nil), ns("kube-system", ambient), wire.ModeNone},
		{"ztunnel", func() *corev1.Pod {
			z := pod("istio-system", ambient, nil)
			z.Labels["app"] = "ztunnel"
			return z
		}(), ns("istio-system", nil), wire.ModeNone},
		{"host network", func() *corev1.Pod { h := pod("mesh", nil, nil); h.Spec.HostNetwork = true; return h }(), ambientNS, wire.ModeNone},
	} {
		if got := p.Decide(tc.pod, tc.ns, v4); got.Mode != tc.want || got.Reason == "" {
			t.Errorf("%s: %+v, want %s", tc.name, got, tc.want)
		}
	}
	if !p.NamespaceEnrols(ambientNS) || p.NamespaceEnrols(plainNS) || p.NamespaceEnrols(nil) {
		t.Error("NamespaceEnrols")
	}
}

func TestAmbientOverrides(t *testing.T) {
	p := mustCompile(t, DefaultConfig())
	d := p.Decide(pod("mesh", nil, map[string]string{
		istio.AnnDNSCapture: "false", istio.AnnBypassInbound: "true", istio.AnnRerouteInterfaces: "tun0, ,kubevirt0",
	}), ambientNS, dual)
	want := capture.AmbientSpec{DNSCapture: false, IPv6: true, IngressBypass: true, VirtualInterfaces: []string{"tun0", "kubevirt0"}}
	if d.Mode != wire.ModeAmbient || d.Ambient == nil || !equalSpec(*d.Ambient, want) {
		t.Errorf("overrides: %+v", d.Ambient)
	}
	// Non-boolean values are ignored; IPv6 only with a v6 address.
	d = p.Decide(pod("mesh", nil, map[string]string{istio.AnnDNSCapture: "maybe"}), ambientNS, v4)
	if !d.Ambient.DNSCapture || d.Ambient.IPv6 {
		t.Errorf("defaults: %+v", d.Ambient)
	}
	cfg := DefaultConfig()
	cfg.DNSCapture, cfg.IPv6 = false, false
	d = mustCompile(t, cfg).Decide(pod("mesh", nil, nil), ambientNS, dual)
	if d.Ambient.DNSCapture || d.Ambient.IPv6 {
		t.Errorf("node-wide off: %+v", d.Ambient)
	}
}

func equalSpec(a, b capture.AmbientSpec) bool {
	if a.DNSCapture != b.DNSCapture || a.IPv6 != b.IPv6 || a.IngressBypass != b.IngressBypass || len(a.VirtualInterfaces) != len(b.VirtualInterfaces) {
		return false
	}
	for i := range a.VirtualInterfaces {
		if a.VirtualInterfaces[i] != b.VirtualInterfaces[i] {
			return false
		}
	}
	return true
}

func TestSidecarFromPodSpec(t *testing.T) {
	p := mustCompile(t, DefaultConfig())
	uid, gid := int64(2000), int64(3000)
	injected := func(mut func(*corev1.Pod)) *corev1.Pod {
		x := pod("mesh", nil, map[string]string{istio.AnnSidecarStatus: `{}`})
		x.Spec.InitContainers = []corev1.Container{{Name: "istio-validation"}}
		x.Spec.Containers = []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"},
			Env:             []corev1.EnvVar{{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"}, {Name: "INVALID_DROP", Value: "true"}},
			SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &gid}}}
		if mut != nil {
			mut(x)
		}
		return x
	}
	// A sidecar pod in an ambient namespace is still a sidecar pod.
	d := p.Decide(injected(nil), ambientNS, dual)
	if d.Mode != wire.ModeSidecar {
		t.Fatalf("injected pod: %+v", d)
	}
	if want := (capture.SidecarProxy{UID: 2000, GID: 3000, DNSCapture: true, DropInvalid: true}); d.Sidecar.Proxy != want {
		t.Errorf("proxy = %+v, want %+v", d.Sidecar.Proxy, want)
	}
	// IPv6 rules as Istio's capture decides them: for a pod whose first
	// address is IPv6, or any IPv6 pod whose proxy runs dual-stack.
	dualStack := func(x *corev1.Pod) {
		x.Spec.Containers[1].Env = append(x.Spec.Containers[1].Env, corev1.EnvVar{Name: istio.EnvDualStack, Value: "true"})
	}
	for _, c := range []struct {
		name string
		mut  func(*corev1.Pod)
		ips  []string
		want bool
	}{
		{"dual-stack pod", nil, dual, false},
		{"dual-stack pod, ISTIO_DUAL_STACK", dualStack, dual, true},
		{"IPv6-only pod", nil, []string{"fd00::5/64"}, true},
		{"IPv4-only pod, ISTIO_DUAL_STACK", dualStack, []string{"10.0.0.5/24"}, false},
	} {
		if got := p.Decide(injected(c.mut), ambientNS, c.ips).Sidecar.Proxy.IPv6; got != c.want {
			t.Errorf("%s: IPv6 %v, want %v", c.name, got, c.want)
		}
	}
	for name, mut := range map[string]func(*corev1.Pod){
		"istio-init":   func(x *corev1.Pod) { x.Spec.InitContainers = []corev1.Container{{Name: "istio-init"}} },
		"no proxy":     func(x *corev1.Pod) { x.Spec.Containers = x.Spec.Containers[:1] },
		"router":       func(x *corev1.Pod) { x.Spec.Containers[1].Args = []string{"proxy", "router"} },
		"inject=false": func(x *corev1.Pod) { x.Labels = map[string]string{istio.AnnSidecarInject: "false"} },
		"DISABLE_ENVOY": func(x *corev1.Pod) {
			x.Spec.Containers[1].Env = []corev1.EnvVar{{Name: "DISABLE_ENVOY", Value: "true"}}
		},
	} {
		if d := p.Decide(injected(mut), ambientNS, v4); d.Mode != wire.ModeNone {
			t.Errorf("%s: %+v, want none", name, d)
		}
	}
	// Defaults: 1337 when the proxy's security context says nothing.
	d = p.Decide(injected(func(x *corev1.Pod) { x.Spec.Containers[1].SecurityContext = nil }), plainNS, v4)
	if d.Sidecar.Proxy.UID != 1337 || d.Sidecar.Proxy.GID != 1337 || d.Sidecar.Proxy.IPv6 {
		t.Errorf("default proxy: %+v", d.Sidecar.Proxy)
	}
}

func TestParseSelectors(t *testing.T) {
	s, err := ParseSelectors([]byte(`[{"podSelector":{"matchLabels":{"a":"b"}}}]`))
	if err != nil || len(s) != 1 {
		t.Fatal(s, err)
	}
	p := mustCompile(t, Config{Selectors: s})
	if !p.SelectorsMatch(pod("x", map[string]string{"a": "b"}, nil), nil) {
		t.Error("absent namespaceSelector should match every namespace")
	}
	if _, err := ParseSelectors([]byte(`{"podSelector":{}}`)); err == nil {
		t.Error("a non-list was accepted")
	}
	bad := []Selector{{PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Sideways"}}}}}
	if _, err := Compile(Config{Selectors: bad}); err == nil {
		t.Error("an invalid operator compiled")
	}
}

func TestHasIPv6(t *testing.T) {
	v4 := []string{"10.0.0.1/24", "::ffff:10.0.0.2/120", "not an address"}
	if hasIPv6(v4) {
		t.Error("v4, v4-mapped or garbage counted as IPv6")
	}
	if !hasIPv6(append(v4, "fd00::1/64")) {
		t.Error("fd00::1 not counted")
	}
}
