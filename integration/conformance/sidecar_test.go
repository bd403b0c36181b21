package conformance

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// captureConfig is one of istio-iptables' / istio-nftables' test
// configurations (tools/common/config.Config), as their run_test.go sets
// it on top of constructTestConfig.
type captureConfig struct {
	Mode                         string
	InInclude, InExclude         string
	OutPortsInclude, OutPortsExc string
	RangesInclude, RangesExclude string
	ExcludeIfs, Reroute          string
	UID, GID                     string
	RedirectDNS, CaptureAllDNS   bool
	DNSServers                   []string
	DropInvalid, IPv6            bool
	OwnerInclude, OwnerExclude   string
	Loopback                     string
}

// parseCapture reads a case's assignments over constructTestConfig's
// defaults. An unknown field fails: this table must know every setting
// a case makes.
func parseCapture(a Assignments) (captureConfig, error) {
	c := captureConfig{Mode: "REDIRECT", UID: "1337", GID: "1337", OwnerInclude: "*", Loopback: "127.0.0.1/32"}
	for k, v := range a.Fields {
		s, _ := v.(string)
		b, _ := v.(bool)
		switch k {
		case "InboundInterceptionMode":
			c.Mode = s
		case "InboundPortsInclude":
			c.InInclude = s
		case "InboundPortsExclude":
			c.InExclude = s
		case "OutboundPortsInclude":
			c.OutPortsInclude = s
		case "OutboundPortsExclude":
			c.OutPortsExc = s
		case "OutboundIPRangesInclude":
			c.RangesInclude = s
		case "OutboundIPRangesExclude":
			c.RangesExclude = s
		case "ExcludeInterfaces":
			c.ExcludeIfs = s
		case "RerouteVirtualInterfaces":
			c.Reroute = s
		case "ProxyUID":
			c.UID = s
		case "ProxyGID":
			c.GID = s
		case "RedirectDNS":
			c.RedirectDNS = b
		case "CaptureAllDNS":
			c.CaptureAllDNS = b
		case "DNSServersV4", "DNSServersV6":
			c.DNSServers = append(c.DNSServers, v.([]string)...)
		case "DropInvalid":
			c.DropInvalid = b
		case "EnableIPv6":
			c.IPv6 = b
		case "OwnerGroupsInclude":
			c.OwnerInclude = s
		case "OwnerGroupsExclude":
			c.OwnerExclude = s
		case "HostIPv4LoopbackCidr":
			c.Loopback = s
		case "DryRun": // the test's own mode, not a setting
		default:
			return c, fmt.Errorf("case %q sets %s, which this suite does not know", a.Name, k)
		}
	}
	return c, nil
}

func splitList(v string) []string {
	var out []string
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func ports(t testing.TB, v string) []uint16 {
	var out []uint16
	for _, f := range splitList(v) {
		n, err := strconv.ParseUint(f, 10, 16)
		if err != nil {
			t.Fatalf("port %q: %v", f, err)
		}
		out = append(out, uint16(n))
	}
	return out
}

func cidrs(t testing.TB, v string) []netip.Prefix {
	var out []netip.Prefix
	for _, f := range splitList(v) {
		out = append(out, netip.MustParsePrefix(f))
	}
	return out
}

// notExpressible says which of a configuration's settings nftcni has no
// form for. Each is a setting of istio-iptables (the init container's
// capture) that istio-cni never passes for a pod either: istio-cni gives
// one proxy UID and GID, captures all DNS when it captures DNS, and takes
// owner groups and the loopback range from no pod field.
func (c captureConfig) notExpressible() string {
	var why []string
	if strings.Contains(c.UID, ",") || strings.Contains(c.GID, ",") {
		why = append(why, "more than one proxy UID or GID")
	}
	if c.RedirectDNS && !c.CaptureAllDNS {
		why = append(why, "DNS capture of the resolv.conf servers only")
	}
	if c.OwnerInclude != "*" || c.OwnerExclude != "" {
		why = append(why, "outbound capture by owner group")
	}
	if c.Loopback != "127.0.0.1/32" {
		why = append(why, "a host loopback range other than 127.0.0.1/32")
	}
	return strings.Join(why, "; ")
}

// spec is the configuration as nftcni's sidecar builder takes it.
func (c captureConfig) spec(t testing.TB) capture.SidecarSpec {
	uid, _ := strconv.ParseUint(c.UID, 10, 32)
	gid, _ := strconv.ParseUint(c.GID, 10, 32)
	s := capture.SidecarSpec{Mode: c.Mode, InboundAll: c.InInclude == "*", ExcludeInboundPorts: ports(t, c.InExclude),
		OutboundAll: c.RangesInclude == "*", ExcludeOutboundCIDRs: cidrs(t, c.RangesExclude),
		OutboundPorts: ports(t, c.OutPortsInclude), ExcludeOutboundPorts: ports(t, c.OutPortsExc),
		ExcludeInterfaces: splitList(c.ExcludeIfs), RerouteInterfaces: splitList(c.Reroute),
		ProxyUID: uint32(uid), ProxyGID: uint32(gid), DNSCapture: c.RedirectDNS, DropInvalid: c.DropInvalid, IPv6: c.IPv6}
	if !s.InboundAll {
		s.InboundPorts = ports(t, c.InInclude)
	}
	if !s.OutboundAll {
		s.IncludeOutboundCIDRs = cidrs(t, c.RangesInclude)
	}
	return s
}

// shape: a pod with the configuration's interfaces, IPv6 when it is on.
func (c captureConfig) shape() Shape {
	s := Shape{IPv6: c.IPv6}
	for _, i := range append(splitList(c.ExcludeIfs), splitList(c.Reroute)...) {
		if i != "eth0" && !slices.Contains(s.Secondary, i) {
			s.Secondary = append(s.Secondary, i)
		}
	}
	return s
}

func (c captureConfig) proxyIDs() (uint32, uint32) {
	uid, err1 := strconv.ParseUint(c.UID, 10, 32)
	gid, err2 := strconv.ParseUint(c.GID, 10, 32)
	if err1 != nil || err2 != nil { // a list: probe as the first of each
		uid, _ = strconv.ParseUint(splitList(c.UID)[0], 10, 32)
		gid, _ = strconv.ParseUint(splitList(c.GID)[0], 10, 32)
	}
	return uint32(uid), uint32(gid)
}

// istioSidecarNetlink does what Istio's capture does through netlink
// besides its rules (tools/common/tproxy ConfigureRoutes): ::6 on lo for
// an IPv6 pod, and in TPROXY mode with inbound capture the policy route
// to the local table 133.
func istioSidecarNetlink(t testing.TB, tw *Twin, tproxy, capturesInbound, v6 bool) {
	var cmds []string
	p := tw.Pod.Name
	if v6 {
		cmds = append(cmds, fmt.Sprintf("-n %s -6 addr add ::6/128 dev lo", p))
	}
	if tproxy && capturesInbound {
		cmds = append(cmds,
			fmt.Sprintf("-n %s rule add fwmark 1337 lookup 133", p),
			fmt.Sprintf("-n %s route add local 0.0.0.0/0 dev lo table 133", p))
		if v6 {
			cmds = append(cmds,
				fmt.Sprintf("-n %s -6 rule add fwmark 1337 lookup 133", p),
				fmt.Sprintf("-n %s -6 route add local ::/0 dev lo table 133", p))
		}
	}
	if len(cmds) > 0 {
		ipBatch(t, cmds)
	}
}

func applyNftcni(t testing.TB, tw *Twin, rs *nft.Ruleset) {
	t.Helper()
	if err := nft.Apply(tw.Pod.FD, rs); err != nil {
		t.Fatalf("nftcni's ruleset into %s: %v", tw.Name, err)
	}
}

// captureCases are istio-iptables' and istio-nftables' test
// configurations against their goldens for one backend: "nftables"
// (tools/istio-nftables) or "iptables" (tools/istio-iptables).
func captureCases(t *testing.T, backend string) []Case {
	root := IstioModule(t)
	dir := filepath.Join(root, "tools", "istio-"+backend, "pkg", "capture")
	parsed, err := ParseCases(filepath.Join(dir, "run_test.go"), "getCommonTestCases")
	if err != nil {
		t.Fatal(err)
	}
	goldens := Goldens(t, filepath.Join(dir, "testdata"))
	var cases []Case
	for _, a := range parsed {
		cfg, err := parseCapture(a)
		if err != nil {
			t.Fatal(err)
		}
		golden, err := os.ReadFile(filepath.Join(dir, "testdata", a.Name+".golden"))
		if err != nil {
			t.Fatalf("case %q has no golden: %v", a.Name, err)
		}
		goldens = slices.DeleteFunc(goldens, func(g string) bool { return g == a.Name })
		uid, gid := cfg.proxyIDs()
		c := Case{Name: backend + "/" + a.Name, Shape: cfg.shape(), ProxyUID: uid, ProxyGID: gid,
			Istio: func(t testing.TB, tw *Twin) {
				if backend == "nftables" {
					tw.LoadNft(t, string(golden))
				} else {
					tw.LoadIptables(t, string(golden))
				}
				istioSidecarNetlink(t, tw, cfg.Mode == istio.ModeTProxy, cfg.InInclude != "", cfg.IPv6)
			}}
		if why := cfg.notExpressible(); why != "" {
			c.NotExpressible = why
		} else {
			spec := cfg.spec(t)
			c.Nftcni = func(t testing.TB, tw *Twin) { applyNftcni(t, tw, capture.Sidecar(spec)) }
		}
		cases = append(cases, c)
	}
	if len(goldens) > 0 {
		t.Errorf("goldens with no case in run_test.go: %v", goldens)
	}
	return cases
}

// TestSidecarGoldens compares nftcni's sidecar ruleset with every test
// configuration of Istio's sidecar capture, both backends.
func TestSidecarGoldens(t *testing.T) { compareBackends(t, captureCases) }

// compareBackends compares every case cases gives for each of Istio's
// backends.
func compareBackends(t *testing.T, cases func(t *testing.T, backend string) []Case) {
	testnet.RequireRoot(t)
	for _, backend := range []string{"nftables", "iptables"} {
		t.Run(backend, func(t *testing.T) {
			for _, c := range cases(t, backend) {
				t.Run(strings.TrimPrefix(c.Name, backend+"/"), func(t *testing.T) { Compare(t, c) })
			}
		})
	}
}

// pluginCase is one of istio-cni's own sidecar tests (cni/pkg/plugin
// plugin_dryrun_test.go): pod annotations and the proxy container as
// the CNI plugin reads them, and the golden of the iptables rules it
// programs. The table is read by hand from that file; each name is
// checked to be there.
type pluginCase struct {
	name, golden string
	annotations  map[string]string
	env          map[string]string
	uid, gid     *int64
}

func ptr(v int64) *int64 { return &v }

var pluginCases = []pluginCase{
	{name: "basic", golden: "basic"},
	{name: "include-exclude-ip", golden: "include-exclude-ip", annotations: map[string]string{
		istio.AnnIncludeOutboundCIDRs: "127.0.0.0/8", istio.AnnExcludeOutboundCIDRs: "10.0.0.0/8"}},
	{name: "include-exclude-ports", golden: "include-exclude-ports", annotations: map[string]string{
		istio.AnnIncludeInboundPorts: "1111,2222", istio.AnnExcludeInboundPorts: "3333,4444", istio.AnnExcludeOutboundPorts: "5555,6666"}},
	{name: "tproxy", golden: "tproxy", annotations: map[string]string{istio.AnnInterceptionMode: istio.ModeTProxy}},
	{name: "DNS", golden: "dns", env: map[string]string{istio.EnvDNSCapture: "true"}},
	{name: "invalid-drop", golden: "invalid-drop", env: map[string]string{istio.EnvInvalidDrop: "true"}},
	{name: "custom-uid", golden: "custom-uid", uid: ptr(1000670000), gid: ptr(1000670001)},
	{name: "custom-uid-zero", golden: "basic", uid: ptr(0)},
	{name: "custom-uid-tproxy", golden: "custom-uid-tproxy", annotations: map[string]string{istio.AnnInterceptionMode: istio.ModeTProxy},
		uid: ptr(1000670000), gid: ptr(1000670001)},
}

// sidecarPod is an injected pod as istiod makes it, for the agent's
// decision.
func sidecarPod(ann, env map[string]string, uid, gid *int64) *corev1.Pod {
	a := map[string]string{istio.AnnSidecarStatus: `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}
	for k, v := range ann {
		a[k] = v
	}
	proxy := corev1.Container{Name: istio.ProxyContainer, SecurityContext: &corev1.SecurityContext{RunAsUser: uid, RunAsGroup: gid}}
	for k, v := range env {
		proxy.Env = append(proxy.Env, corev1.EnvVar{Name: k, Value: v})
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: "default", UID: "pod-uid", Annotations: a},
		Spec: corev1.PodSpec{InitContainers: []corev1.Container{{Name: istio.ValidationContainer}},
			Containers: []corev1.Container{{Name: "app"}, proxy}}}
}

// decided is the agent's decision for pod with addresses ips, as the
// ruleset the plugin is sent.
func decided(t testing.TB, pol *enablement.Policy, pod *corev1.Pod, ns *corev1.Namespace, ips []string) *nft.Ruleset {
	t.Helper()
	d := pol.Decide(pod, ns, ips)
	rs, err := d.Ruleset()
	if err != nil || rs == nil {
		t.Fatalf("decision %+v: ruleset %v, %v", d, rs, err)
	}
	return rs
}

// TestSidecarPluginGoldens compares, for each of istio-cni's own sidecar
// tests, the rules its plugin makes from the pod (iptables) with the
// ruleset nftcni's agent decides from the same pod.
func TestSidecarPluginGoldens(t *testing.T) {
	testnet.RequireRoot(t)
	dir := filepath.Join(IstioModule(t), "cni", "pkg", "plugin")
	src, err := os.ReadFile(filepath.Join(dir, "plugin_dryrun_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	pol, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, pc := range pluginCases {
		if !strings.Contains(string(src), `name:        "`+pc.name+`"`) && !strings.Contains(string(src), `name: "`+pc.name+`"`) {
			t.Errorf("istio-cni's plugin tests have no case %q any more", pc.name)
			continue
		}
		golden, err := os.ReadFile(filepath.Join(dir, "testdata", pc.golden+".txt.golden"))
		if err != nil {
			t.Fatal(err)
		}
		uid, gid := uint32(istio.ProxyID), uint32(istio.ProxyID)
		if pc.uid != nil && *pc.uid > 0 {
			uid = uint32(*pc.uid)
		}
		if pc.gid != nil && *pc.gid > 0 {
			gid = uint32(*pc.gid)
		}
		tproxy := pc.annotations[istio.AnnInterceptionMode] == istio.ModeTProxy
		c := Case{Name: "plugin/" + pc.name, Shape: Shape{}, ProxyUID: uid, ProxyGID: gid,
			Istio: func(t testing.TB, tw *Twin) {
				tw.LoadIptables(t, string(golden))
				istioSidecarNetlink(t, tw, tproxy, true, false)
			},
			Nftcni: func(t testing.TB, tw *Twin) {
				applyNftcni(t, tw, decided(t, pol, sidecarPod(pc.annotations, pc.env, pc.uid, pc.gid), nil, []string{PodIP4.String() + "/24"}))
			}}
		t.Run(pc.name, func(t *testing.T) { Compare(t, c) })
	}
}
