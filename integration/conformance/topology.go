// Package conformance proves nftcni's capture against Istio's own: a pod
// netns holds Istio's rules (its goldens loaded with nft -f or
// iptables-restore, or what Istio's running agent and plugin made), a twin
// holds nftcni's for the same configuration, and the same probes go
// through both. A probe's fate is where it ended: which listener took the
// connection, with which original destination and source, or that it was
// refused or never answered. The two twins must agree probe by probe.
// Test-only: it runs ip, nft and iptables-restore.
package conformance

import (
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
)

// The addresses every twin has, so that fates read the same in both.
var (
	PodIP4  = netip.MustParseAddr("10.244.1.5")
	NodeIP4 = netip.MustParseAddr("10.244.1.1")
	PodIP6  = netip.MustParseAddr("fd00:244:1::5")
	NodeIP6 = netip.MustParseAddr("fd00:244:1::1")

	// Destinations the node answers on besides its own address: inside and
	// outside the ranges Istio's test configurations name (1.1.0.0/16,
	// 9.9.0.0/16, 10.0.0.0/8, 2001:db8::/32) and the probe SNAT sources of
	// both Istio's defaults and its test configurations.
	Outside4 = []netip.Addr{netip.MustParseAddr("9.9.9.9"), netip.MustParseAddr("1.1.1.1"),
		netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("192.0.2.10")}
	Outside6 = []netip.Addr{netip.MustParseAddr("2001:db8::10"), netip.MustParseAddr("2001:db9::10"),
		netip.MustParseAddr("fd00:96::10")}
	ProbeSources = []netip.Addr{netip.MustParseAddr("169.254.7.127"),
		netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff"),
		netip.MustParseAddr("e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164")}
)

// Shape is what a twin's pod looks like.
type Shape struct {
	// IPv6 gives the pod an IPv6 address beside its IPv4 one.
	IPv6 bool
	// Secondary names the pod's interfaces beside eth0 (a configuration's
	// excluded or virtual interfaces), each to a netns of its own.
	Secondary []string
}

func (s Shape) key() string { return fmt.Sprintf("%v/%s", s.IPv6, strings.Join(s.Secondary, ",")) }

// SecondaryIPs are the pod's and the far side's addresses on secondary
// interface i.
func SecondaryIPs(i int, v6 bool) (pod, side netip.Addr) {
	if v6 {
		return netip.MustParseAddr(fmt.Sprintf("fd00:168:%x::5", 10+i)), netip.MustParseAddr(fmt.Sprintf("fd00:168:%x::1", 10+i))
	}
	return netip.MustParseAddr(fmt.Sprintf("192.168.%d.5", 10+i)), netip.MustParseAddr(fmt.Sprintf("192.168.%d.1", 10+i))
}

// Twin is one pod with its node and the far sides of its secondary
// interfaces, every port of the matrix listened on everywhere.
type Twin struct {
	Name  string
	Shape Shape
	Pod   *testnet.NS
	Node  *testnet.NS
	// NodeVeth is the node's end of the pod's eth0.
	NodeVeth string
	Sides    []*testnet.NS
	reg      *registry
}

// PodPorts are the pod's TCP listeners: the proxy's and ztunnel's ports,
// Istio's own, and the application ports the configurations name.
var PodPorts = []uint16{15001, 15006, 15008, 15020, 15021, 15053, 15090,
	53, 80, 1111, 2222, 3333, 4000, 5000, 5555, 6000, 7000, 8080, 31000, 32000}

// NewTwin builds a twin on a node of its own; everything goes at test
// cleanup.
func NewTwin(t testing.TB, name string, s Shape) *Twin {
	t.Helper()
	return NewNode(t, name).AddPod(t, name, s)
}

// Node is a node netns that pods are added to one after another (an
// agent's host netns, in the live comparison): its addresses and
// listeners outlive each pod.
type Node struct {
	NS  *testnet.NS
	reg *registry
}

// NewNode makes a node netns with every destination address and listener.
func NewNode(t testing.TB, name string) *Node {
	t.Helper()
	n := &Node{NS: testnet.NewNS(t, "cfnode"), reg: newRegistry()}
	var cmds []string
	for _, a := range append(append(append([]netip.Addr{}, Outside4...), Outside6...), ProbeSources...) {
		cmds = append(cmds, fmt.Sprintf("-n %s addr add %s dev lo nodad", n.NS.Name, netip.PrefixFrom(a, a.BitLen())))
	}
	ipBatch(t, cmds)
	tw := &Twin{Name: name, Node: n.NS, reg: n.reg}
	for _, port := range NodePorts {
		tw.listenTCP(t, n.NS, "node", port)
	}
	tw.listenUDP(t, n.NS, "node", 53)
	return n
}

// AddPod adds a pod of shape s to the node, joined by a veth of its own
// that goes (synchronously, so that the next pod can take its addresses)
// when the test ends; there may be one pod at a time.
func (nd *Node) AddPod(t testing.TB, name string, s Shape) *Twin {
	t.Helper()
	tw := &Twin{Name: name, Shape: s, Node: nd.NS, reg: nd.reg}
	tw.Pod = testnet.NewNS(t, "cfpod")
	p, n := tw.Pod.Name, tw.Node.Name
	veth := "vp" + strings.TrimPrefix(p, "cfpod-")
	tw.NodeVeth = veth
	cmds := []string{
		fmt.Sprintf("link add %s netns %s type veth peer name eth0 netns %s", veth, n, p),
		fmt.Sprintf("-n %s addr add %s/24 dev eth0", p, PodIP4),
		fmt.Sprintf("-n %s link set eth0 up", p),
		fmt.Sprintf("-n %s route add default via %s", p, NodeIP4),
		fmt.Sprintf("-n %s addr add %s/24 dev %s", n, NodeIP4, veth),
		fmt.Sprintf("-n %s link set %s up", n, veth),
	}
	t.Cleanup(func() { _ = exec.Command("ip", "-n", n, "link", "del", veth).Run() })
	if s.IPv6 {
		cmds = append(cmds,
			fmt.Sprintf("-n %s addr add %s/64 dev eth0 nodad", p, PodIP6),
			fmt.Sprintf("-n %s -6 route add default via %s", p, NodeIP6),
			fmt.Sprintf("-n %s addr add %s/64 dev %s nodad", n, NodeIP6, veth))
	}
	for i, ifc := range s.Secondary {
		side := testnet.NewNS(t, "cfside")
		tw.Sides = append(tw.Sides, side)
		pod4, side4 := SecondaryIPs(i, false)
		cmds = append(cmds,
			fmt.Sprintf("link add peer netns %s type veth peer name %s netns %s", side.Name, ifc, p),
			fmt.Sprintf("-n %s addr add %s/24 dev %s", p, pod4, ifc),
			fmt.Sprintf("-n %s link set %s up", p, ifc),
			fmt.Sprintf("-n %s addr add %s/24 dev peer", side.Name, side4),
			fmt.Sprintf("-n %s link set peer up", side.Name),
			fmt.Sprintf("-n %s route add default via %s", side.Name, pod4))
		if s.IPv6 {
			pod6, side6 := SecondaryIPs(i, true)
			cmds = append(cmds,
				fmt.Sprintf("-n %s addr add %s/64 dev %s nodad", p, pod6, ifc),
				fmt.Sprintf("-n %s addr add %s/64 dev peer nodad", side.Name, side6),
				fmt.Sprintf("-n %s -6 route add default via %s", side.Name, pod6))
		}
	}
	ipBatch(t, cmds)
	// Static neighbours: neighbour discovery on a brand-new veth loses the
	// first packets (a connect then waits a 1 s SYN retry).
	var neigh []string
	podMAC, nodeMAC := testnet.MAC(t, tw.Pod, "eth0"), testnet.MAC(t, tw.Node, veth)
	add := func(ns, ip, mac, dev string) {
		neigh = append(neigh, fmt.Sprintf("-n %s neigh replace %s lladdr %s dev %s nud permanent", ns, ip, mac, dev))
	}
	add(n, PodIP4.String(), podMAC, veth)
	add(p, NodeIP4.String(), nodeMAC, "eth0")
	if s.IPv6 {
		add(n, PodIP6.String(), podMAC, veth)
		add(p, NodeIP6.String(), nodeMAC, "eth0")
	}
	for i, ifc := range s.Secondary {
		side := tw.Sides[i]
		pm, sm := testnet.MAC(t, tw.Pod, ifc), testnet.MAC(t, side, "peer")
		for _, v6 := range []bool{false, true} {
			if v6 && !s.IPv6 {
				continue
			}
			pod, far := SecondaryIPs(i, v6)
			add(p, far.String(), sm, ifc)
			add(side.Name, pod.String(), pm, "peer")
		}
	}
	ipBatch(t, neigh)

	for _, port := range PodPorts {
		tw.listenTCP(t, tw.Pod, "pod", port)
	}
	tw.listenUDP(t, tw.Pod, "pod", 53)
	tw.listenUDP(t, tw.Pod, "pod", 15053)
	for i, side := range tw.Sides {
		label := fmt.Sprintf("side%d", i)
		for _, port := range []uint16{80, 8080} {
			tw.listenTCP(t, side, label, port)
		}
		tw.listenUDP(t, side, label, 53)
	}
	return tw
}

// NodePorts are the node's TCP listeners: every port an outbound probe
// goes to, so a connection that escapes capture lands somewhere visible.
var NodePorts = []uint16{53, 80, 443, 5555, 6666, 8080, 15001, 15006, 15008, 15020, 15021, 15090, 31000, 32000}

// ipBatch runs ip commands, one `ip -batch` per netns: a command that
// starts with "-n NAME" (and maybe "-6") runs in that netns, the others
// first in this one. Each netns's commands keep their order.
func ipBatch(t testing.TB, cmds []string) {
	t.Helper()
	var order []string
	byNS := map[string][]string{}
	for _, c := range cmds {
		ns, rest := "", c
		if f := strings.Fields(c); len(f) > 2 && f[0] == "-n" {
			ns, rest = f[1], strings.Join(f[2:], " ")
			if f[2] == "-6" { // a batch takes no options: IPv6 ones get a batch of their own
				ns, rest = f[1]+" -6", strings.Join(f[3:], " ")
			}
		}
		if _, ok := byNS[ns]; !ok {
			order = append(order, ns)
		}
		byNS[ns] = append(byNS[ns], rest)
	}
	if _, ok := byNS[""]; ok { // links are made here before they are set up there
		order = append([]string{""}, slices.DeleteFunc(order, func(n string) bool { return n == "" })...)
	}
	for _, ns := range order {
		args := []string{"-batch", "-"}
		if ns != "" {
			args = append(strings.Fields("-n "+ns), "-batch", "-")
		}
		c := exec.Command("ip", args...)
		c.Stdin = strings.NewReader(strings.Join(byNS[ns], "\n") + "\n")
		if out, err := c.CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s\n%s", strings.Join(args, " "), err, out, strings.Join(byNS[ns], "\n"))
		}
	}
}

// Exec runs a command inside the twin's pod netns (loading Istio's rules).
func (tw *Twin) Exec(t testing.TB, stdin string, name string, args ...string) {
	t.Helper()
	execIn(t, tw.Pod, stdin, name, args...)
}

func execIn(t testing.TB, n *testnet.NS, stdin string, name string, args ...string) {
	t.Helper()
	c := exec.Command("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
	c.Stdin = strings.NewReader(stdin)
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("%s %s in %s: %v\n%s", name, strings.Join(args, " "), n.Name, err, out)
	}
}
