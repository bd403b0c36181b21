package nft

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
)

// HostTable is our table in the host netns.
const HostTable = "nftcni-host"

const (
	probeSetV4 = "probe-v4"
	probeSetV6 = "probe-v6"
	hostPost   = "postrouting"
	prioSrcNAT = 100
)

// Member is one enrolled pod in the host probe set.
type Member struct {
	UID string
	IPs []netip.Addr
}

// HostProbe builds the host-netns table that SNATs kubelet's probes to
// enrolled pods to 169.254.7.127 (IPv6: fd16:9254:7127:1337:ffff:ffff:ffff:ffff),
// so the pod's ruleset can let them bypass ztunnel. Each set element carries
// the pod UID as its comment.
//
// Kubelet's packets are told apart by having a local socket (LocalSocket,
// `meta skuid >= 0`), as iptables' `--socket-exists` did, not by looking up
// the uid of a process called "kubelet": that lookup breaks on k3s and
// MicroK8s, where kubelet runs inside another binary (istio#58185), and
// needs re-resolving on every kubelet restart. Forwarded traffic (other
// pods, other nodes) has no local socket and is never SNATed; any local
// process reaching an enrolled pod is, exactly like Istio's iptables backend.
func HostProbe(ipv6 bool, members []Member) *Ruleset {
	t := &Table{Name: HostTable}
	v4 := &Set{Name: probeSetV4, Comment: "enrolled pod IPs; element comment = pod UID"}
	t.Sets = append(t.Sets, v4)
	v6 := &Set{Name: probeSetV6, V6: true, Comment: v4.Comment}
	if ipv6 {
		t.Sets = append(t.Sets, v6)
	}
	for _, m := range members {
		for _, ip := range m.IPs {
			switch {
			case ip.Is4() || ip.Is4In6():
				v4.Elements = append(v4.Elements, Element{Addr: ip.Unmap(), Comment: m.UID})
			case ipv6:
				v6.Elements = append(v6.Elements, Element{Addr: ip, Comment: m.UID})
			}
		}
	}
	t.base(hostPost, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, prioSrcNAT)
	t.add(hostPost, L4(TCP), AddrInSet(false, true, probeSetV4), LocalSocket(), Counter(), SNAT(ProbeSNATv4))
	if ipv6 {
		t.add(hostPost, L4(TCP), AddrInSet(false, false, probeSetV6), LocalSocket(), Counter(), SNAT(ProbeSNATv6))
	}
	return &Ruleset{Tables: []*Table{t}}
}

func probeSet(ip netip.Addr) *nftables.Set {
	s := &nftables.Set{Table: &nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet}, Name: probeSetV4, KeyType: nftables.TypeIPAddr}
	if !ip.Is4() {
		s.Name, s.KeyType = probeSetV6, nftables.TypeIP6Addr
	}
	return s
}

// AddProbeIPs puts one pod's IPs into the host probe sets in one batch,
// touching no other element. An IP still held under another UID (reused
// after a pod died without cleanup) is taken over by this pod.
func AddProbeIPs(fd int, uid string, ips []netip.Addr) error {
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	have, err := probeSets(c)
	if err != nil {
		return err
	}
	for _, ip := range ips {
		ip = ip.Unmap()
		s := probeSet(ip)
		if !have[s.Name] && ip.Is6() {
			continue // IPv6 is off on this node: no v6 set, nothing to probe
		}
		cur, err := elementComment(c, s, ip)
		if err != nil {
			return err
		}
		if cur == uid {
			continue
		}
		if cur != noElement {
			if err := c.SetDeleteElements(s, []nftables.SetElement{{Key: ip.AsSlice()}}); err != nil {
				return err
			}
		}
		if err := c.SetAddElements(s, []nftables.SetElement{{Key: ip.AsSlice(), Comment: uid}}); err != nil {
			return err
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("adding pod %s IPs %v to the host probe set: %w", uid, ips, err)
	}
	return nil
}

// RemoveProbeIPs removes one pod's IPs, but only elements whose comment is
// this pod's UID: an IP reused by another pod stays enrolled (Istio's rule).
func RemoveProbeIPs(fd int, uid string, ips []netip.Addr) error {
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	have, err := probeSets(c)
	if err != nil {
		return err
	}
	n := 0
	for _, ip := range ips {
		ip = ip.Unmap()
		s := probeSet(ip)
		if !have[s.Name] && ip.Is6() {
			continue
		}
		cur, err := elementComment(c, s, ip)
		if err != nil {
			return err
		}
		if cur != uid {
			continue
		}
		if err := c.SetDeleteElements(s, []nftables.SetElement{{Key: ip.AsSlice()}}); err != nil {
			return err
		}
		n++
	}
	if n == 0 {
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("removing pod %s IPs %v from the host probe set: %w", uid, ips, err)
	}
	return nil
}

const noElement = "\x00absent"

// probeSets says which probe sets exist; the host table must.
func probeSets(c *nftables.Conn) (map[string]bool, error) {
	sets, err := c.GetSets(&nftables.Table{Name: HostTable, Family: nftables.TableFamilyINet})
	if err != nil {
		return nil, fmt.Errorf("listing sets of table inet %s: %w (is the host table in place?)", HostTable, err)
	}
	have := map[string]bool{}
	for _, s := range sets {
		have[s.Name] = true
	}
	return have, nil
}

// elementComment returns the comment stored with ip, or noElement. A set
// that does not exist (IPv6 off) holds nothing.
func elementComment(c *nftables.Conn, s *nftables.Set, ip netip.Addr) (string, error) {
	els, err := c.GetSetElements(s)
	if err != nil {
		return "", fmt.Errorf("reading host probe set %s: %w (is the host table in place?)", s.Name, err)
	}
	for _, e := range els {
		if a, ok := netip.AddrFromSlice(e.Key); ok && a == ip {
			return e.Comment, nil
		}
	}
	return noElement, nil
}
