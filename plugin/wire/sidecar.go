package wire

import (
	"encoding/json"
	"slices"

	"github.com/nftcni/nftcni/nft"
)

// sidecarStatus is the part of the injector's sidecar.istio.io/status
// annotation we read: which containers it injected.
type sidecarStatus struct {
	InitContainers []string `json:"initContainers"`
	Containers     []string `json:"containers"`
}

// SidecarFromAnnotations decides a sidecar-injected pod from its
// annotations alone, as the runtime passes them: nil when they do not say
// (no annotations, no or unreadable injection status), so the agent must be
// asked. The injection status lists the injected containers, which stands
// in for the pod spec Istio's plugin reads: an istio-init container means
// the pod captures its own traffic, no istio-proxy means nothing to
// capture for. Proxy UID/GID are Istio's defaults (1337).
func SidecarFromAnnotations(ann map[string]string, ipv6 bool) *Decision {
	raw, ok := ann[nft.AnnSidecarStatus]
	if !ok {
		return nil
	}
	var st sidecarStatus
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		return nil
	}
	switch {
	case slices.Contains(st.InitContainers, "istio-init"):
		return &Decision{Mode: ModeNone, Reason: "sidecar injected with istio-init, which captures traffic itself"}
	case !slices.Contains(st.Containers, "istio-proxy"):
		return &Decision{Mode: ModeNone, Reason: "sidecar status lists no istio-proxy container"}
	}
	return &Decision{Mode: ModeSidecar, Reason: "sidecar injected (" + nft.AnnSidecarStatus + ")",
		Sidecar: &SidecarDecision{Annotations: ann, Proxy: nft.SidecarProxy{IPv6: ipv6}}}
}
