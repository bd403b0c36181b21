package wire

import (
	"encoding/json"
	"slices"

	"github.com/nftcni/nftcni/istio"
)

// sidecarStatus is the part of the injector's sidecar.istio.io/status
// annotation we read: which containers it injected.
type sidecarStatus struct {
	InitContainers []string `json:"initContainers"`
	Containers     []string `json:"containers"`
}

// Injection is what a pod's annotations, as the runtime passes them, say
// of Istio's sidecar injection. They never decide a sidecar pod's ruleset:
// that exempts the proxy's UID and GID, which only the pod spec says (the
// agent decides, package enablement); they only tell the plugin what it
// may do without the agent.
type Injection int

const (
	// NotInjected: no (readable) injection status; the agent decides.
	NotInjected Injection = iota
	// CapturesItself: istio-init was injected; no rules are needed.
	CapturesItself
	// NoProxy: injected without istio-proxy; nothing to capture for.
	NoProxy
	// Sidecar: istio-proxy injected; only the agent can decide the rules.
	Sidecar
)

// SidecarInjection reads the injection status, and why in words.
func SidecarInjection(ann map[string]string) (Injection, string) {
	raw, ok := ann[istio.AnnSidecarStatus]
	if !ok {
		return NotInjected, ""
	}
	var st sidecarStatus
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		return NotInjected, ""
	}
	switch {
	case slices.Contains(st.InitContainers, istio.InitContainer):
		return CapturesItself, "sidecar injected with istio-init, which captures traffic itself"
	case !slices.Contains(st.Containers, istio.ProxyContainer):
		return NoProxy, "sidecar status lists no istio-proxy container"
	}
	return Sidecar, "sidecar injected (" + istio.AnnSidecarStatus + " lists istio-proxy)"
}
