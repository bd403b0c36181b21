package conformance

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
)

// kubeletUID is the kubelet UID in istio-cni's host test configuration
// (its nftables golden matches `skuid 1000`; the test checks it).
const kubeletUID = 1000

// notEnrolled4 and notEnrolled6 are the pod's second addresses, outside
// the probe set: a pod that is not in the mesh.
var (
	notEnrolled4 = netip.MustParseAddr("10.244.1.6")
	notEnrolled6 = netip.MustParseAddr("fd00:244:1::6")
)

// hostProbes are connections from the node to the pod: as kubelet, as
// another local process (root, and another user), to an enrolled address
// and to one that is not.
func hostProbes(v6 bool) []Probe {
	var ps []Probe
	dsts := []netip.Addr{PodIP4, notEnrolled4}
	if v6 {
		dsts = append(dsts, PodIP6, notEnrolled6)
	}
	for _, who := range []struct {
		name string
		uid  uint32
	}{{"kubelet", kubeletUID}, {"root", 0}, {"user", 4242}} {
		for _, d := range dsts {
			for _, port := range []uint16{8080, 15021} {
				dst := netip.AddrPortFrom(d, port)
				ps = append(ps, Probe{Name: fmt.Sprintf("host tcp %s -> %s", who.name, dst), From: "node", Proto: "tcp", Dst: dst, UID: who.uid, GID: who.uid})
			}
		}
		d := netip.AddrPortFrom(PodIP4, 53)
		ps = append(ps, Probe{Name: fmt.Sprintf("host udp %s -> %s", who.name, d), From: "node", Proto: "udp", Dst: d, UID: who.uid, GID: who.uid})
	}
	return ps
}

// hostTwin gives the pod a second address that is not enrolled.
func hostTwin(t testing.TB, tw *Twin) {
	cmds := []string{fmt.Sprintf("-n %s addr add %s/24 dev eth0", tw.Pod.Name, notEnrolled4)}
	if tw.Shape.IPv6 {
		cmds = append(cmds, fmt.Sprintf("-n %s addr add %s/64 dev eth0 nodad", tw.Pod.Name, notEnrolled6))
	}
	ipBatch(t, cmds)
	mac := testnet.MAC(t, tw.Pod, "eth0")
	var neigh []string
	for _, a := range []netip.Addr{notEnrolled4, notEnrolled6} {
		if a.Is4() || tw.Shape.IPv6 {
			neigh = append(neigh, fmt.Sprintf("-n %s neigh replace %s lladdr %s dev %s nud permanent", tw.Node.Name, a, mac, tw.NodeVeth))
		}
	}
	ipBatch(t, neigh)
}

// istioHostNft loads Istio's nftables host golden into the node netns,
// with the sets istio-cni makes beside it (cni/pkg/nftables host_sets.go)
// holding the enrolled pod's addresses.
func istioHostNft(t testing.TB, tw *Twin, golden string, v6 bool) {
	sets := "add table inet istio-ambient-nat\n" +
		"add set inet istio-ambient-nat istio-inpod-probes-v4 { type ipv4_addr; comment \"UUID of the pods that are part of ambient mesh\"; }\n" +
		fmt.Sprintf("add element inet istio-ambient-nat istio-inpod-probes-v4 { %s comment \"pod-uid\" }\n", PodIP4)
	if v6 {
		sets += "add set inet istio-ambient-nat istio-inpod-probes-v6 { type ipv6_addr; comment \"UUID of the pods that are part of ambient mesh\"; }\n" +
			fmt.Sprintf("add element inet istio-ambient-nat istio-inpod-probes-v6 { %s comment \"pod-uid\" }\n", PodIP6)
	}
	// The golden flushes the table, not its sets.
	execIn(t, tw.Node, sets+golden, "nft", "-f", "-")
}

// istioHostIptables makes the ipsets istio-cni's iptables backend uses
// (hash:ip with comments, through netlink as istio-cni does) and loads
// its host golden into the node netns.
func istioHostIptables(t testing.TB, tw *Twin, golden string, v6 bool) {
	h, err := netlink.NewHandleAt(netns.NsHandle(tw.Node.FD))
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, s := range []struct {
		name string
		fam  uint8
		ip   netip.Addr
	}{{"istio-inpod-probes-v4", unix.AF_INET, PodIP4}, {"istio-inpod-probes-v6", unix.AF_INET6, PodIP6}} {
		if s.fam == unix.AF_INET6 && !v6 {
			continue
		}
		if err := h.IpsetCreate(s.name, "hash:ip", netlink.IpsetCreateOptions{Comments: true, Family: s.fam, Replace: true}); err != nil {
			t.Fatalf("ipset %s: %v", s.name, err)
		}
		if err := h.IpsetAdd(s.name, &netlink.IPSetEntry{IP: net.IP(s.ip.AsSlice()), Comment: "pod-uid"}); err != nil {
			t.Fatalf("ipset %s add: %v", s.name, err)
		}
	}
	v4, v6part, err := SplitIptables(golden)
	if err != nil {
		t.Fatal(err)
	}
	execIn(t, tw.Node, v4, "iptables-restore", "--noflush")
	if v6 {
		execIn(t, tw.Node, v6part, "ip6tables-restore", "--noflush")
	}
}

// TestHostProbeGoldens compares nftcni's host probe table with istio-cni's
// host rules, both backends, IPv6 off and on: kubelet's probe to an
// enrolled pod is SNATed, a probe to a pod outside the mesh is not.
func TestHostProbeGoldens(t *testing.T) {
	testnet.RequireRoot(t)
	for _, backend := range []string{"nftables", "iptables"} {
		dir := filepath.Join(IstioModule(t), "cni", "pkg", backend, "testdata")
		for _, v6 := range []bool{false, true} {
			name := "hostprobe"
			if v6 {
				name += "_ipv6"
			}
			b, err := os.ReadFile(filepath.Join(dir, name+".golden"))
			if err != nil {
				t.Fatal(err)
			}
			golden := string(b)
			if backend == "nftables" && !strings.Contains(golden, fmt.Sprintf("skuid %d", kubeletUID)) {
				t.Fatalf("%s: kubelet is not UID %d in it any more", name, kubeletUID)
			}
			// Istio's host tests set the IPv6 SNAT address per backend: its
			// test address (nftables) or the default (iptables).
			var snat capture.ProbeSNAT
			switch {
			case !v6:
			case strings.Contains(golden, istioTestSNAT6.String()):
				snat.V6 = istioTestSNAT6
			case !strings.Contains(golden, capture.ProbeSNATv6.String()):
				t.Fatalf("%s SNATs to neither %s nor %s", name, istioTestSNAT6, capture.ProbeSNATv6)
			}
			c := Case{Name: backend + "/" + name, Shape: Shape{IPv6: true}, Only: hostProbes(true),
				Istio: func(t testing.TB, tw *Twin) {
					hostTwin(t, tw)
					if backend == "nftables" {
						istioHostNft(t, tw, golden, v6)
					} else {
						istioHostIptables(t, tw, golden, v6)
					}
				},
				Nftcni: func(t testing.TB, tw *Twin) {
					hostTwin(t, tw)
					members := []nft.Member{{UID: "pod-uid", IPs: []netip.Addr{PodIP4, PodIP6}}}
					if err := nft.Apply(tw.Node.FD, capture.HostProbe(capture.HostSpec{IPv6: v6, SNAT: snat}, members)); err != nil {
						t.Fatal(err)
					}
				}}
			if backend == "nftables" {
				c.Deliberate = func(p Probe) string {
					if p.UID != kubeletUID && (p.Dst.Addr() == PodIP4 || p.Dst.Addr() == PodIP6) && p.Proto == "tcp" {
						return "nftcni SNATs any local process's connection to an enrolled pod, as Istio's iptables backend (--socket-exists) does; Istio's nftables backend only kubelet's UID, found by a process name k3s and MicroK8s do not have (istio#58185)"
					}
					return ""
				}
			}
			t.Run(c.Name, func(t *testing.T) {
				r := Compare(t, c)
				// Istio's rules must SNAT kubelet's probe, or the case proves nothing.
				if f := r.IstioFates[fmt.Sprintf("host tcp kubelet -> %s", netip.AddrPortFrom(PodIP4, 8080))]; !strings.Contains(f, "src=169.254.7.127") {
					t.Errorf("Istio's host rules did not SNAT kubelet's probe: %s", f)
				}
			})
		}
	}
}
