package capture

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

var update = flag.Bool("update", false, "rewrite golden files")

// variant is one ruleset under test; name is its golden file.
type variant struct {
	name string
	rs   *nft.Ruleset
}

func sidecarDefaults(t testing.TB, ann map[string]string, p SidecarProxy) SidecarSpec {
	t.Helper()
	s, err := ParseSidecar(ann, p)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func variants(t testing.TB) []variant {
	uid := "5f0c3c5e-8d7a-4c1e-9c1b-6d1f2a3b4c5d"
	return []variant{
		{"ambient-default", Ambient(AmbientSpec{DNSCapture: true, IPv6: true})},
		{"ambient-dns-off", Ambient(AmbientSpec{DNSCapture: false, IPv6: true})},
		{"ambient-ingress-bypass", Ambient(AmbientSpec{DNSCapture: true, IPv6: true, IngressBypass: true})},
		{"ambient-ipv4-only", Ambient(AmbientSpec{DNSCapture: true})},
		{"ambient-virtual-interfaces", Ambient(AmbientSpec{DNSCapture: true, IPv6: true, VirtualInterfaces: []string{"tun0", "kubevirt0"}})},
		{"sidecar-default", Sidecar(sidecarDefaults(t, nil, SidecarProxy{}))},
		{"sidecar-ipv6", Sidecar(sidecarDefaults(t, nil, SidecarProxy{IPv6: true}))},
		{"sidecar-tproxy", Sidecar(sidecarDefaults(t, map[string]string{istio.AnnInterceptionMode: "TPROXY"}, SidecarProxy{IPv6: true}))},
		{"sidecar-dns-drop-invalid", Sidecar(sidecarDefaults(t, nil, SidecarProxy{DNSCapture: true, DropInvalid: true, UID: 1500, GID: 1501}))},
		{"sidecar-ports-and-cidrs", Sidecar(sidecarDefaults(t, map[string]string{
			istio.AnnIncludeInboundPorts:  "8080, 9090",
			istio.AnnIncludeOutboundCIDRs: "10.0.0.0/8,fd00::/8",
			istio.AnnExcludeOutboundCIDRs: "10.96.0.10/32",
			istio.AnnIncludeOutboundPorts: "3306",
			istio.AnnExcludeOutboundPorts: "15020,5432",
			istio.AnnExcludeInterfaces:    "eth9",
			istio.AnnRerouteInterfaces:    "tap0",
		}, SidecarProxy{IPv6: true}))},
		// Sets: contained, duplicate and host-bit prefixes, adjacent ones,
		// ranges ending at the family's last address, lists that wrap.
		{"sidecar-many-cidrs-and-ports", Sidecar(sidecarDefaults(t, map[string]string{
			istio.AnnExcludeOutboundCIDRs: "10.0.0.0/8,10.1.2.3/32,10.1.0.0/16,192.168.7.9/24,192.168.7.0/24,1.1.1.1/32,1.1.1.2/32," +
				"255.255.255.0/24,100.64.0.0/10,fd00::/8,fd00:1::/32,2001:db8::1/128,ffff::/16",
			istio.AnnIncludeInboundPorts:  "1,2,3,4,5,6,7,8,9,10,11,12,8080,8080",
			istio.AnnExcludeOutboundPorts: "15020,5432,53,8443",
		}, SidecarProxy{IPv6: true}))},
		{"sidecar-tproxy-ports", Sidecar(sidecarDefaults(t, map[string]string{istio.AnnInterceptionMode: "TPROXY", istio.AnnIncludeInboundPorts: "8080"}, SidecarProxy{}))},
		{"host-probe", HostProbe(HostSpec{IPv6: true}, []nft.Member{{UID: uid, IPs: []netip.Addr{netip.MustParseAddr("10.244.1.7"), netip.MustParseAddr("fd00:244::7")}}})},
	}
}

// TestGolden renders every variant and compares it with its golden file.
// The netns tests check that the same text is what nft lists after Apply.
func TestGolden(t *testing.T) {
	for _, v := range variants(t) {
		t.Run(v.name, func(t *testing.T) {
			got := nft.Render(v.rs.Tables...)
			path := filepath.Join("testdata", v.name+".golden")
			if *update {
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (go test ./nft -run TestGolden -update)", err)
			}
			if got != string(want) {
				t.Errorf("render differs from %s:\n%s", path, got)
			}
		})
	}
}

func TestTagsAreUniqueWithinAChain(t *testing.T) {
	for _, v := range variants(t) {
		for _, tb := range v.rs.Tables {
			for _, c := range tb.Chains {
				seen := map[string]bool{}
				for _, r := range c.Rules {
					if seen[r.Tag()] {
						t.Errorf("%s: chain %s has two rules %q", v.name, c.Name, r.Text())
					}
					seen[r.Tag()] = true
				}
			}
		}
	}
}
