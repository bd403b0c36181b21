// Package netnsaddr reads the addresses a network namespace holds, through
// netlink on a descriptor of it (no path, no setns): how the agent tells
// that a netns found through /proc or a record is the pod's, and where a
// pod's addresses come from when the runtime passed none (a standalone
// network, no prevResult).
package netnsaddr

import (
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// List is every address in the netns behind f that a pod is reached by:
// not loopback, not link-local, in the kernel's order (IPv4 first).
func List(f *os.File) ([]netip.Prefix, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(f.Fd()))
	if err != nil {
		return nil, err
	}
	defer h.Close()
	as, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, a := range as {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || a.IPNet == nil {
			continue
		}
		ip = ip.Unmap()
		if ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
			continue
		}
		bits, _ := a.Mask.Size()
		out = append(out, netip.PrefixFrom(ip, bits))
	}
	return out, nil
}

// Holds says whether the netns behind f has one of ips on an interface.
func Holds(f *os.File, ips ...netip.Addr) bool {
	h, err := netlink.NewHandleAt(netns.NsHandle(f.Fd()))
	if err != nil {
		return false
	}
	defer h.Close()
	as, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return false
	}
	for _, a := range as {
		if got, ok := netip.AddrFromSlice(a.IP); ok {
			for _, want := range ips {
				if got.Unmap() == want.Unmap() {
					return true
				}
			}
		}
	}
	return false
}
