package conformance

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/istio"
)

// istioTestSNAT6 is the IPv6 probe SNAT address of istio-cni's test
// configuration (constructTestConfig in cni/pkg/nftables and iptables);
// its goldens hold it, which the test checks.
var istioTestSNAT6 = netip.MustParseAddr("e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164")

// ambientOverrides is one of istio-cni's in-pod test cases
// (GetCommonInPodTestCases): the global DNS setting and the pod's
// overrides.
type ambientOverrides struct {
	redirectDNS, ingress bool
	virtual              []string
	dns                  string // "", "true", "false": ambient.istio.io/dns-capture
}

func parseAmbient(a Assignments) (ambientOverrides, error) {
	var o ambientOverrides
	for k, v := range a.Fields {
		switch k {
		case "RedirectDNS":
			o.redirectDNS = v.(bool)
		case "IngressMode":
			o.ingress = v.(bool)
		case "VirtualInterfaces":
			o.virtual = v.([]string)
		case "DNSProxy":
			switch v {
			case "config.PodDNSEnabled":
				o.dns = "true"
			case "config.PodDNSDisabled":
				o.dns = "false"
			default:
				return o, fmt.Errorf("case %q: DNSProxy %v", a.Name, v)
			}
		default:
			return o, fmt.Errorf("case %q sets %s, which this suite does not know", a.Name, k)
		}
	}
	return o, nil
}

// annotations are the pod annotations that ask nftcni for the overrides.
func (o ambientOverrides) annotations() map[string]string {
	a := map[string]string{}
	if o.ingress {
		a[istio.AnnBypassInbound] = "true"
	}
	if len(o.virtual) > 0 {
		a[istio.AnnRerouteInterfaces] = strings.Join(o.virtual, ",")
	}
	if o.dns != "" {
		a[istio.AnnDNSCapture] = o.dns
	}
	return a
}

// ambientPod is a pod enrolled by its label, as the plugin's ADD gives
// it to the agent.
func ambientPod(ann map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: "default", UID: "pod-uid",
		Labels: map[string]string{istio.LabelDataplaneMode: istio.DataplaneAmbient}, Annotations: ann}}
}

// istioAmbientNetlink is what istio-cni's in-pod set-up does through
// netlink besides its rules: the policy route that sends marked replies
// back to ztunnel (cni/pkg/iptables AddInpodMarkIPRule, AddLoopbackRoutes).
func istioAmbientNetlink(t testing.TB, tw *Twin, v6 bool) {
	p := tw.Pod.Name
	cmds := []string{
		fmt.Sprintf("-n %s rule add fwmark 0x111/0xfff pref 32764 lookup 100", p),
		fmt.Sprintf("-n %s route add local 0.0.0.0/0 dev lo table 100", p),
	}
	if v6 {
		cmds = append(cmds,
			fmt.Sprintf("-n %s -6 rule add fwmark 0x111/0xfff pref 32764 lookup 100", p),
			fmt.Sprintf("-n %s -6 route add local ::/0 dev lo table 100", p))
	}
	ipBatch(t, cmds)
}

// ipv6OffDeliberate: with AMBIENT_IPV6=false Istio's two backends
// disagree about a dual-stack pod's IPv6 traffic. Its nftables backend's
// rules that name no family (UDP DNS to 15053, a virtual interface's
// redirect to 15001) capture it; its iptables backend leaves ip6tables
// empty. nftcni, an nftables implementation, does as Istio's nftables
// backend, so against the iptables backend those probes differ.
func ipv6OffDeliberate(backend string, v6 bool) func(p Probe) string {
	if backend != "iptables" || v6 {
		return nil
	}
	return func(p Probe) string {
		if !p.Dst.Addr().Is6() {
			return ""
		}
		if p.Proto == "udp" && p.Dst.Port() == 53 && p.From == "pod" || strings.HasPrefix(p.From, "side") {
			return BackendsDisagreeOnIPv6
		}
		return ""
	}
}

// ambientCases are istio-cni's in-pod test cases against the goldens of
// one backend ("nftables" or "iptables"), each with IPv6 off and on, for a
// dual-stack pod (AMBIENT_IPV6=false leaves its IPv6 traffic alone).
func ambientCases(t *testing.T, backend string) []Case {
	dir := filepath.Join(IstioModule(t), "cni", "pkg", backend)
	parsed, err := ParseCases(filepath.Join(dir, "common_test.go"), "GetCommonInPodTestCases")
	if err != nil {
		t.Fatal(err)
	}
	var cases []Case
	for _, a := range parsed {
		o, err := parseAmbient(a)
		if err != nil {
			t.Fatal(err)
		}
		for _, v6 := range []bool{false, true} {
			name := a.Name
			if v6 {
				name += "_ipv6"
			}
			golden, err := os.ReadFile(filepath.Join(dir, "testdata", name+".golden"))
			if err != nil {
				t.Fatalf("case %q has no golden: %v", name, err)
			}
			if v6 && !strings.Contains(string(golden), istioTestSNAT6.String()) {
				t.Fatalf("%s does not hold the test probe SNAT address %s any more", name, istioTestSNAT6)
			}
			cfg := enablement.DefaultConfig()
			cfg.DNSCapture, cfg.IPv6 = o.redirectDNS, v6
			cfg.ProbeSNAT.V6 = istioTestSNAT6
			pol, err := enablement.Compile(cfg)
			if err != nil {
				t.Fatal(err)
			}
			c := Case{Name: backend + "/" + name, Shape: Shape{IPv6: true, Secondary: o.virtual},
				Deliberate: ipv6OffDeliberate(backend, v6),
				ProxyUID:   istio.ProxyID, ProxyGID: istio.ProxyID,
				Istio: func(t testing.TB, tw *Twin) {
					if backend == "nftables" {
						tw.LoadNft(t, string(golden))
					} else {
						tw.LoadIptables(t, string(golden))
					}
					istioAmbientNetlink(t, tw, v6)
				},
				Nftcni: func(t testing.TB, tw *Twin) {
					applyNftcni(t, tw, decided(t, pol, ambientPod(o.annotations()), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
						[]string{PodIP4.String() + "/24", PodIP6.String() + "/64"}))
				}}
			cases = append(cases, c)
		}
	}
	if n := len(Goldens(t, filepath.Join(dir, "testdata"))); n != len(cases)+2 { // + hostprobe and hostprobe_ipv6
		t.Errorf("%d goldens for %d in-pod cases and the host's two", n, len(cases))
	}
	return cases
}

// TestAmbientGoldens compares nftcni's ambient ruleset with every in-pod
// test case of istio-cni, both backends, IPv6 off and on.
func TestAmbientGoldens(t *testing.T) { compareBackends(t, ambientCases) }
