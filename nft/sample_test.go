package nft

import (
	"net/netip"

	"github.com/google/nftables"
)

// sample is a pod ruleset of the shape of Istio's (package capture builds
// those): base chains of all three types at three priorities, a regular
// chain, named sets of addresses and ports, most kinds of term, and a
// policy route per family. The mechanism's tests need one; which policy it
// says is capture's business.
func sample(ipv6 bool) *Ruleset {
	t := &Table{Name: PodTable}
	t.Base("nat-prerouting", nftables.ChainTypeNAT, nftables.ChainHookPrerouting, -100)
	t.Base("nat-output", nftables.ChainTypeNAT, nftables.ChainHookOutput, -100)
	t.Base("mangle-prerouting", nftables.ChainTypeFilter, nftables.ChainHookPrerouting, -150)
	t.Base("mangle-output", nftables.ChainTypeRoute, nftables.ChainHookOutput, -150)
	t.Base("raw-output", nftables.ChainTypeFilter, nftables.ChainHookOutput, -300)
	t.Sets = append(t.Sets, PortSet("ports", []uint16{22, 8080}),
		PrefixSet("nets-v4", false, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.1.0/24")}))
	fams := []bool{true}
	if ipv6 {
		fams = append(fams, false)
		t.Sets = append(t.Sets, PrefixSet("nets-v6", true, []netip.Prefix{netip.MustParsePrefix("fd00::/8")}))
	}
	lo := map[bool]netip.Prefix{true: netip.MustParsePrefix("127.0.0.1/32"), false: netip.MustParsePrefix("::1/128")}
	for _, v4 := range fams {
		t.Add("nat-prerouting", Addr(false, Neq, lo[v4]), DPort(TCP, Neq, 15008), Mark(Neq, 0xfff, 0x539), Counter(), Redirect(15006))
	}
	t.Add("nat-output", DPortInSet(TCP, "ports"), Counter(), Return())
	t.Add("nat-output", IfName(false, Eq, "lo"), SkUID(Eq, 1337), Counter(), Return())
	t.Add("nat-output", AddrInSet(false, true, "nets-v4"), Counter(), Jump("redirect"))
	if ipv6 {
		t.Add("nat-output", AddrInSet(false, false, "nets-v6"), Counter(), Jump("redirect"))
	}
	t.Add("redirect", L4(TCP), Counter(), Redirect(15001))
	t.Add("mangle-prerouting", Mark(Eq, 0xfff, 0x539), Counter(), SetCtMarkBits(^uint32(0xfff), 0x111))
	t.Add("mangle-output", CtMark(Eq, 0xfff, 0x111), Counter(), SetMarkFromCt())
	t.Add("raw-output", DPort(UDP, Eq, 53), Mark(Eq, 0xfff, 0x539), Counter(), SetCtZone(1))
	rs := &Ruleset{Tables: []*Table{t}}
	for _, v4 := range fams {
		rs.Routes = append(rs.Routes, Route{Mark: 0x111, Mask: 0xfff, Table: 100, Priority: 32764, V6: !v4})
	}
	return rs
}

// sampleCleanup names everything sample can leave in a netns.
func sampleCleanup() *Ruleset {
	return &Ruleset{Tables: []*Table{{Name: PodTable}}, Routes: sample(true).Routes}
}
