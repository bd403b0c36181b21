package nft

import (
	"encoding/binary"
	"net/netip"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// routeMessages encodes the policy routes of a ruleset as rtnetlink
// messages, with vishvananda/netlink's request encoder, in the attribute
// layout its RouteReplace and RuleAdd use (so what Verify lists back is
// what they would have made). add: per route `ip route replace local
// default dev lo table T` then `ip rule add fwmark M/K pref P lookup T`
// (exclusive: the sender accepts EEXIST for an identical rule, which a
// plain add would duplicate); otherwise the matching deletions (the sender
// accepts ENOENT and ESRCH: already gone). Only the last message asks for
// an ack; errors come back for every message anyway.
//
// Addresses the ruleset needs on lo come first: `ip addr replace A dev lo`
// (or its deletion, which accepts EADDRNOTAVAIL: already gone).
func routeMessages(routes []Route, addrs []netip.Prefix, add bool) []byte {
	var out []byte
	seq := uint32(1)
	n := 2*len(routes) + len(addrs)
	for _, a := range addrs {
		flags := 0
		if seq == uint32(n) {
			flags = unix.NLM_F_ACK
		}
		req := nl.NewNetlinkRequest(unix.RTM_DELADDR, flags)
		if add {
			req = nl.NewNetlinkRequest(unix.RTM_NEWADDR, flags|unix.NLM_F_CREATE|unix.NLM_F_REPLACE)
		}
		req.Seq = seq
		addrBody(req, a)
		out = append(out, req.Serialize()...)
		seq++
	}
	for _, r := range routes {
		for _, rule := range []bool{false, true} {
			flags := 0
			if seq == uint32(n) {
				flags = unix.NLM_F_ACK
			}
			var req *nl.NetlinkRequest
			switch {
			case add && !rule:
				req = nl.NewNetlinkRequest(unix.RTM_NEWROUTE, flags|unix.NLM_F_CREATE|unix.NLM_F_REPLACE)
			case add:
				req = nl.NewNetlinkRequest(unix.RTM_NEWRULE, flags|unix.NLM_F_CREATE|unix.NLM_F_EXCL)
			case !rule:
				req = nl.NewNetlinkRequest(unix.RTM_DELROUTE, flags)
			default:
				req = nl.NewNetlinkRequest(unix.RTM_DELRULE, flags)
			}
			req.Seq = seq
			if rule {
				r.ruleBody(req, add)
			} else {
				r.routeBody(req, add)
			}
			out = append(out, req.Serialize()...)
			seq++
		}
	}
	return out
}

// addrBody is `A dev lo` as vishvananda/netlink's AddrReplace lays it out.
func addrBody(req *nl.NetlinkRequest, a netip.Prefix) {
	fam := unix.AF_INET
	if a.Addr().Is6() {
		fam = unix.AF_INET6
	}
	msg := nl.NewIfAddrmsg(fam)
	msg.Index = loopbackIndex
	msg.Prefixlen = uint8(a.Bits())
	msg.Scope = unix.RT_SCOPE_HOST
	req.AddData(msg)
	b := a.Addr().AsSlice()
	req.AddData(nl.NewRtAttr(unix.IFA_LOCAL, b))
	req.AddData(nl.NewRtAttr(unix.IFA_ADDRESS, b))
}

func (r Route) routeBody(req *nl.NetlinkRequest, add bool) {
	msg := nl.NewRtMsg()
	if !add {
		msg = nl.NewRtDelMsg()
	}
	msg.Family = uint8(r.family())
	msg.Table = r.headerTable()
	msg.Type = unix.RTN_LOCAL
	if add {
		msg.Scope = unix.RT_SCOPE_HOST
	}
	req.AddData(msg)
	dst := make([]byte, 4)
	if r.V6 {
		dst = make([]byte, 16)
	}
	req.AddData(nl.NewRtAttr(unix.RTA_DST, dst)) // default: the all-zero address, length 0
	req.AddData(nl.NewRtAttr(unix.RTA_OIF, u32(loopbackIndex)))
	req.AddData(nl.NewRtAttr(unix.RTA_TABLE, u32(uint32(r.Table))))
}

func (r Route) ruleBody(req *nl.NetlinkRequest, add bool) {
	msg := nl.NewRtMsg()
	msg.Family = uint8(r.family())
	msg.Scope = unix.RT_SCOPE_UNIVERSE
	msg.Table = r.headerTable()
	msg.Type = unix.RTN_UNSPEC
	if add {
		msg.Type = unix.RTN_UNICAST
	}
	req.AddData(msg)
	req.AddData(nl.NewRtAttr(nl.FRA_PRIORITY, u32(uint32(r.Priority))))
	req.AddData(nl.NewRtAttr(nl.FRA_FWMARK, u32(r.Mark)))
	req.AddData(nl.NewRtAttr(nl.FRA_FWMASK, u32(r.Mask)))
	req.AddData(nl.NewRtAttr(nl.FRA_TABLE, u32(uint32(r.Table))))
}

// headerTable is the table as the 8-bit header field carries it; the
// 32-bit attribute beside it carries any table.
func (r Route) headerTable() uint8 {
	if r.Table >= 256 {
		return unix.RT_TABLE_UNSPEC
	}
	return uint8(r.Table)
}

func u32(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }
