package nft

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

func (r Route) family() int {
	if r.V6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// loopbackIndex is lo's ifindex: the kernel gives loopback index 1 in every
// netns (LOOPBACK_IFINDEX), so no lookup round trip is needed.
const loopbackIndex = 1

// routeEntry is what routesPresent reads of an `ip rule` or a route.
type routeEntry struct {
	table, priority, mark, mask uint32
	typ, dstLen                 uint8
	hasMask                     bool
}

// dumpRoutes lists the rules (RTM_GETRULE) or routes (RTM_GETROUTE) of
// one family over conn, decoded with mdlayher/netlink's attribute decoder.
func dumpRoutes(conn *netlink.Conn, typ netlink.HeaderType, family int) ([]routeEntry, error) {
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{Type: typ, Flags: netlink.Request | netlink.Dump},
		Data:   make([]byte, unix.SizeofRtMsg),
	})
	if err != nil {
		return nil, err
	}
	var out []routeEntry
	for _, m := range msgs {
		if len(m.Data) < unix.SizeofRtMsg || int(m.Data[0]) != family {
			continue
		}
		e := routeEntry{table: uint32(m.Data[4]), typ: m.Data[7], dstLen: m.Data[1]}
		ad, err := netlink.NewAttributeDecoder(m.Data[unix.SizeofRtMsg:])
		if err != nil {
			return nil, err
		}
		ad.ByteOrder = binary.NativeEndian
		for ad.Next() {
			switch t := ad.Type(); {
			case t == unix.RTA_TABLE: // = FRA_TABLE
				e.table = ad.Uint32()
			case typ == unix.RTM_GETRULE && t == unix.FRA_PRIORITY:
				e.priority = ad.Uint32()
			case typ == unix.RTM_GETRULE && t == unix.FRA_FWMARK:
				e.mark = ad.Uint32()
			case typ == unix.RTM_GETRULE && t == unix.FRA_FWMASK:
				e.mask, e.hasMask = ad.Uint32(), true
			}
		}
		if err := ad.Err(); err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// routesPresent reports whether every rule and route of rs, and every
// address it needs on lo, exists.
func routesPresent(fd int, routes []Route, addrs []netip.Prefix) error {
	if len(routes)+len(addrs) == 0 {
		return nil
	}
	conn, err := netlink.Dial(unix.NETLINK_ROUTE, &netlink.Config{NetNS: fd})
	if err != nil {
		return fmt.Errorf("rtnetlink: %w", err)
	}
	defer conn.Close()
	if len(addrs) > 0 {
		have, err := loopbackAddrs(conn)
		if err != nil {
			return fmt.Errorf("listing addresses: %w", err)
		}
		for _, a := range addrs {
			if !slices.Contains(have, a) {
				return fmt.Errorf("address %s on lo is missing", a)
			}
		}
	}
	for _, r := range routes {
		rules, err := dumpRoutes(conn, unix.RTM_GETRULE, r.family())
		if err != nil {
			return fmt.Errorf("listing ip rules: %w", err)
		}
		found := false
		for _, x := range rules {
			found = found || (x.table == uint32(r.Table) && x.mark == r.Mark && x.hasMask && x.mask == r.Mask && x.priority == uint32(r.Priority))
		}
		if !found {
			return fmt.Errorf("ip rule fwmark %#x/%#x lookup %d (%s) is missing", r.Mark, r.Mask, r.Table, fam(r))
		}
		rts, err := dumpRoutes(conn, unix.RTM_GETROUTE, r.family())
		if err != nil {
			return fmt.Errorf("listing routes: %w", err)
		}
		found = false
		for _, x := range rts {
			found = found || (x.table == uint32(r.Table) && x.typ == unix.RTN_LOCAL && x.dstLen == 0)
		}
		if !found {
			return fmt.Errorf("local default route in table %d (%s) is missing", r.Table, fam(r))
		}
	}
	return nil
}

func fam(r Route) string {
	if r.V6 {
		return "ipv6"
	}
	return "ipv4"
}

// loopbackAddrs lists lo's addresses (RTM_GETADDR, both families).
func loopbackAddrs(conn *netlink.Conn) ([]netip.Prefix, error) {
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_GETADDR, Flags: netlink.Request | netlink.Dump},
		Data:   make([]byte, unix.SizeofIfAddrmsg),
	})
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, m := range msgs {
		if len(m.Data) < unix.SizeofIfAddrmsg || binary.NativeEndian.Uint32(m.Data[4:]) != loopbackIndex {
			continue
		}
		bits := int(m.Data[1])
		ad, err := netlink.NewAttributeDecoder(m.Data[unix.SizeofIfAddrmsg:])
		if err != nil {
			return nil, err
		}
		for ad.Next() {
			if ad.Type() == unix.IFA_ADDRESS {
				if a, ok := netip.AddrFromSlice(ad.Bytes()); ok {
					out = append(out, netip.PrefixFrom(a, bits))
				}
			}
		}
		if err := ad.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}
