package nft

import (
	"net/netip"
	"slices"

	"github.com/google/nftables"

	"github.com/nftcni/nftcni/istio"
)

// SidecarSpec is Istio's sidecar capture configuration, usually filled from
// pod annotations by ParseSidecar.
type SidecarSpec struct {
	Mode string // ModeRedirect or ModeTProxy

	// Inbound: all TCP ports but the excluded ones (InboundAll), or only
	// InboundPorts. Neither: no inbound capture.
	InboundAll          bool
	InboundPorts        []uint16
	ExcludeInboundPorts []uint16

	// Outbound: all destinations (OutboundAll) or only IncludeOutboundCIDRs,
	// minus ExcludeOutboundCIDRs and ExcludeOutboundPorts; OutboundPorts are
	// captured whatever the destination.
	OutboundAll          bool
	IncludeOutboundCIDRs []netip.Prefix
	ExcludeOutboundCIDRs []netip.Prefix
	OutboundPorts        []uint16
	ExcludeOutboundPorts []uint16

	ExcludeInterfaces []string
	// RerouteInterfaces (istio.io/reroute-virtual-interfaces): traffic that
	// arrives on them is outbound traffic of the pod.
	RerouteInterfaces []string

	ProxyUID, ProxyGID uint32
	DNSCapture         bool // ISTIO_META_DNS_CAPTURE on the proxy
	DropInvalid        bool // INVALID_DROP on the proxy
	IPv6               bool
}

// sidecar chain names (Istio's, without the istio- prefix, in one table).
const (
	scInbound    = "inbound"
	scRedirect   = "redirect"
	scInRedirect = "in-redirect"
	scOutput     = "output"
	scOutputDNS  = "output-dns"
	scMangleIn   = "mangle-inbound"
	scDivert     = "divert"
	scTProxy     = "tproxy"
	scDrop       = "drop"
	scRawDNS     = "raw-output-dns"
	scRawIn      = "raw-inbound"
)

// sidecar set names: the annotations' lists (address sets get -v4/-v6).
const (
	setOutExclude      = "out-exclude"       // excludeOutboundIPRanges
	setOutInclude      = "out-include"       // includeOutboundIPRanges
	setOutExcludePorts = "out-exclude-ports" // excludeOutboundPorts
	setOutIncludePorts = "out-include-ports" // includeOutboundPorts
	setInInclude       = "in-include-ports"  // includeInboundPorts
	setInExclude       = "in-exclude-ports"  // excludeInboundPorts
)

var (
	inboundPassthrough4 = netip.MustParsePrefix("127.0.0.6/32")
	inboundPassthrough6 = netip.MustParsePrefix("::6/128")
)

// Sidecar builds Istio's sidecar capture ruleset (§3.3 of the reference).
// Rules go in Istio's order: interfaces, inbound, outbound.
func Sidecar(s SidecarSpec) *Ruleset {
	b := &sidecar{s: s, t: &Table{Name: PodTable}, tproxy: s.Mode == istio.ModeTProxy, fams: families(s.IPv6)}
	b.bases()
	b.interfaces()
	captureIn := s.InboundAll || len(s.InboundPorts) > 0
	switch {
	case captureIn && !b.tproxy:
		b.inboundRedirect()
	case captureIn && b.tproxy:
		b.inboundTProxy()
	}
	if b.tproxy {
		b.tproxyMarks()
	}
	b.t.add(scRedirect, L4(TCP), Counter(), Redirect(istio.SidecarOutboundPort))
	b.t.add(scInRedirect, L4(TCP), Counter(), Redirect(istio.SidecarInboundPort))
	b.outboundFirst()
	b.outboundOwners()
	// DNS before the loopback return, so that a resolver on 127.0.0.1 is
	// captured too.
	if s.DNSCapture {
		b.dns()
	}
	b.outboundDestinations()

	rs := &Ruleset{Tables: []*Table{b.t}}
	if s.IPv6 {
		// The proxy's IPv6 inbound passthrough source: IPv6 gives lo only
		// ::1/128, so ::6 must be added for the proxy to bind it (as
		// Istio's capture does).
		rs.LoopbackAddrs = []netip.Prefix{inboundPassthrough6}
	}
	if b.tproxy && captureIn { // Istio routes marked packets only when it captures inbound
		for _, v4 := range b.fams {
			rs.Routes = append(rs.Routes, Route{Mark: istio.TProxyMark, Mask: 0xffffffff, Table: istio.TProxyRouteTable, Priority: istio.RulePriority, V6: !v4})
		}
	}
	return rs
}

// sidecar is one sidecar ruleset being built.
type sidecar struct {
	s      SidecarSpec
	t      *Table
	tproxy bool
	fams   []bool // true: IPv4
}

func (b *sidecar) bases() {
	t, s := b.t, b.s
	t.base(natPre, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, prioNAT)
	t.base(natOut, nftables.ChainTypeNAT, nftables.ChainHookOutput, prioNAT)
	if b.tproxy || s.DropInvalid {
		t.base(manglePre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioMangle)
	}
	if b.tproxy {
		t.base(mangleOut, nftables.ChainTypeRoute, nftables.ChainHookOutput, prioMangle)
	}
	if s.DNSCapture {
		t.base(rawPre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioRaw)
		t.base(rawOut, nftables.ChainTypeFilter, nftables.ChainHookOutput, prioRaw)
	}
}

func passthrough(v4 bool) netip.Prefix {
	if v4 {
		return inboundPassthrough4
	}
	return inboundPassthrough6
}

// addrSet is the match of an address list's set for one family. Address
// and port lists are named sets, one rule per list; a list with nothing in
// it (for a family) makes no set and no rule.
func (b *sidecar) addrSet(name string, v4 bool, pfxs []netip.Prefix) (Term, bool) {
	fam := "-v4"
	if !v4 {
		fam = "-v6"
	}
	set := PrefixSet(name+fam, !v4, pfxs)
	if len(set.Elements) == 0 || !v4 && !b.s.IPv6 {
		return nil, false
	}
	if !slices.ContainsFunc(b.t.Sets, func(x *Set) bool { return x.Name == set.Name }) {
		b.t.Sets = append(b.t.Sets, set)
	}
	return AddrInSet(false, v4, set.Name), true
}

// portSet is the name of a port list's set; "" for an empty list.
func (b *sidecar) portSet(name string, ports []uint16) string {
	if len(ports) == 0 {
		return ""
	}
	if !slices.ContainsFunc(b.t.Sets, func(x *Set) bool { return x.Name == name }) {
		b.t.Sets = append(b.t.Sets, PortSet(name, ports))
	}
	return name
}

// interfaces: excluded interfaces are left alone, rerouted ones are
// outbound traffic; invalid packets dropped.
func (b *sidecar) interfaces() {
	t, s := b.t, b.s
	for _, x := range s.ExcludeInterfaces {
		t.add(natPre, IfName(true, Eq, x), Counter(), Return())
		t.add(natOut, IfName(false, Eq, x), Counter(), Return())
		if b.tproxy {
			t.add(manglePre, IfName(true, Eq, x), Counter(), Return())
			t.add(mangleOut, IfName(false, Eq, x), Counter(), Return())
		}
	}
	for _, v := range s.RerouteInterfaces {
		if s.OutboundAll {
			t.add(natPre, IfName(true, Eq, v), Counter(), Jump(scRedirect))
		} else {
			for _, v4 := range []bool{true, false} {
				if in, ok := b.addrSet(setOutInclude, v4, s.IncludeOutboundCIDRs); ok {
					t.add(natPre, IfName(true, Eq, v), in, Counter(), Jump(scRedirect))
				}
			}
		}
		t.add(natPre, IfName(true, Eq, v), Counter(), Return())
	}
	if s.DropInvalid {
		t.add(manglePre, L4(TCP), CtState("invalid"), Counter(), Jump(scDrop))
		t.add(scDrop, Counter(), Drop())
	}
}

// inboundRedirect captures inbound TCP with REDIRECT to 15006.
func (b *sidecar) inboundRedirect() {
	t, s := b.t, b.s
	t.add(natPre, L4(TCP), Counter(), Jump(scInbound))
	t.add(scInbound, DPort(TCP, Eq, istio.HBONEPort), Counter(), Return())
	if s.InboundAll {
		if set := b.portSet(setInExclude, s.ExcludeInboundPorts); set != "" {
			t.add(scInbound, DPortInSet(TCP, set), Counter(), Return())
		}
		t.add(scInbound, L4(TCP), Counter(), Jump(scInRedirect))
	} else if set := b.portSet(setInInclude, s.InboundPorts); set != "" {
		t.add(scInbound, DPortInSet(TCP, set), Counter(), Jump(scInRedirect))
	}
}

// inboundTProxy captures inbound TCP with TPROXY to 15006, marking it.
func (b *sidecar) inboundTProxy() {
	t, s := b.t, b.s
	t.add(scDivert, Counter(), SetMark(istio.TProxyMark))
	t.add(scDivert, Counter(), Accept())
	for _, v4 := range b.fams {
		t.add(scTProxy, L4(TCP), Addr(false, Neq, loopback(v4)), TProxy(v4, istio.SidecarInboundPort), SetMark(istio.TProxyMark), Counter(), Accept())
	}
	t.add(manglePre, L4(TCP), Counter(), Jump(scMangleIn))
	t.add(scMangleIn, L4(TCP), Mark(Eq, 0, istio.TProxyMark), Counter(), Return())
	for _, v4 := range b.fams {
		t.add(scMangleIn, IfName(true, Eq, "lo"), L4(TCP), Addr(true, Eq, passthrough(v4)), Counter(), Return())
	}
	t.add(scMangleIn, IfName(true, Eq, "lo"), L4(TCP), Mark(Neq, 0, istio.TProxyLocalMark), Counter(), Return())
	// No return for HBONE's 15008 here: both of Istio's backends keep
	// it in the nat inbound chain only, which TPROXY mode never jumps
	// to, so TPROXY captures 15008 like any other port.
	if s.InboundAll {
		if set := b.portSet(setInExclude, s.ExcludeInboundPorts); set != "" {
			t.add(scMangleIn, DPortInSet(TCP, set), Counter(), Return())
		}
		t.add(scMangleIn, L4(TCP), CtState("established", "related"), Counter(), Jump(scDivert))
		t.add(scMangleIn, L4(TCP), Counter(), Jump(scTProxy))
	} else if set := b.portSet(setInInclude, s.InboundPorts); set != "" {
		t.add(scMangleIn, DPortInSet(TCP, set), CtState("established", "related"), Counter(), Jump(scDivert))
		t.add(scMangleIn, DPortInSet(TCP, set), Counter(), Jump(scTProxy))
	}
}

// tproxyMarks carries TPROXY's mark through conntrack, and marks the
// proxy's own connections to its pod over lo.
func (b *sidecar) tproxyMarks() {
	t, s := b.t, b.s
	t.add(manglePre, L4(TCP), Mark(Eq, 0, istio.TProxyMark), Counter(), SetCtMarkFromMark())
	t.add(mangleOut, IfName(false, Eq, "lo"), L4(TCP), Mark(Eq, 0, istio.TProxyMark), Counter(), Return())
	for _, id := range []Term{SkUID(Eq, s.ProxyUID), SkGID(Eq, s.ProxyGID)} {
		for _, v4 := range b.fams {
			t.add(mangleOut, IfName(false, Eq, "lo"), L4(TCP), Addr(false, Neq, loopback(v4)), id, Counter(), SetMark(istio.TProxyLocalMark))
		}
	}
	t.add(mangleOut, L4(TCP), CtMark(Eq, 0, istio.TProxyMark), Counter(), SetMarkFromCt())
}

// outboundFirst: the output chain, excluded ports and the proxy's inbound
// passthrough source.
func (b *sidecar) outboundFirst() {
	t, s := b.t, b.s
	t.add(natOut, Counter(), Jump(scOutput))
	if set := b.portSet(setOutExcludePorts, s.ExcludeOutboundPorts); set != "" {
		t.add(scOutput, DPortInSet(TCP, set), Counter(), Return())
		t.add(scOutput, DPortInSet(UDP, set), Counter(), Return())
	}
	for _, v4 := range b.fams {
		t.add(scOutput, IfName(false, Eq, "lo"), Addr(true, Eq, passthrough(v4)), Counter(), Return())
	}
}

// outboundOwners: the proxy's own traffic (by UID, then GID). The proxy
// calling its own pod over lo is inbound traffic: sent to the inbound
// listener; other lo traffic of the proxy is left alone. A loopback range
// the user includes is captured: the "leave lo alone" returns go (Istio's
// HasLoopBackIP).
func (b *sidecar) outboundOwners() {
	t, s := b.t, b.s
	includesLoopback := slices.ContainsFunc(s.IncludeOutboundCIDRs, func(p netip.Prefix) bool { return p.Addr().IsLoopback() })
	owners := []struct {
		eq, neq Term
	}{{SkUID(Eq, s.ProxyUID), SkUID(Neq, s.ProxyUID)}, {SkGID(Eq, s.ProxyGID), SkGID(Neq, s.ProxyGID)}}
	for _, o := range owners {
		for _, v4 := range b.fams {
			r := []Term{IfName(false, Eq, "lo"), Addr(false, Neq, loopback(v4)), DPort(TCP, Neq, istio.HBONEPort)}
			if s.DNSCapture {
				r = append(r, DPort(TCP, Neq, 53))
			}
			t.add(scOutput, append(r, o.eq, Counter(), Jump(scInRedirect))...)
		}
		switch {
		case includesLoopback:
		case s.DNSCapture:
			t.add(scOutput, IfName(false, Eq, "lo"), DPort(TCP, Neq, 53), o.neq, Counter(), Return())
		default:
			t.add(scOutput, IfName(false, Eq, "lo"), o.neq, Counter(), Return())
		}
		t.add(scOutput, o.eq, Counter(), Return())
	}
}

// dns redirects DNS to the proxy's 15053 and splits its conntrack zones.
func (b *sidecar) dns() {
	t, s := b.t, b.s
	t.add(scOutput, Counter(), Jump(scOutputDNS))
	t.add(scOutputDNS, DPort(TCP, Eq, 53), Counter(), Redirect(istio.DNSCapturePort))
	t.add(scOutputDNS, DPort(UDP, Eq, 53), Counter(), Redirect(istio.DNSCapturePort))
	t.add(rawOut, Counter(), Jump(scRawDNS))
	t.add(scRawDNS, DPort(UDP, Eq, 53), SkUID(Eq, s.ProxyUID), Counter(), SetCtZone(1))
	t.add(scRawDNS, SPort(UDP, Eq, istio.DNSCapturePort), SkUID(Eq, s.ProxyUID), Counter(), SetCtZone(2))
	t.add(scRawDNS, DPort(UDP, Eq, 53), SkGID(Eq, s.ProxyGID), Counter(), SetCtZone(1))
	t.add(scRawDNS, SPort(UDP, Eq, istio.DNSCapturePort), SkGID(Eq, s.ProxyGID), Counter(), SetCtZone(2))
	t.add(scRawDNS, DPort(UDP, Eq, 53), Counter(), SetCtZone(2))
	t.add(rawPre, Counter(), Jump(scRawIn))
	t.add(scRawIn, SPort(UDP, Eq, 53), Counter(), SetCtZone(1))
}

// outboundDestinations: loopback and excluded ranges are left alone;
// included ports, then all or the included ranges, go to 15001.
func (b *sidecar) outboundDestinations() {
	t, s := b.t, b.s
	for _, v4 := range b.fams {
		t.add(scOutput, Addr(false, Eq, loopback(v4)), Counter(), Return())
	}
	for _, v4 := range []bool{true, false} {
		if ex, ok := b.addrSet(setOutExclude, v4, s.ExcludeOutboundCIDRs); ok {
			t.add(scOutput, ex, Counter(), Return())
		}
	}
	if set := b.portSet(setOutIncludePorts, s.OutboundPorts); set != "" {
		t.add(scOutput, DPortInSet(TCP, set), Counter(), Jump(scRedirect))
	}
	if s.OutboundAll {
		t.add(scOutput, Counter(), Jump(scRedirect))
		return
	}
	for _, v4 := range []bool{true, false} {
		if in, ok := b.addrSet(setOutInclude, v4, s.IncludeOutboundCIDRs); ok {
			t.add(scOutput, in, Counter(), Jump(scRedirect))
		}
	}
}
