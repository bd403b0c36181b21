package conformance

import (
	"fmt"
	"net/netip"

	"github.com/nftcni/nftcni/istio"
)

// Identity is who owns a probe's socket.
type Identity struct {
	Name     string
	UID, GID uint32
	Mark     uint32
}

// AppID is an ordinary application's identity.
const AppID = 1000

// Identities are the owners the matrix probes as: the app, the proxy by
// its UID alone, by its GID alone and by both, ztunnel (its mark), and
// root.
func Identities(proxyUID, proxyGID uint32) []Identity {
	return []Identity{
		{Name: "app", UID: AppID, GID: AppID},
		{Name: "proxy", UID: proxyUID, GID: proxyGID},
		{Name: "proxy-uid", UID: proxyUID, GID: AppID},
		{Name: "proxy-gid", UID: AppID, GID: proxyGID},
		{Name: "ztunnel", Mark: istio.ZtunnelMark},
		{Name: "root"},
	}
}

// OutboundPorts are the ports outbound probes go to beyond port 80: DNS,
// Istio's own and the ones its configurations include or exclude.
var OutboundPorts = []uint16{53, 443, 5555, 6666, 15001, 15006, 15008, 15020, 15021, 15090, 31000, 32000}

// InboundPorts are the pod's ports probed from the node.
var InboundPorts = []uint16{53, 80, 1111, 2222, 3333, 4000, 5000, 5555, 6000, 7000, 8080,
	15001, 15006, 15008, 15020, 15021, 15053, 15090, 31000, 32000}

// Matrix is the probe set for a pod of shape s whose proxy runs as
// proxyUID/proxyGID. Both twins of a case get the same one.
func Matrix(s Shape, proxyUID, proxyGID uint32) []Probe {
	var ps []Probe
	ids := Identities(proxyUID, proxyGID)
	add := func(p Probe) { ps = append(ps, p) }
	ap := func(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

	// Outbound, every identity, port 80, to every kind of destination.
	dests := []netip.Addr{NodeIP4, PodIP4, netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.1.2.3"), netip.MustParseAddr("127.0.0.53")}
	dests = append(dests, Outside4...)
	if s.IPv6 {
		dests = append(dests, NodeIP6, PodIP6, netip.MustParseAddr("::1"))
		dests = append(dests, Outside6...)
	}
	for i := range s.Secondary {
		_, far := SecondaryIPs(i, false)
		dests = append(dests, far)
		if s.IPv6 {
			_, far6 := SecondaryIPs(i, true)
			dests = append(dests, far6)
		}
	}
	for _, id := range ids {
		for _, d := range dests {
			add(Probe{Name: fmt.Sprintf("out tcp %s -> %s", id.Name, ap(d, 80)), From: "pod", Proto: "tcp",
				Dst: ap(d, 80), UID: id.UID, GID: id.GID, Mark: id.Mark})
		}
	}
	// Outbound to the special ports: the app and the proxy, to a remote
	// address, to the node and over loopback to the pod itself.
	portDests := []netip.Addr{NodeIP4, netip.MustParseAddr("192.0.2.10"), PodIP4, netip.MustParseAddr("127.0.0.1")}
	if s.IPv6 {
		portDests = append(portDests, NodeIP6, netip.MustParseAddr("2001:db8::10"), PodIP6, netip.MustParseAddr("::1"))
	}
	for _, id := range ids[:2] {
		for _, d := range portDests {
			for _, port := range append([]uint16{8080}, OutboundPorts...) {
				add(Probe{Name: fmt.Sprintf("out tcp %s -> %s", id.Name, ap(d, port)), From: "pod", Proto: "tcp",
					Dst: ap(d, port), UID: id.UID, GID: id.GID})
			}
		}
	}
	// DNS over UDP: every identity, to the node, to a remote server and to
	// a pod-local resolver.
	udpDests := []netip.Addr{NodeIP4, netip.MustParseAddr("9.9.9.9"), netip.MustParseAddr("127.0.0.53")}
	if s.IPv6 {
		udpDests = append(udpDests, NodeIP6, netip.MustParseAddr("::1"))
	}
	for _, id := range ids {
		for _, d := range udpDests {
			add(Probe{Name: fmt.Sprintf("out udp %s -> %s", id.Name, ap(d, 53)), From: "pod", Proto: "udp",
				Dst: ap(d, 53), UID: id.UID, GID: id.GID, Mark: id.Mark})
		}
	}
	// The proxy's inbound passthrough source (127.0.0.6, ::6) towards the
	// app, as the proxy and as the app.
	for _, id := range ids[:2] {
		add(Probe{Name: fmt.Sprintf("out tcp %s 127.0.0.6 -> %s", id.Name, ap(PodIP4, 8080)), From: "pod", Proto: "tcp",
			Dst: ap(PodIP4, 8080), Src: netip.MustParseAddr("127.0.0.6"), UID: id.UID, GID: id.GID})
		if s.IPv6 {
			add(Probe{Name: fmt.Sprintf("out tcp %s ::6 -> %s", id.Name, ap(PodIP6, 8080)), From: "pod", Proto: "tcp",
				Dst: ap(PodIP6, 8080), Src: netip.MustParseAddr("::6"), UID: id.UID, GID: id.GID})
		}
	}

	// Inbound from the node to every port class.
	inDests := []netip.Addr{PodIP4}
	if s.IPv6 {
		inDests = append(inDests, PodIP6)
	}
	for _, d := range inDests {
		for _, port := range InboundPorts {
			add(Probe{Name: fmt.Sprintf("in tcp node -> %s", ap(d, port)), From: "node", Proto: "tcp", Dst: ap(d, port)})
		}
		// A segment conntrack calls invalid.
		add(Probe{Name: fmt.Sprintf("in invalid node -> %s", ap(d, 8080)), From: "node", Proto: "invalid", Dst: ap(d, 8080)})
		add(Probe{Name: fmt.Sprintf("in udp node -> %s", ap(d, 53)), From: "node", Proto: "udp", Dst: ap(d, 53)})
	}
	// From the probe SNAT sources (kubelet's probes) and with ztunnel's mark.
	for _, src := range ProbeSources {
		d := PodIP4
		if src.Is6() {
			if !s.IPv6 {
				continue
			}
			d = PodIP6
		}
		for _, port := range []uint16{8080, 15008} {
			add(Probe{Name: fmt.Sprintf("in tcp %s -> %s", src, ap(d, port)), From: "node", Proto: "tcp", Dst: ap(d, port), Src: src})
		}
	}
	// Secondary interfaces: to the pod's address there, and through the
	// pod to elsewhere (a VM behind a virtual interface).
	for i := range s.Secondary {
		from := fmt.Sprintf("side%d", i)
		for _, v6 := range []bool{false, true} {
			if v6 && !s.IPv6 {
				continue
			}
			pod, _ := SecondaryIPs(i, v6)
			far := netip.MustParseAddr("9.9.9.9")
			if v6 {
				far = netip.MustParseAddr("2001:db8::10")
			}
			for _, d := range []netip.AddrPort{ap(pod, 8080), ap(pod, 15008), ap(far, 80), ap(PodIP4, 8080)} {
				if v6 && d.Addr() == PodIP4 {
					d = ap(PodIP6, 8080)
				}
				add(Probe{Name: fmt.Sprintf("in tcp %s -> %s", from, d), From: from, Proto: "tcp", Dst: d})
			}
		}
	}
	return ps
}
