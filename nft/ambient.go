package nft

import (
	"net/netip"

	"github.com/google/nftables"

	"github.com/nftcni/nftcni/istio"
)

const (
	// PodTable is our table in a pod netns.
	PodTable = "nftcni"
)

// Loopback, kept out of capture.
var (
	loopback4 = netip.MustParsePrefix("127.0.0.1/32")
	loopback6 = netip.MustParsePrefix("::1/128")
)

// families lists the address families rules are made for: IPv4 (true),
// then IPv6 (false) when enabled.
func families(ipv6 bool) []bool {
	if ipv6 {
		return []bool{true, false}
	}
	return []bool{true}
}

func loopback(v4 bool) netip.Prefix {
	if v4 {
		return loopback4
	}
	return loopback6
}

// AmbientSpec is what decides a pod's ambient ruleset.
type AmbientSpec struct {
	// DNSCapture redirects DNS (UDP and TCP port 53) to ztunnel's 15053.
	DNSCapture bool
	// IPv6 adds the ip6 twin of every address-specific rule.
	IPv6 bool
	// IngressBypass (ambient.istio.io/bypass-inbound-capture) leaves inbound
	// traffic alone; outbound is still captured.
	IngressBypass bool
	// VirtualInterfaces (istio.io/reroute-virtual-interfaces): TCP arriving
	// on them is treated as outbound and sent to 15001.
	VirtualInterfaces []string
	// ProbeSNAT is the source of kubelet's probes, let past ztunnel.
	ProbeSNAT ProbeSNAT `json:",omitzero"`
}

// chain names in the pod table; one inet table holds nat, mangle and raw
// base chains (Istio uses three tables for the same hooks).
const (
	natPre     = "nat-prerouting"
	natOut     = "nat-output"
	manglePre  = "mangle-prerouting"
	mangleOut  = "mangle-output"
	rawPre     = "raw-prerouting"
	rawOut     = "raw-output"
	prioRaw    = -300
	prioMangle = -150
	prioNAT    = -100
)

// Ambient builds the in-pod ruleset that sends a pod's traffic to ztunnel:
// Istio's ambient ruleset (§3.1 of the reference), rule for rule.
func Ambient(s AmbientSpec) *Ruleset {
	t := &Table{Name: PodTable}
	t.base(natPre, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, prioNAT)
	t.base(natOut, nftables.ChainTypeNAT, nftables.ChainHookOutput, prioNAT)
	t.base(manglePre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioMangle)
	t.base(mangleOut, nftables.ChainTypeRoute, nftables.ChainHookOutput, prioMangle)
	if s.DNSCapture {
		t.base(rawPre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioRaw)
		t.base(rawOut, nftables.ChainTypeFilter, nftables.ChainHookOutput, prioRaw)
	}
	fams := families(s.IPv6)
	snat := func(v4 bool) netip.Prefix {
		a := s.ProbeSNAT.Addr(v4)
		return netip.PrefixFrom(a, a.BitLen())
	}
	notZtunnel := Mark(Neq, istio.MarkMask, istio.ZtunnelMark)

	// Inbound.
	for _, v := range s.VirtualInterfaces {
		t.add(natPre, IfName(true, Eq, v), L4(TCP), Counter(), Redirect(istio.ZtunnelOutboundPort))
	}
	if !s.IngressBypass {
		for _, v4 := range fams { // kubelet probes, SNATed on the host, bypass ztunnel
			t.add(natPre, L4(TCP), Addr(true, Eq, snat(v4)), Counter(), Accept())
		}
		for _, v4 := range fams { // everything else but HBONE and ztunnel's own packets
			t.add(natPre, Addr(false, Neq, loopback(v4)), DPort(TCP, Neq, istio.HBONEPort), notZtunnel, Counter(), Redirect(istio.ZtunnelInboundPort))
		}
	}

	// Outbound.
	for _, v4 := range fams { // replies to probes
		t.add(natOut, L4(TCP), Addr(false, Eq, snat(v4)), Counter(), Accept())
	}
	if s.DNSCapture {
		t.add(natOut, IfName(false, Neq, "lo"), notZtunnel, DPort(UDP, Eq, 53), Counter(), Redirect(istio.DNSCapturePort))
		for _, v4 := range fams {
			t.add(natOut, Addr(false, Neq, loopback(v4)), DPort(TCP, Eq, 53), notZtunnel, Counter(), Redirect(istio.DNSCapturePort))
		}
	}
	// Replies on connections ztunnel opened into the pod go back as they are.
	t.add(natOut, L4(TCP), Mark(Eq, istio.MarkMask, istio.ConnMark), Counter(), Accept())
	for _, v4 := range fams { // the app talking to its own pod IP over lo
		t.add(natOut, IfName(false, Eq, "lo"), Addr(false, Neq, loopback(v4)), Counter(), Accept())
	}
	for _, v4 := range fams {
		t.add(natOut, L4(TCP), Addr(false, Neq, loopback(v4)), notZtunnel, Counter(), Redirect(istio.ZtunnelOutboundPort))
	}

	// Connection marks: remember that ztunnel opened a connection, and put
	// the mark back on its replies so policy routing returns them to ztunnel.
	t.add(manglePre, Mark(Eq, istio.MarkMask, istio.ZtunnelMark), Counter(), SetCtMarkBits(^istio.MarkMask, istio.ConnMark))
	t.add(mangleOut, CtMark(Eq, istio.MarkMask, istio.ConnMark), Counter(), SetMarkFromCt())

	// A conntrack zone of its own for ztunnel's upstream DNS, so its UDP
	// ports cannot collide with the app's (istio/istio#33469).
	if s.DNSCapture {
		t.add(rawOut, DPort(UDP, Eq, 53), Mark(Eq, istio.MarkMask, istio.ZtunnelMark), Counter(), SetCtZone(1))
		t.add(rawPre, SPort(UDP, Eq, 53), notZtunnel, Counter(), SetCtZone(1))
	}

	rs := &Ruleset{Tables: []*Table{t}}
	for _, v4 := range fams {
		rs.Routes = append(rs.Routes, Route{Mark: istio.ConnMark, Mask: istio.MarkMask, Table: istio.RouteTable, Priority: istio.RulePriority, V6: !v4})
	}
	return rs
}
