//go:build !unit

package capture

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

const wait = 2 * time.Second

// ztunnelStandIn opens listeners in the pod netns on the ports the rules
// redirect to, the way ztunnel does after it receives the pod's netns.
type ztunnelStandIn struct {
	out, in, hbone, dnsTCP net.Listener
	dnsUDP                 net.PacketConn
}

func standIn(t *testing.T, pod *testnet.NS, transparent bool) *ztunnelStandIn {
	return &ztunnelStandIn{
		out:    pod.Listen(t, ":15001", false),
		in:     pod.Listen(t, ":15006", transparent),
		hbone:  pod.Listen(t, ":15008", false),
		dnsTCP: pod.Listen(t, ":15053", false),
		dnsUDP: pod.ListenUDP(t, ":15053"),
	}
}

func hostport(a netip.Addr, port int) string { return netip.AddrPortFrom(a, uint16(port)).String() }

// mustLand dials from ns to addr and requires the connection on ln.
func mustLand(t *testing.T, from *testnet.NS, addr string, o testnet.DialOpts, ln net.Listener, what string) *testnet.Accepted {
	t.Helper()
	if _, err := from.Dial(t, "tcp", addr, o); err != nil {
		t.Fatalf("%s: dial %s: %v", what, addr, err)
	}
	a, err := testnet.Accept(t, ln, wait)
	if err != nil {
		t.Fatalf("%s: connection to %s did not land on %s: %v", what, addr, ln.Addr(), err)
	}
	return a
}

func TestAmbientTraffic(t *testing.T) {
	testnet.RequireRoot(t)
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("ipv6=%v", v6), func(t *testing.T) {
			p := testnet.NewPair(t, 10)
			nodeIP, podIP := p.NodeIP4, p.PodIP4
			if v6 {
				nodeIP, podIP = p.NodeIP6, p.PodIP6
			}
			if err := nft.Apply(p.Pod.FD, Ambient(AmbientSpec{DNSCapture: true, IPv6: true})); err != nil {
				t.Fatal(err)
			}
			z := standIn(t, p.Pod, false)
			app := p.Pod.Listen(t, ":8080", false)
			upstream := p.Node.Listen(t, ":8080", false)

			// Outbound TCP lands on 15001 with the original destination kept.
			a := mustLand(t, p.Pod, hostport(nodeIP, 80), testnet.DialOpts{}, z.out, "outbound")
			if a.OrigDst != netip.AddrPortFrom(nodeIP, 80) {
				t.Errorf("outbound original dst = %v, want %s", a.OrigDst, hostport(nodeIP, 80))
			}
			// Inbound lands on 15006, original destination the app's port.
			a = mustLand(t, p.Node, hostport(podIP, 8080), testnet.DialOpts{}, z.in, "inbound")
			if a.OrigDst != netip.AddrPortFrom(podIP, 8080) {
				t.Errorf("inbound original dst = %v", a.OrigDst)
			}
			// HBONE passes straight to 15008.
			a = mustLand(t, p.Node, hostport(podIP, 15008), testnet.DialOpts{}, z.hbone, "hbone")
			if a.OrigDst != a.Local {
				t.Errorf("HBONE was NATed (original dst %v, local %v)", a.OrigDst, a.Local)
			}
			// ztunnel's own sockets (mark 0x539) bypass capture.
			mustLand(t, p.Pod, hostport(nodeIP, 8080), testnet.DialOpts{Mark: istio.ZtunnelMark}, upstream, "ztunnel-marked outbound")
			// DNS over TCP and UDP lands on 15053.
			mustLand(t, p.Pod, hostport(nodeIP, 53), testnet.DialOpts{}, z.dnsTCP, "dns over tcp")
			if _, err := p.Pod.Dial(t, "udp", hostport(nodeIP, 53), testnet.DialOpts{}); err != nil {
				t.Fatal(err)
			}
			_ = z.dnsUDP.SetReadDeadline(time.Now().Add(wait))
			buf := make([]byte, 16)
			if n, _, err := z.dnsUDP.ReadFrom(buf); err != nil || string(buf[:n]) != "hello\n" {
				t.Errorf("dns over udp did not land on 15053: %v", err)
			}
			// Nothing reached the app or the upstream directly.
			if _, err := testnet.Accept(t, app, 100*time.Millisecond); err == nil {
				t.Error("inbound reached the app directly")
			}
		})
	}
}

// TestProbeSourceIsNotCaptured: kubelet's SNATed probe source reaches the app.
func TestProbeSourceIsNotCaptured(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 11)
	testnet.IP(t, "-n", p.Node.Name, "addr", "add", istio.ProbeSNATv4+"/32", "dev", p.NodeIfc)
	testnet.IP(t, "-n", p.Node.Name, "addr", "add", istio.ProbeSNATv6+"/128", "dev", p.NodeIfc, "nodad")
	testnet.IP(t, "-n", p.Pod.Name, "route", "add", istio.ProbeSNATv4, "dev", p.PodIfc)
	if err := nft.Apply(p.Pod.FD, Ambient(AmbientSpec{DNSCapture: true, IPv6: true})); err != nil {
		t.Fatal(err)
	}
	standIn(t, p.Pod, false)
	app := p.Pod.Listen(t, ":8080", false)
	a := mustLand(t, p.Node, hostport(p.PodIP4, 8080), testnet.DialOpts{Source: ProbeSNATv4}, app, "probe v4")
	if a.Remote.Addr() != ProbeSNATv4 {
		t.Errorf("probe arrived from %v", a.Remote)
	}
	mustLand(t, p.Node, hostport(p.PodIP6, 8080), testnet.DialOpts{Source: ProbeSNATv6}, app, "probe v6")
}

func TestIngressBypass(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 12)
	if err := nft.Apply(p.Pod.FD, Ambient(AmbientSpec{DNSCapture: true, IPv6: true, IngressBypass: true})); err != nil {
		t.Fatal(err)
	}
	z := standIn(t, p.Pod, false)
	app := p.Pod.Listen(t, ":8080", false)
	mustLand(t, p.Node, hostport(p.PodIP4, 8080), testnet.DialOpts{}, app, "inbound with bypass")
	mustLand(t, p.Node, hostport(p.PodIP6, 8080), testnet.DialOpts{}, app, "inbound v6 with bypass")
	mustLand(t, p.Pod, hostport(p.NodeIP4, 80), testnet.DialOpts{}, z.out, "outbound still captured")
}

func TestSidecarRedirectTraffic(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 13)
	spec, err := ParseSidecar(map[string]string{
		istio.AnnExcludeOutboundCIDRs: p.NodeIP4.String() + "/32",
		istio.AnnExcludeOutboundPorts: "15020,5432",
	}, SidecarProxy{IPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Apply(p.Pod.FD, Sidecar(spec)); err != nil {
		t.Fatal(err)
	}
	envoyOut := p.Pod.Listen(t, ":15001", false)
	envoyIn := p.Pod.Listen(t, ":15006", false)
	health := p.Pod.Listen(t, ":15021", false)
	upstream := p.Node.Listen(t, ":5432", false)
	upstream80 := p.Node.Listen(t, ":80", false)

	a := mustLand(t, p.Node, hostport(p.PodIP4, 8080), testnet.DialOpts{}, envoyIn, "inbound")
	if a.OrigDst != netip.AddrPortFrom(p.PodIP4, 8080) {
		t.Errorf("inbound original dst %v", a.OrigDst)
	}
	mustLand(t, p.Node, hostport(p.PodIP4, 15021), testnet.DialOpts{}, health, "excluded inbound port")
	a = mustLand(t, p.Pod, hostport(p.NodeIP6, 80), testnet.DialOpts{}, envoyOut, "outbound v6")
	if a.OrigDst != netip.AddrPortFrom(p.NodeIP6, 80) {
		t.Errorf("outbound original dst %v", a.OrigDst)
	}
	mustLand(t, p.Pod, hostport(p.NodeIP6, 5432), testnet.DialOpts{}, upstream, "excluded outbound port")
	mustLand(t, p.Pod, hostport(p.NodeIP4, 80), testnet.DialOpts{}, upstream80, "excluded outbound CIDR")
}

// TestSidecarTProxyKeepsDestination: with TPROXY the accepted socket's local
// address is the address the client dialled; nothing is NATed.
func TestSidecarTProxyKeepsDestination(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 14)
	spec, err := ParseSidecar(map[string]string{istio.AnnInterceptionMode: istio.ModeTProxy}, SidecarProxy{IPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Apply(p.Pod.FD, Sidecar(spec)); err != nil {
		t.Fatal(err)
	}
	envoyIn := p.Pod.Listen(t, ":15006", true)
	for _, ip := range []netip.Addr{p.PodIP4, p.PodIP6} {
		a := mustLand(t, p.Node, hostport(ip, 8080), testnet.DialOpts{}, envoyIn, "tproxy inbound")
		if a.Local != netip.AddrPortFrom(ip, 8080) {
			t.Errorf("tproxy local address %v, want %s", a.Local, hostport(ip, 8080))
		}
		if a.OrigDst != a.Local {
			t.Errorf("tproxy connection was NATed: original dst %v, local %v", a.OrigDst, a.Local)
		}
	}
}

// TestHostProbeSNAT: connections from the host netns to an enrolled pod IP
// arrive from 169.254.7.127; to a pod that is not enrolled, from the node IP.
func TestHostProbeSNAT(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 15)
	uid := "uid-enrolled"
	if err := nft.Apply(p.Node.FD, HostProbe(HostSpec{IPv6: true}, nil)); err != nil {
		t.Fatal(err)
	}
	app := p.Pod.Listen(t, ":8080", false)
	check := func(ip netip.Addr, want netip.Addr, what string) {
		t.Helper()
		a := mustLand(t, p.Node, hostport(ip, 8080), testnet.DialOpts{}, app, what)
		if a.Remote.Addr() != want {
			t.Errorf("%s: source %v, want %v", what, a.Remote.Addr(), want)
		}
	}
	check(p.PodIP4, p.NodeIP4, "not enrolled v4")
	ps, err := nft.OpenProbeSet(p.Node.FD)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	if err := ps.Update(nil, []nft.Element{{Addr: p.PodIP4, Comment: uid}, {Addr: p.PodIP6, Comment: uid}}); err != nil {
		t.Fatal(err)
	}
	check(p.PodIP4, ProbeSNATv4, "enrolled v4")
	check(p.PodIP6, ProbeSNATv6, "enrolled v6")
	want := HostProbe(HostSpec{IPv6: true}, []nft.Member{{UID: uid, IPs: []netip.Addr{p.PodIP4, p.PodIP6}}})
	if err := nft.Verify(p.Node.FD, want); err != nil {
		t.Fatalf("host table after add: %v", err)
	}
	owners, ok, err := ps.Elements()
	if err != nil || !ok || owners[p.PodIP4] != uid || owners[p.PodIP6] != uid || len(owners) != 2 {
		t.Errorf("Elements = %v %v %v", owners, ok, err)
	}
	if err := ps.Update([]netip.Addr{p.PodIP4, p.PodIP6}, nil); err != nil {
		t.Fatal(err)
	}
	check(p.PodIP4, p.NodeIP4, "removed v4")
	if err := nft.Verify(p.Node.FD, HostProbe(HostSpec{IPv6: true}, nil)); err != nil {
		t.Fatalf("host table after remove: %v", err)
	}
}

// TestCaptureWithIptablesPresent: iptables-nft and iptables-legacy rules in
// the same netns do not stop our capture.
func TestCaptureWithIptablesPresent(t *testing.T) {
	testnet.RequireRoot(t)
	p := testnet.NewPair(t, 16)
	if len(addIptables(t, p.Pod)) == 0 {
		t.Skip("no iptables installed")
	}
	if err := nft.Apply(p.Pod.FD, Ambient(AmbientSpec{DNSCapture: true, IPv6: true})); err != nil {
		t.Fatal(err)
	}
	z := standIn(t, p.Pod, false)
	mustLand(t, p.Pod, hostport(p.NodeIP4, 80), testnet.DialOpts{}, z.out, "outbound with iptables present")
	mustLand(t, p.Node, hostport(p.PodIP4, 8080), testnet.DialOpts{}, z.in, "inbound with iptables present")
}
