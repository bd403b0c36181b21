// Package capture builds Istio's capture rulesets as nft.Rulesets, rule
// for rule: the ambient in-pod ruleset that sends a pod's traffic to
// ztunnel, the sidecar ruleset istio-iptables would make from a pod's
// annotations, and the host table that lets kubelet's probes past
// ztunnel. Every builder is a pure function of its spec; golden files say
// what nft lists for each, and the conformance suite checks the packet
// fates against Istio's own rules. Programming them is package nft's.
package capture

import (
	"net/netip"

	"github.com/google/nftables"

	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
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
func Ambient(s AmbientSpec) *nft.Ruleset {
	t := &nft.Table{Name: nft.PodTable}
	t.Base(natPre, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, prioNAT)
	t.Base(natOut, nftables.ChainTypeNAT, nftables.ChainHookOutput, prioNAT)
	t.Base(manglePre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioMangle)
	t.Base(mangleOut, nftables.ChainTypeRoute, nftables.ChainHookOutput, prioMangle)
	if s.DNSCapture {
		t.Base(rawPre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioRaw)
		t.Base(rawOut, nftables.ChainTypeFilter, nftables.ChainHookOutput, prioRaw)
	}
	fams := families(s.IPv6)
	snat := func(v4 bool) netip.Prefix {
		a := s.ProbeSNAT.Addr(v4)
		return netip.PrefixFrom(a, a.BitLen())
	}
	notZtunnel := nft.Mark(nft.Neq, istio.MarkMask, istio.ZtunnelMark)

	// Inbound.
	for _, v := range s.VirtualInterfaces {
		t.Add(natPre, nft.IfName(true, nft.Eq, v), nft.L4(nft.TCP), nft.Counter(), nft.Redirect(istio.ZtunnelOutboundPort))
	}
	if !s.IngressBypass {
		for _, v4 := range fams { // kubelet probes, SNATed on the host, bypass ztunnel
			t.Add(natPre, nft.L4(nft.TCP), nft.Addr(true, nft.Eq, snat(v4)), nft.Counter(), nft.Accept())
		}
		for _, v4 := range fams { // everything else but HBONE and ztunnel's own packets
			t.Add(natPre, nft.Addr(false, nft.Neq, loopback(v4)), nft.DPort(nft.TCP, nft.Neq, istio.HBONEPort), notZtunnel, nft.Counter(), nft.Redirect(istio.ZtunnelInboundPort))
		}
	}

	// Outbound.
	for _, v4 := range fams { // replies to probes
		t.Add(natOut, nft.L4(nft.TCP), nft.Addr(false, nft.Eq, snat(v4)), nft.Counter(), nft.Accept())
	}
	if s.DNSCapture {
		t.Add(natOut, nft.IfName(false, nft.Neq, "lo"), notZtunnel, nft.DPort(nft.UDP, nft.Eq, 53), nft.Counter(), nft.Redirect(istio.DNSCapturePort))
		for _, v4 := range fams {
			t.Add(natOut, nft.Addr(false, nft.Neq, loopback(v4)), nft.DPort(nft.TCP, nft.Eq, 53), notZtunnel, nft.Counter(), nft.Redirect(istio.DNSCapturePort))
		}
	}
	// Replies on connections ztunnel opened into the pod go back as they are.
	t.Add(natOut, nft.L4(nft.TCP), nft.Mark(nft.Eq, istio.MarkMask, istio.ConnMark), nft.Counter(), nft.Accept())
	for _, v4 := range fams { // the app talking to its own pod IP over lo
		t.Add(natOut, nft.IfName(false, nft.Eq, "lo"), nft.Addr(false, nft.Neq, loopback(v4)), nft.Counter(), nft.Accept())
	}
	for _, v4 := range fams {
		t.Add(natOut, nft.L4(nft.TCP), nft.Addr(false, nft.Neq, loopback(v4)), notZtunnel, nft.Counter(), nft.Redirect(istio.ZtunnelOutboundPort))
	}

	// Connection marks: remember that ztunnel opened a connection, and put
	// the mark back on its replies so policy routing returns them to ztunnel.
	t.Add(manglePre, nft.Mark(nft.Eq, istio.MarkMask, istio.ZtunnelMark), nft.Counter(), nft.SetCtMarkBits(^istio.MarkMask, istio.ConnMark))
	t.Add(mangleOut, nft.CtMark(nft.Eq, istio.MarkMask, istio.ConnMark), nft.Counter(), nft.SetMarkFromCt())

	// A conntrack zone of its own for ztunnel's upstream DNS, so its UDP
	// ports cannot collide with the app's (istio/istio#33469).
	if s.DNSCapture {
		t.Add(rawOut, nft.DPort(nft.UDP, nft.Eq, 53), nft.Mark(nft.Eq, istio.MarkMask, istio.ZtunnelMark), nft.Counter(), nft.SetCtZone(1))
		t.Add(rawPre, nft.SPort(nft.UDP, nft.Eq, 53), notZtunnel, nft.Counter(), nft.SetCtZone(1))
	}

	rs := &nft.Ruleset{Tables: []*nft.Table{t}}
	for _, v4 := range fams {
		rs.Routes = append(rs.Routes, nft.Route{Mark: istio.ConnMark, Mask: istio.MarkMask, Table: istio.RouteTable, Priority: istio.RulePriority, V6: !v4})
	}
	return rs
}
