package capture

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/nftcni/nftcni/istio"
)

// SidecarProxy describes the injected istio-proxy container: what the pod
// spec (not the annotations) says.
type SidecarProxy struct {
	UID, GID    uint32 // 0 means Istio's default 1337
	DNSCapture  bool   // ISTIO_META_DNS_CAPTURE=true
	DropInvalid bool   // INVALID_DROP=true
	IPv6        bool   // the pod has an IPv6 address
}

// ParseSidecar turns pod annotations into a SidecarSpec with Istio's
// defaults (REDIRECT; inbound all ports but 15020,15021,15090; outbound all
// destinations but port 15020). A bad value is an error naming the
// annotation; nothing is guessed.
func ParseSidecar(ann map[string]string, proxy SidecarProxy) (SidecarSpec, error) {
	s := SidecarSpec{Mode: istio.ModeRedirect, ProxyUID: istio.ProxyID, ProxyGID: istio.ProxyID,
		DNSCapture: proxy.DNSCapture, DropInvalid: proxy.DropInvalid, IPv6: proxy.IPv6}
	if proxy.UID != 0 {
		s.ProxyUID = proxy.UID
	}
	if proxy.GID != 0 {
		s.ProxyGID = proxy.GID
	}
	get := func(k, def string) string {
		if v, ok := ann[k]; ok {
			return strings.TrimSpace(v)
		}
		return def
	}
	switch m := get(istio.AnnInterceptionMode, istio.ModeRedirect); m {
	case istio.ModeRedirect, istio.ModeTProxy:
		s.Mode = m
	default:
		return s, fmt.Errorf("annotation %s=%q: want REDIRECT or TPROXY", istio.AnnInterceptionMode, m)
	}
	var err error
	if s.InboundAll, s.InboundPorts, err = portList(istio.AnnIncludeInboundPorts, get(istio.AnnIncludeInboundPorts, "*"), true); err != nil {
		return s, err
	}
	if _, s.ExcludeInboundPorts, err = portList(istio.AnnExcludeInboundPorts, get(istio.AnnExcludeInboundPorts, "15020"), false); err != nil {
		return s, err
	}
	for _, p := range istio.SidecarExcludedInbound {
		if !slices.Contains(s.ExcludeInboundPorts, p) {
			s.ExcludeInboundPorts = append(s.ExcludeInboundPorts, p)
		}
	}
	if _, s.OutboundPorts, err = portList(istio.AnnIncludeOutboundPorts, get(istio.AnnIncludeOutboundPorts, ""), false); err != nil {
		return s, err
	}
	if _, s.ExcludeOutboundPorts, err = portList(istio.AnnExcludeOutboundPorts, get(istio.AnnExcludeOutboundPorts, "15020"), false); err != nil {
		return s, err
	}
	if s.OutboundAll, s.IncludeOutboundCIDRs, err = cidrList(istio.AnnIncludeOutboundCIDRs, get(istio.AnnIncludeOutboundCIDRs, "*"), true); err != nil {
		return s, err
	}
	if _, s.ExcludeOutboundCIDRs, err = cidrList(istio.AnnExcludeOutboundCIDRs, get(istio.AnnExcludeOutboundCIDRs, ""), false); err != nil {
		return s, err
	}
	if s.ExcludeInterfaces, err = ifaceList(istio.AnnExcludeInterfaces, get(istio.AnnExcludeInterfaces, "")); err != nil {
		return s, err
	}
	reroute := istio.AnnRerouteInterfaces
	if _, ok := ann[reroute]; !ok {
		reroute = istio.AnnKubevirtInterfaces
	}
	if s.RerouteInterfaces, err = ifaceList(reroute, get(reroute, "")); err != nil {
		return s, err
	}
	return s, nil
}

func split(v string) []string {
	var out []string
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func portList(key, v string, starOK bool) (bool, []uint16, error) {
	if starOK && v == "*" {
		return true, nil, nil
	}
	var out []uint16
	for _, f := range split(v) {
		n, err := strconv.ParseUint(f, 10, 16)
		if err != nil || n == 0 {
			return false, nil, fmt.Errorf("annotation %s=%q: %q is not a port (1-65535)", key, v, f)
		}
		if !slices.Contains(out, uint16(n)) {
			out = append(out, uint16(n))
		}
	}
	return false, out, nil
}

func cidrList(key, v string, starOK bool) (bool, []netip.Prefix, error) {
	if starOK && v == "*" {
		return true, nil, nil
	}
	var out []netip.Prefix
	for _, f := range split(v) {
		p, err := netip.ParsePrefix(f)
		if err != nil {
			a, aerr := netip.ParseAddr(f)
			if aerr != nil {
				return false, nil, fmt.Errorf("annotation %s=%q: %q is not a CIDR", key, v, f)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, p.Masked())
	}
	return false, out, nil
}

func ifaceList(key, v string) ([]string, error) {
	out := split(v)
	for _, n := range out {
		if len(n) >= 16 || strings.ContainsAny(n, "/ \"") {
			return nil, fmt.Errorf("annotation %s=%q: %q is not an interface name", key, v, n)
		}
	}
	return out, nil
}
