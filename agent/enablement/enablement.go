// Package enablement decides, from a pod and its namespace, what nftcni
// does for it: nothing, ambient capture, or sidecar capture. The rules are
// Istio's (istio-cni's enablement selectors, hard exclusions and per-pod
// overrides); this package is pure and has no Kubernetes client.
package enablement

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

const (
	defaultExcludedNS   = "kube-system"
	selectorDescription = "{podSelector, namespaceSelector}"
)

// Selector is one enablement entry: a pod is enrolled when both selectors
// match (an empty or absent selector matches everything).
type Selector struct {
	PodSelector       *metav1.LabelSelector `json:"podSelector,omitempty"`
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
}

// DefaultSelectors are the istio-cni chart's: the pod is labelled ambient,
// or its namespace is and the pod does not opt out with "none".
func DefaultSelectors() []Selector {
	return []Selector{
		{
			NamespaceSelector: &metav1.LabelSelector{},
			PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient}},
		},
		{
			NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient}},
			PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: istio.LabelDataplaneMode, Operator: metav1.LabelSelectorOpNotIn, Values: []string{istio.DataplaneNone}},
			}},
		},
	}
}

// Config is the node's enablement policy.
type Config struct {
	Selectors         []Selector
	ExcludeNamespaces []string
	// SystemNamespace holds ztunnel, whose own pods are never enrolled.
	SystemNamespace string
	DNSCapture      bool // AMBIENT_DNS_CAPTURE
	IPv6            bool // AMBIENT_IPV6
	// ProbeSNAT is HOST_PROBE_SNAT_IP and _IPV6 (zero: Istio's defaults).
	ProbeSNAT capture.ProbeSNAT
}

// DefaultConfig is istio-cni's default.
func DefaultConfig() Config {
	return Config{Selectors: DefaultSelectors(), ExcludeNamespaces: []string{defaultExcludedNS},
		SystemNamespace: istio.SystemNamespace, DNSCapture: true, IPv6: true}
}

type compiled struct {
	pod, ns labels.Selector
	nsEmpty bool
}

// Policy is a compiled Config.
type Policy struct {
	cfg Config
	sel []compiled
}

// Compile checks and compiles the selectors.
func Compile(cfg Config) (*Policy, error) {
	p := &Policy{cfg: cfg}
	for i, s := range cfg.Selectors {
		ps, err := metav1.LabelSelectorAsSelector(orEmpty(s.PodSelector))
		if err != nil {
			return nil, fmt.Errorf("enablement selector %d podSelector: %w", i, err)
		}
		ns, err := metav1.LabelSelectorAsSelector(orEmpty(s.NamespaceSelector))
		if err != nil {
			return nil, fmt.Errorf("enablement selector %d namespaceSelector: %w", i, err)
		}
		p.sel = append(p.sel, compiled{pod: ps, ns: ns, nsEmpty: ns.Empty()})
	}
	return p, nil
}

func orEmpty(s *metav1.LabelSelector) *metav1.LabelSelector {
	if s == nil {
		return &metav1.LabelSelector{}
	}
	return s
}

// ParseSelectors reads a selector list as JSON or YAML's JSON subset, the
// shape of AMBIENT_ENABLEMENT_SELECTOR.
func ParseSelectors(b []byte) ([]Selector, error) {
	var out []Selector
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("enablement selectors: want a JSON list of %s: %w", selectorDescription, err)
	}
	return out, nil
}

// Config returns the policy's configuration.
func (p *Policy) Config() Config { return p.cfg }

// Excluded says whether a namespace is never enrolled.
func (p *Policy) Excluded(ns string) bool { return slices.Contains(p.cfg.ExcludeNamespaces, ns) }

// NamespaceEnrols says whether the namespace's labels alone enrol its pods
// (istio-cni's MatchesNamespace: selectors with an empty namespaceSelector
// are about pods, not namespaces, and do not count).
func (p *Policy) NamespaceEnrols(ns *corev1.Namespace) bool {
	if ns == nil || p.Excluded(ns.Name) {
		return false
	}
	for _, s := range p.sel {
		if !s.nsEmpty && s.ns.Matches(labels.Set(ns.Labels)) {
			return true
		}
	}
	return false
}

// IsZtunnel says whether pod is one of ztunnel's own.
func (p *Policy) IsZtunnel(pod *corev1.Pod) bool {
	return pod.Namespace == p.cfg.SystemNamespace && pod.Labels["app"] == istio.ZtunnelAppLabel
}

// SelectorsMatch is the ambient selector test alone (no exclusions).
func (p *Policy) SelectorsMatch(pod *corev1.Pod, ns *corev1.Namespace) bool {
	var nsLabels labels.Set
	if ns != nil {
		nsLabels = ns.Labels
	}
	for _, s := range p.sel {
		if s.pod.Matches(labels.Set(pod.Labels)) && s.ns.Matches(nsLabels) {
			return true
		}
	}
	return false
}

// Decision is what a pod gets: its mode, why, and what its ruleset is
// made of. The plugin is sent the verdict and the ruleset already encoded
// (Verdict, nft.Encode of Ruleset); records keep the whole decision.
type Decision struct {
	Mode wire.Mode `json:"mode"`
	// Reason is a short human explanation, logged by both sides.
	Reason  string               `json:"reason,omitempty"`
	Ambient *capture.AmbientSpec `json:"ambient,omitempty"`
	Sidecar *SidecarDecision     `json:"sidecar,omitempty"`
}

// SidecarDecision carries the inputs of a sidecar ruleset: the pod's
// annotations and its proxy's identity.
type SidecarDecision struct {
	Annotations map[string]string    `json:"annotations"`
	Proxy       capture.SidecarProxy `json:"proxy"`
}

// Verdict is the decision as the plugin gets it.
func (d *Decision) Verdict() *wire.Verdict { return &wire.Verdict{Mode: d.Mode, Reason: d.Reason} }

// Ruleset builds the pod's ruleset for a decision; nil for ModeNone.
func (d *Decision) Ruleset() (*nft.Ruleset, error) {
	switch d.Mode {
	case wire.ModeNone:
		return nil, nil
	case wire.ModeAmbient:
		if d.Ambient == nil {
			return nil, errors.New("ambient decision without a spec")
		}
		return capture.Ambient(*d.Ambient), nil
	case wire.ModeSidecar:
		if d.Sidecar == nil {
			return nil, errors.New("sidecar decision without annotations")
		}
		spec, err := capture.ParseSidecar(d.Sidecar.Annotations, d.Sidecar.Proxy)
		if err != nil {
			return nil, err
		}
		return capture.Sidecar(spec), nil
	}
	return nil, fmt.Errorf("unknown mode %q", d.Mode)
}

// Decide says what pod gets. ips are the pod's addresses (from the plugin
// or the pod status); ip6 rules are made only for a pod that has an IPv6
// address, because the v6 policy route cannot be added in a netns without
// IPv6 and would fail the ADD for nothing.
func (p *Policy) Decide(pod *corev1.Pod, ns *corev1.Namespace, ips []string) *Decision {
	none := func(why string) *Decision { return &Decision{Mode: wire.ModeNone, Reason: why} }
	switch {
	case pod.Spec.HostNetwork:
		return none("host network")
	case p.Excluded(pod.Namespace):
		return none("namespace " + pod.Namespace + " is excluded")
	case p.IsZtunnel(pod):
		return none("ztunnel's own pod")
	}
	if _, injected := pod.Annotations[istio.AnnSidecarStatus]; injected {
		return p.sidecar(pod, ips)
	}
	if !p.SelectorsMatch(pod, ns) {
		return none("no enablement selector matches")
	}
	spec := capture.AmbientSpec{DNSCapture: p.cfg.DNSCapture, IPv6: p.cfg.IPv6 && hasIPv6(ips), ProbeSNAT: p.cfg.ProbeSNAT}
	if v, ok := pod.Annotations[istio.AnnDNSCapture]; ok {
		if b, err := strconv.ParseBool(v); err == nil {
			spec.DNSCapture = b
		}
	}
	if b, err := strconv.ParseBool(pod.Annotations[istio.AnnBypassInbound]); err == nil {
		spec.IngressBypass = b
	}
	for _, i := range strings.Split(pod.Annotations[istio.AnnRerouteInterfaces], ",") {
		if i = strings.TrimSpace(i); i != "" {
			spec.VirtualInterfaces = append(spec.VirtualInterfaces, i)
		}
	}
	return &Decision{Mode: wire.ModeAmbient, Reason: "enablement selector matches", Ambient: &spec}
}

// sidecar is istio-cni's sidecar path: the pod spec says whether the
// injected proxy needs us, and how it runs.
func (p *Policy) sidecar(pod *corev1.Pod, ips []string) *Decision {
	none := func(why string) *Decision { return &Decision{Mode: wire.ModeNone, Reason: why} }
	all := append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...)
	var proxy *corev1.Container
	for i := range all {
		switch all[i].Name {
		case istio.InitContainer:
			return none("sidecar injected with istio-init, which captures traffic itself")
		case istio.ProxyContainer:
			proxy = &all[i]
		}
	}
	if proxy == nil {
		return none("sidecar status annotation but no istio-proxy container")
	}
	inject := pod.Annotations[istio.AnnSidecarInject]
	if v, ok := pod.Labels[istio.AnnSidecarInject]; ok {
		inject = v
	}
	if b, err := strconv.ParseBool(inject); err == nil && !b {
		return none("sidecar injection disabled")
	}
	if len(proxy.Args) >= 2 && proxy.Args[0] == "proxy" && proxy.Args[1] != "sidecar" {
		return none("istio-proxy runs as " + proxy.Args[1] + ", not sidecar")
	}
	env := func(k string) bool {
		for _, e := range proxy.Env {
			if e.Name == k {
				b, _ := strconv.ParseBool(e.Value)
				return b
			}
		}
		return false
	}
	if env(istio.EnvDisableEnvoy) {
		return none("DISABLE_ENVOY is set on istio-proxy")
	}
	// Istio's capture makes IPv6 rules when the pod's first address is
	// IPv6, or for any IPv6 address when the proxy runs dual-stack
	// (tools/common/config getLocalIP): a dual-stack pod whose proxy does
	// not listen on IPv6 keeps its IPv6 traffic uncaptured.
	ipv6 := hasIPv6(ips) && (env(istio.EnvDualStack) || !hasIPv4(ips))
	px := capture.SidecarProxy{UID: istio.ProxyID, GID: istio.ProxyID, DNSCapture: env(istio.EnvDNSCapture),
		DropInvalid: env(istio.EnvInvalidDrop), IPv6: ipv6}
	if sc := proxy.SecurityContext; sc != nil {
		if sc.RunAsUser != nil && *sc.RunAsUser > 0 {
			px.UID = uint32(*sc.RunAsUser)
		}
		if sc.RunAsGroup != nil && *sc.RunAsGroup > 0 {
			px.GID = uint32(*sc.RunAsGroup)
		}
	}
	return &Decision{Mode: wire.ModeSidecar, Reason: "sidecar injected",
		Sidecar: &SidecarDecision{Annotations: pod.Annotations, Proxy: px}}
}

// hasIPv6 says whether any of the pod's addresses (CIDR text, as package
// wire carries them) is IPv6.
func hasIPv6(ips []string) bool {
	return slices.ContainsFunc(ips, func(s string) bool {
		p, err := netip.ParsePrefix(s)
		return err == nil && p.Addr().Is6() && !p.Addr().Is4In6()
	})
}

// hasIPv4 says whether any of the pod's addresses is IPv4.
func hasIPv4(ips []string) bool {
	return slices.ContainsFunc(ips, func(s string) bool {
		p, err := netip.ParsePrefix(s)
		return err == nil && p.Addr().Unmap().Is4()
	})
}
