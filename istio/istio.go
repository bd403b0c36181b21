// Package istio holds the names and numbers nftcni shares with stock
// Istio — istiod, ztunnel, the sidecar injector and istio-cni's users:
// labels, annotations, container and environment names, ports, marks,
// routing tables and probe addresses. They are a wire contract, not
// settings: each is Istio's value (istio/istio cni/pkg/config,
// pkg/config/constants, tools/istio-iptables), and changing one breaks
// compatibility with an unmodified mesh. Everything else that decides
// enrolment lives in agent/enablement; the rulesets built from these
// numbers in nft.
package istio

// Ambient enrolment: labels and annotations on pods and namespaces.
const (
	LabelDataplaneMode = "istio.io/dataplane-mode"
	DataplaneAmbient   = "ambient"
	DataplaneNone      = "none"
	// AnnRedirection is how the node agent tells istiod and users that a
	// pod's traffic is redirected to ztunnel ("enabled").
	AnnRedirection   = "ambient.istio.io/redirection"
	AnnDNSCapture    = "ambient.istio.io/dns-capture"
	AnnBypassInbound = "ambient.istio.io/bypass-inbound-capture"
	// ZtunnelAppLabel is app=ztunnel, ztunnel's own pods (never enrolled).
	ZtunnelAppLabel = "ztunnel"
	// SystemNamespace is istiod's and ztunnel's default namespace.
	SystemNamespace = "istio-system"
)

// Sidecar injection: what the injector writes on a pod, and the
// annotations users set to shape its interception.
const (
	AnnSidecarInject        = "sidecar.istio.io/inject"
	AnnSidecarStatus        = "sidecar.istio.io/status"
	AnnInterceptionMode     = "sidecar.istio.io/interceptionMode"
	AnnIncludeInboundPorts  = "traffic.sidecar.istio.io/includeInboundPorts"
	AnnExcludeInboundPorts  = "traffic.sidecar.istio.io/excludeInboundPorts"
	AnnIncludeOutboundPorts = "traffic.sidecar.istio.io/includeOutboundPorts"
	AnnExcludeOutboundPorts = "traffic.sidecar.istio.io/excludeOutboundPorts"
	AnnIncludeOutboundCIDRs = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	AnnExcludeOutboundCIDRs = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	AnnExcludeInterfaces    = "traffic.sidecar.istio.io/excludeInterfaces"
	AnnRerouteInterfaces    = "istio.io/reroute-virtual-interfaces"
	AnnKubevirtInterfaces   = "traffic.sidecar.istio.io/kubevirtInterfaces" // deprecated twin

	// Injected containers: the proxy, the init container that captures
	// the pod's traffic itself, and the one that only validates it.
	ProxyContainer      = "istio-proxy"
	InitContainer       = "istio-init"
	ValidationContainer = "istio-validation"
	// ValidationErrorCode is the validation container's exit code when
	// the pod's traffic is not captured.
	ValidationErrorCode = 126
	// ProxyID is the proxy's default UID and GID.
	ProxyID = 1337
	// The proxy container's environment that shapes its ruleset.
	EnvDNSCapture   = "ISTIO_META_DNS_CAPTURE"
	EnvInvalidDrop  = "INVALID_DROP"
	EnvDisableEnvoy = "DISABLE_ENVOY"
	EnvDualStack    = "ISTIO_DUAL_STACK"

	// Interception modes (sidecar.istio.io/interceptionMode).
	ModeRedirect = "REDIRECT"
	ModeTProxy   = "TPROXY"

	// Repair: the label istio-cni's repair controller puts on broken pods.
	LabelUninitialized = "cni.istio.io/uninitialized"
	// NotReadyTaint is the taint nodes are born with until the mesh CNI is
	// ready on them.
	NotReadyTaint = "cni.istio.io/not-ready"
)

// ztunnel's ports and marks in a pod's netns (ambient).
const (
	ZtunnelOutboundPort uint16 = 15001
	ZtunnelInboundPort  uint16 = 15006
	HBONEPort           uint16 = 15008
	DNSCapturePort      uint16 = 15053

	// ZtunnelMark is SO_MARK on ztunnel's sockets (1337); MarkMask covers
	// the bits Istio owns.
	ZtunnelMark uint32 = 0x539
	MarkMask    uint32 = 0xfff
	// ConnMark marks connections ztunnel opened into the pod, so replies
	// are routed back to it through RouteTable.
	ConnMark   uint32 = 0x111
	RouteTable        = 100
	// RulePriority is the `ip rule` preference Istio uses.
	RulePriority = 32764
)

// The sidecar's (Envoy's) ports and marks, as istio-iptables uses them.
const (
	SidecarOutboundPort uint16 = 15001
	SidecarInboundPort  uint16 = 15006
	// TProxyMark is put on intercepted inbound packets (1337);
	// TProxyLocalMark (1338) marks the proxy's own loopback traffic to the
	// app.
	TProxyMark       uint32 = 1337
	TProxyLocalMark  uint32 = 1338
	TProxyRouteTable        = 133
)

// SidecarExcludedInbound are the ports the sidecar always keeps out of
// inbound capture (agent health, readiness, Prometheus), as istio-cni
// appends them.
var SidecarExcludedInbound = []uint16{15020, 15021, 15090}

// Probe SNAT addresses: kubelet's probes to ambient pods come from these,
// so the pod's ruleset can let them past ztunnel. Text, as every fact
// here: the plugin links this package, and net/netip's init would cost
// each of its execs page faults (package nft has them parsed).
const (
	ProbeSNATv4 = "169.254.7.127"
	ProbeSNATv6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
)
