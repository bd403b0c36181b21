package capture

import (
	"net/netip"

	"github.com/google/nftables"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

const (
	hostPost   = "postrouting"
	prioSrcNAT = 100
)

// Istio's default probe SNAT addresses (istio.ProbeSNATv4, istio.ProbeSNATv6).
var (
	ProbeSNATv4 = netip.MustParseAddr(istio.ProbeSNATv4)
	ProbeSNATv6 = netip.MustParseAddr(istio.ProbeSNATv6)
)

// ProbeSNAT is where kubelet's probes to enrolled pods come from after the
// host's SNAT: istio-cni's HOST_PROBE_SNAT_IP and HOST_PROBE_SNAT_IPV6.
// A zero address is Istio's default.
type ProbeSNAT struct {
	V4 netip.Addr `json:"v4,omitzero"`
	V6 netip.Addr `json:"v6,omitzero"`
}

// Addr is the address for one family, the default filled in.
func (p ProbeSNAT) Addr(v4 bool) netip.Addr {
	switch {
	case v4 && p.V4.IsValid():
		return p.V4
	case v4:
		return ProbeSNATv4
	case p.V6.IsValid():
		return p.V6
	}
	return ProbeSNATv6
}

// HostSpec is what decides the host probe table.
type HostSpec struct {
	IPv6 bool // a set and a rule for IPv6 pods
	SNAT ProbeSNAT
}

// HostProbe builds the host-netns table that SNATs kubelet's probes to
// enrolled pods to the probe SNAT address (by default 169.254.7.127; IPv6:
// fd16:9254:7127:1337:ffff:ffff:ffff:ffff), so the pod's ruleset can let
// them bypass ztunnel. Each set element carries
// the pod UID as its comment.
//
// Kubelet's packets are told apart by having a local socket (LocalSocket,
// `meta skuid >= 0`), as iptables' `--socket-exists` did, not by looking up
// the uid of a process called "kubelet": that lookup breaks on k3s and
// MicroK8s, where kubelet runs inside another binary (istio#58185), and
// needs re-resolving on every kubelet restart. Forwarded traffic (other
// pods, other nodes) has no local socket and is never SNATed; any local
// process reaching an enrolled pod is, exactly like Istio's iptables backend.
func HostProbe(spec HostSpec, members []nft.Member) *nft.Ruleset {
	ipv6 := spec.IPv6
	t := &nft.Table{Name: nft.HostTable}
	v4 := &nft.Set{Name: nft.ProbeSetV4, Comment: "enrolled pod IPs; element comment = pod UID"}
	t.Sets = append(t.Sets, v4)
	v6 := &nft.Set{Name: nft.ProbeSetV6, V6: true, Comment: v4.Comment}
	if ipv6 {
		t.Sets = append(t.Sets, v6)
	}
	for _, m := range members {
		for _, ip := range m.IPs {
			switch {
			case ip.Is4() || ip.Is4In6():
				v4.Elements = append(v4.Elements, nft.Element{Addr: ip.Unmap(), Comment: m.UID})
			case ipv6:
				v6.Elements = append(v6.Elements, nft.Element{Addr: ip, Comment: m.UID})
			}
		}
	}
	t.Base(hostPost, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, prioSrcNAT)
	t.Add(hostPost, nft.L4(nft.TCP), nft.AddrInSet(false, true, nft.ProbeSetV4), nft.LocalSocket(), nft.Counter(), nft.SNAT(spec.SNAT.Addr(true)))
	if ipv6 {
		t.Add(hostPost, nft.L4(nft.TCP), nft.AddrInSet(false, false, nft.ProbeSetV6), nft.LocalSocket(), nft.Counter(), nft.SNAT(spec.SNAT.Addr(false)))
	}
	return &nft.Ruleset{Tables: []*nft.Table{t}}
}
