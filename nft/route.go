package nft

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// handle opens an rtnetlink handle in the netns behind fd (0: own netns).
func handle(fd int) (*netlink.Handle, error) {
	if fd == 0 {
		return netlink.NewHandle(unix.NETLINK_ROUTE)
	}
	return netlink.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_ROUTE)
}

func (r Route) family() int {
	if r.V6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func (r Route) rule() *netlink.Rule {
	nr := netlink.NewRule()
	nr.Family, nr.Mark, nr.Table, nr.Priority = r.family(), r.Mark, r.Table, r.Priority
	mask := r.Mask
	nr.Mask = &mask
	return nr
}

// loopbackIndex is lo's ifindex: the kernel gives loopback index 1 in every
// netns (LOOPBACK_IFINDEX), so no lookup round trip is needed.
const loopbackIndex = 1

func (r Route) route() *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if r.V6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{LinkIndex: loopbackIndex, Dst: dst, Table: r.Table, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: r.family()}
}

// applyRoutes makes `ip rule fwmark M/K pref P lookup T` and `ip route
// local default dev lo table T` exist, per family; existing ones stay.
func applyRoutes(fd int, routes []Route) error {
	if len(routes) == 0 {
		return nil
	}
	h, err := handle(fd)
	if err != nil {
		return fmt.Errorf("policy routing: %w", err)
	}
	defer h.Close()
	for _, r := range routes {
		if err := h.RouteReplace(r.route()); err != nil {
			return fmt.Errorf("local default route in table %d: %w", r.Table, err)
		}
		// RuleAdd asks for an exclusive create: an identical rule is EEXIST.
		if err := h.RuleAdd(r.rule()); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("ip rule fwmark %#x/%#x lookup %d: %w", r.Mark, r.Mask, r.Table, err)
		}
	}
	return nil
}

func hasRule(h *netlink.Handle, r Route) (bool, error) {
	rules, err := h.RuleListFiltered(r.family(), &netlink.Rule{Table: r.Table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, fmt.Errorf("listing ip rules: %w", err)
	}
	for _, x := range rules {
		if x.Mark == r.Mark && x.Mask != nil && *x.Mask == r.Mask && x.Priority == r.Priority {
			return true, nil
		}
	}
	return false, nil
}

// routesPresent reports whether every rule and route of rs exists.
func routesPresent(fd int, routes []Route) error {
	if len(routes) == 0 {
		return nil
	}
	h, err := handle(fd)
	if err != nil {
		return err
	}
	defer h.Close()
	for _, r := range routes {
		if ok, err := hasRule(h, r); err != nil {
			return err
		} else if !ok {
			return fmt.Errorf("ip rule fwmark %#x/%#x lookup %d (%s) is missing", r.Mark, r.Mask, r.Table, fam(r))
		}
		rs, err := h.RouteListFiltered(r.family(), &netlink.Route{Table: r.Table, Type: unix.RTN_LOCAL}, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_TYPE)
		if err != nil {
			return err
		}
		if len(rs) == 0 {
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

// deleteRoutes removes our rules and routes; absent ones are fine.
func deleteRoutes(fd int, routes []Route) error {
	if len(routes) == 0 {
		return nil
	}
	h, err := handle(fd)
	if err != nil {
		return err
	}
	defer h.Close()
	var errs []error
	for _, r := range routes {
		for {
			ok, err := hasRule(h, r)
			if err != nil || !ok {
				errs = append(errs, err)
				break
			}
			if err := h.RuleDel(r.rule()); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, err)
				break
			}
		}
		if err := h.RouteDel(r.route()); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
