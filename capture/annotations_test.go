package capture

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/istio"
)

func TestParseSidecarDefaults(t *testing.T) {
	s, err := ParseSidecar(nil, SidecarProxy{})
	if err != nil {
		t.Fatal(err)
	}
	want := SidecarSpec{
		Mode: istio.ModeRedirect, InboundAll: true, ExcludeInboundPorts: []uint16{15020, 15021, 15090},
		OutboundAll: true, ExcludeOutboundPorts: []uint16{15020}, ProxyUID: 1337, ProxyGID: 1337,
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("defaults:\n got %+v\nwant %+v", s, want)
	}
}

func TestParseSidecarValues(t *testing.T) {
	s, err := ParseSidecar(map[string]string{
		istio.AnnInterceptionMode:     "TPROXY",
		istio.AnnIncludeInboundPorts:  "8080, 9090,8080",
		istio.AnnExcludeInboundPorts:  "15021,7000",
		istio.AnnIncludeOutboundCIDRs: "10.0.0.0/8, 10.96.0.10",
		istio.AnnExcludeOutboundCIDRs: "192.168.1.7/24",
		istio.AnnIncludeOutboundPorts: "",
		istio.AnnExcludeInterfaces:    "eth1,eth2",
		istio.AnnKubevirtInterfaces:   "k0",
	}, SidecarProxy{UID: 1500, GID: 1600, DNSCapture: true, IPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	if s.Mode != istio.ModeTProxy || s.InboundAll || !reflect.DeepEqual(s.InboundPorts, []uint16{8080, 9090}) {
		t.Errorf("inbound: %+v", s)
	}
	if !reflect.DeepEqual(s.ExcludeInboundPorts, []uint16{15021, 7000, 15020, 15090}) {
		t.Errorf("exclude inbound %v", s.ExcludeInboundPorts)
	}
	if s.OutboundAll || !reflect.DeepEqual(s.IncludeOutboundCIDRs, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("10.96.0.10/32")}) {
		t.Errorf("include cidrs %v", s.IncludeOutboundCIDRs)
	}
	if !reflect.DeepEqual(s.ExcludeOutboundCIDRs, []netip.Prefix{netip.MustParsePrefix("192.168.1.0/24")}) {
		t.Errorf("exclude cidrs %v (should be masked)", s.ExcludeOutboundCIDRs)
	}
	if !reflect.DeepEqual(s.RerouteInterfaces, []string{"k0"}) || !reflect.DeepEqual(s.ExcludeInterfaces, []string{"eth1", "eth2"}) {
		t.Errorf("interfaces %v %v", s.RerouteInterfaces, s.ExcludeInterfaces)
	}
	if s.ProxyUID != 1500 || s.ProxyGID != 1600 || !s.DNSCapture || !s.IPv6 {
		t.Errorf("proxy settings %+v", s)
	}
	// The current annotation wins over its deprecated twin.
	s, _ = ParseSidecar(map[string]string{istio.AnnRerouteInterfaces: "new0", istio.AnnKubevirtInterfaces: "old0"}, SidecarProxy{})
	if !reflect.DeepEqual(s.RerouteInterfaces, []string{"new0"}) {
		t.Errorf("reroute = %v", s.RerouteInterfaces)
	}
}

func TestParseSidecarErrors(t *testing.T) {
	for key, val := range map[string]string{
		istio.AnnInterceptionMode:     "MAGIC",
		istio.AnnIncludeInboundPorts:  "80,http",
		istio.AnnExcludeInboundPorts:  "70000",
		istio.AnnExcludeOutboundPorts: "0",
		istio.AnnIncludeOutboundCIDRs: "10.0.0.0/33",
		istio.AnnExcludeOutboundCIDRs: "not-a-cidr",
		istio.AnnExcludeInterfaces:    "a-very-long-interface-name",
	} {
		_, err := ParseSidecar(map[string]string{key: val}, SidecarProxy{})
		if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), val) {
			t.Errorf("%s=%q: error %v does not name the annotation and value", key, val, err)
		}
	}
}
