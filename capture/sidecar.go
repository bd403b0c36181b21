package capture

import (
	"net/netip"
	"slices"

	"github.com/google/nftables"

	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
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
func Sidecar(s SidecarSpec) *nft.Ruleset {
	b := &sidecar{s: s, t: &nft.Table{Name: nft.PodTable}, tproxy: s.Mode == istio.ModeTProxy, fams: families(s.IPv6)}
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
	b.t.Add(scRedirect, nft.L4(nft.TCP), nft.Counter(), nft.Redirect(istio.SidecarOutboundPort))
	b.t.Add(scInRedirect, nft.L4(nft.TCP), nft.Counter(), nft.Redirect(istio.SidecarInboundPort))
	b.outboundFirst()
	b.outboundOwners()
	// DNS before the loopback return, so that a resolver on 127.0.0.1 is
	// captured too.
	if s.DNSCapture {
		b.dns()
	}
	b.outboundDestinations()

	rs := &nft.Ruleset{Tables: []*nft.Table{b.t}}
	if s.IPv6 {
		// The proxy's IPv6 inbound passthrough source: IPv6 gives lo only
		// ::1/128, so ::6 must be added for the proxy to bind it (as
		// Istio's capture does).
		rs.LoopbackAddrs = []netip.Prefix{inboundPassthrough6}
	}
	if b.tproxy && captureIn { // Istio routes marked packets only when it captures inbound
		for _, v4 := range b.fams {
			rs.Routes = append(rs.Routes, nft.Route{Mark: istio.TProxyMark, Mask: 0xffffffff, Table: istio.TProxyRouteTable, Priority: istio.RulePriority, V6: !v4})
		}
	}
	return rs
}

// sidecar is one sidecar ruleset being built.
type sidecar struct {
	s      SidecarSpec
	t      *nft.Table
	tproxy bool
	fams   []bool // true: IPv4
}

func (b *sidecar) bases() {
	t, s := b.t, b.s
	t.Base(natPre, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, prioNAT)
	t.Base(natOut, nftables.ChainTypeNAT, nftables.ChainHookOutput, prioNAT)
	if b.tproxy || s.DropInvalid {
		t.Base(manglePre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioMangle)
	}
	if b.tproxy {
		t.Base(mangleOut, nftables.ChainTypeRoute, nftables.ChainHookOutput, prioMangle)
	}
	if s.DNSCapture {
		t.Base(rawPre, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, prioRaw)
		t.Base(rawOut, nftables.ChainTypeFilter, nftables.ChainHookOutput, prioRaw)
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
func (b *sidecar) addrSet(name string, v4 bool, pfxs []netip.Prefix) (nft.Term, bool) {
	fam := "-v4"
	if !v4 {
		fam = "-v6"
	}
	set := nft.PrefixSet(name+fam, !v4, pfxs)
	if len(set.Elements) == 0 || !v4 && !b.s.IPv6 {
		return nil, false
	}
	if !slices.ContainsFunc(b.t.Sets, func(x *nft.Set) bool { return x.Name == set.Name }) {
		b.t.Sets = append(b.t.Sets, set)
	}
	return nft.AddrInSet(false, v4, set.Name), true
}

// portSet is the name of a port list's set; "" for an empty list.
func (b *sidecar) portSet(name string, ports []uint16) string {
	if len(ports) == 0 {
		return ""
	}
	if !slices.ContainsFunc(b.t.Sets, func(x *nft.Set) bool { return x.Name == name }) {
		b.t.Sets = append(b.t.Sets, nft.PortSet(name, ports))
	}
	return name
}

// interfaces: excluded interfaces are left alone, rerouted ones are
// outbound traffic; invalid packets dropped.
func (b *sidecar) interfaces() {
	t, s := b.t, b.s
	for _, x := range s.ExcludeInterfaces {
		t.Add(natPre, nft.IfName(true, nft.Eq, x), nft.Counter(), nft.Return())
		t.Add(natOut, nft.IfName(false, nft.Eq, x), nft.Counter(), nft.Return())
		if b.tproxy {
			t.Add(manglePre, nft.IfName(true, nft.Eq, x), nft.Counter(), nft.Return())
			t.Add(mangleOut, nft.IfName(false, nft.Eq, x), nft.Counter(), nft.Return())
		}
	}
	for _, v := range s.RerouteInterfaces {
		if s.OutboundAll {
			t.Add(natPre, nft.IfName(true, nft.Eq, v), nft.Counter(), nft.Jump(scRedirect))
		} else {
			for _, v4 := range []bool{true, false} {
				if in, ok := b.addrSet(setOutInclude, v4, s.IncludeOutboundCIDRs); ok {
					t.Add(natPre, nft.IfName(true, nft.Eq, v), in, nft.Counter(), nft.Jump(scRedirect))
				}
			}
		}
		t.Add(natPre, nft.IfName(true, nft.Eq, v), nft.Counter(), nft.Return())
	}
	if s.DropInvalid {
		t.Add(manglePre, nft.L4(nft.TCP), nft.CtState("invalid"), nft.Counter(), nft.Jump(scDrop))
		t.Add(scDrop, nft.Counter(), nft.Drop())
	}
}

// inboundRedirect captures inbound TCP with REDIRECT to 15006.
func (b *sidecar) inboundRedirect() {
	t, s := b.t, b.s
	t.Add(natPre, nft.L4(nft.TCP), nft.Counter(), nft.Jump(scInbound))
	t.Add(scInbound, nft.DPort(nft.TCP, nft.Eq, istio.HBONEPort), nft.Counter(), nft.Return())
	if s.InboundAll {
		if set := b.portSet(setInExclude, s.ExcludeInboundPorts); set != "" {
			t.Add(scInbound, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Return())
		}
		t.Add(scInbound, nft.L4(nft.TCP), nft.Counter(), nft.Jump(scInRedirect))
	} else if set := b.portSet(setInInclude, s.InboundPorts); set != "" {
		t.Add(scInbound, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Jump(scInRedirect))
	}
}

// inboundTProxy captures inbound TCP with TPROXY to 15006, marking it.
func (b *sidecar) inboundTProxy() {
	t, s := b.t, b.s
	t.Add(scDivert, nft.Counter(), nft.SetMark(istio.TProxyMark))
	t.Add(scDivert, nft.Counter(), nft.Accept())
	for _, v4 := range b.fams {
		t.Add(scTProxy, nft.L4(nft.TCP), nft.Addr(false, nft.Neq, loopback(v4)), nft.TProxy(v4, istio.SidecarInboundPort), nft.SetMark(istio.TProxyMark), nft.Counter(), nft.Accept())
	}
	t.Add(manglePre, nft.L4(nft.TCP), nft.Counter(), nft.Jump(scMangleIn))
	t.Add(scMangleIn, nft.L4(nft.TCP), nft.Mark(nft.Eq, 0, istio.TProxyMark), nft.Counter(), nft.Return())
	for _, v4 := range b.fams {
		t.Add(scMangleIn, nft.IfName(true, nft.Eq, "lo"), nft.L4(nft.TCP), nft.Addr(true, nft.Eq, passthrough(v4)), nft.Counter(), nft.Return())
	}
	t.Add(scMangleIn, nft.IfName(true, nft.Eq, "lo"), nft.L4(nft.TCP), nft.Mark(nft.Neq, 0, istio.TProxyLocalMark), nft.Counter(), nft.Return())
	// No return for HBONE's 15008 here: both of Istio's backends keep
	// it in the nat inbound chain only, which TPROXY mode never jumps
	// to, so TPROXY captures 15008 like any other port.
	if s.InboundAll {
		if set := b.portSet(setInExclude, s.ExcludeInboundPorts); set != "" {
			t.Add(scMangleIn, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Return())
		}
		t.Add(scMangleIn, nft.L4(nft.TCP), nft.CtState("established", "related"), nft.Counter(), nft.Jump(scDivert))
		t.Add(scMangleIn, nft.L4(nft.TCP), nft.Counter(), nft.Jump(scTProxy))
	} else if set := b.portSet(setInInclude, s.InboundPorts); set != "" {
		t.Add(scMangleIn, nft.DPortInSet(nft.TCP, set), nft.CtState("established", "related"), nft.Counter(), nft.Jump(scDivert))
		t.Add(scMangleIn, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Jump(scTProxy))
	}
}

// tproxyMarks carries TPROXY's mark through conntrack, and marks the
// proxy's own connections to its pod over lo.
func (b *sidecar) tproxyMarks() {
	t, s := b.t, b.s
	t.Add(manglePre, nft.L4(nft.TCP), nft.Mark(nft.Eq, 0, istio.TProxyMark), nft.Counter(), nft.SetCtMarkFromMark())
	t.Add(mangleOut, nft.IfName(false, nft.Eq, "lo"), nft.L4(nft.TCP), nft.Mark(nft.Eq, 0, istio.TProxyMark), nft.Counter(), nft.Return())
	for _, id := range []nft.Term{nft.SkUID(nft.Eq, s.ProxyUID), nft.SkGID(nft.Eq, s.ProxyGID)} {
		for _, v4 := range b.fams {
			t.Add(mangleOut, nft.IfName(false, nft.Eq, "lo"), nft.L4(nft.TCP), nft.Addr(false, nft.Neq, loopback(v4)), id, nft.Counter(), nft.SetMark(istio.TProxyLocalMark))
		}
	}
	t.Add(mangleOut, nft.L4(nft.TCP), nft.CtMark(nft.Eq, 0, istio.TProxyMark), nft.Counter(), nft.SetMarkFromCt())
}

// outboundFirst: the output chain, excluded ports and the proxy's inbound
// passthrough source.
func (b *sidecar) outboundFirst() {
	t, s := b.t, b.s
	t.Add(natOut, nft.Counter(), nft.Jump(scOutput))
	if set := b.portSet(setOutExcludePorts, s.ExcludeOutboundPorts); set != "" {
		t.Add(scOutput, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Return())
		t.Add(scOutput, nft.DPortInSet(nft.UDP, set), nft.Counter(), nft.Return())
	}
	for _, v4 := range b.fams {
		t.Add(scOutput, nft.IfName(false, nft.Eq, "lo"), nft.Addr(true, nft.Eq, passthrough(v4)), nft.Counter(), nft.Return())
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
		eq, neq nft.Term
	}{{nft.SkUID(nft.Eq, s.ProxyUID), nft.SkUID(nft.Neq, s.ProxyUID)}, {nft.SkGID(nft.Eq, s.ProxyGID), nft.SkGID(nft.Neq, s.ProxyGID)}}
	for _, o := range owners {
		for _, v4 := range b.fams {
			r := []nft.Term{nft.IfName(false, nft.Eq, "lo"), nft.Addr(false, nft.Neq, loopback(v4)), nft.DPort(nft.TCP, nft.Neq, istio.HBONEPort)}
			if s.DNSCapture {
				r = append(r, nft.DPort(nft.TCP, nft.Neq, 53))
			}
			t.Add(scOutput, append(r, o.eq, nft.Counter(), nft.Jump(scInRedirect))...)
		}
		switch {
		case includesLoopback:
		case s.DNSCapture:
			t.Add(scOutput, nft.IfName(false, nft.Eq, "lo"), nft.DPort(nft.TCP, nft.Neq, 53), o.neq, nft.Counter(), nft.Return())
		default:
			t.Add(scOutput, nft.IfName(false, nft.Eq, "lo"), o.neq, nft.Counter(), nft.Return())
		}
		t.Add(scOutput, o.eq, nft.Counter(), nft.Return())
	}
}

// dns redirects DNS to the proxy's 15053 and splits its conntrack zones.
func (b *sidecar) dns() {
	t, s := b.t, b.s
	t.Add(scOutput, nft.Counter(), nft.Jump(scOutputDNS))
	t.Add(scOutputDNS, nft.DPort(nft.TCP, nft.Eq, 53), nft.Counter(), nft.Redirect(istio.DNSCapturePort))
	t.Add(scOutputDNS, nft.DPort(nft.UDP, nft.Eq, 53), nft.Counter(), nft.Redirect(istio.DNSCapturePort))
	t.Add(rawOut, nft.Counter(), nft.Jump(scRawDNS))
	t.Add(scRawDNS, nft.DPort(nft.UDP, nft.Eq, 53), nft.SkUID(nft.Eq, s.ProxyUID), nft.Counter(), nft.SetCtZone(1))
	t.Add(scRawDNS, nft.SPort(nft.UDP, nft.Eq, istio.DNSCapturePort), nft.SkUID(nft.Eq, s.ProxyUID), nft.Counter(), nft.SetCtZone(2))
	t.Add(scRawDNS, nft.DPort(nft.UDP, nft.Eq, 53), nft.SkGID(nft.Eq, s.ProxyGID), nft.Counter(), nft.SetCtZone(1))
	t.Add(scRawDNS, nft.SPort(nft.UDP, nft.Eq, istio.DNSCapturePort), nft.SkGID(nft.Eq, s.ProxyGID), nft.Counter(), nft.SetCtZone(2))
	t.Add(scRawDNS, nft.DPort(nft.UDP, nft.Eq, 53), nft.Counter(), nft.SetCtZone(2))
	t.Add(rawPre, nft.Counter(), nft.Jump(scRawIn))
	t.Add(scRawIn, nft.SPort(nft.UDP, nft.Eq, 53), nft.Counter(), nft.SetCtZone(1))
}

// outboundDestinations: loopback and excluded ranges are left alone;
// included ports, then all or the included ranges, go to 15001.
func (b *sidecar) outboundDestinations() {
	t, s := b.t, b.s
	for _, v4 := range b.fams {
		t.Add(scOutput, nft.Addr(false, nft.Eq, loopback(v4)), nft.Counter(), nft.Return())
	}
	for _, v4 := range []bool{true, false} {
		if ex, ok := b.addrSet(setOutExclude, v4, s.ExcludeOutboundCIDRs); ok {
			t.Add(scOutput, ex, nft.Counter(), nft.Return())
		}
	}
	if set := b.portSet(setOutIncludePorts, s.OutboundPorts); set != "" {
		t.Add(scOutput, nft.DPortInSet(nft.TCP, set), nft.Counter(), nft.Jump(scRedirect))
	}
	if s.OutboundAll {
		t.Add(scOutput, nft.Counter(), nft.Jump(scRedirect))
		return
	}
	for _, v4 := range []bool{true, false} {
		if in, ok := b.addrSet(setOutInclude, v4, s.IncludeOutboundCIDRs); ok {
			t.Add(scOutput, in, nft.Counter(), nft.Jump(scRedirect))
		}
	}
}
