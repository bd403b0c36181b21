package nft

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// What istio-cni leaves behind, by backend (read from a real istio-cni in
// the handover test):
//   - its native nftables backend: whole inet tables of its own,
//     istio-ambient-nat, -mangle and -raw in a pod; istio-ambient-nat (the
//     probe sets and their SNAT) on the host;
//   - its iptables backend, through iptables-nft: in a pod, the ip and ip6
//     nat, mangle and raw tables, each holding ISTIO_* chains and base
//     chains whose only rules jump to them; on the host, chain ISTIO_POSTRT
//     in the shared ip and ip6 nat tables, jumped to from POSTROUTING, and
//     the ipsets istio-inpod-probes-v4 and -v6 it matches;
//   - in both, the same policy routes as ours (fwmark 0x111/0xfff lookup
//     100, pref 32764; local default dev lo in table 100).
const (
	istioTablePrefix = "istio-ambient-"
	istioChainPrefix = "ISTIO_"
	istioHostChain   = "ISTIO_POSTRT"
)

// IstioProbeSets are the ipsets istio-cni's iptables backend keeps the
// host's probe SNAT in.
var IstioProbeSets = []string{"istio-inpod-probes-v4", "istio-inpod-probes-v6"}

// TableRef names a table.
type TableRef struct {
	Family nftables.TableFamily
	Name   string
}

func (t TableRef) String() string { return familyName(t.Family) + " " + t.Name }

// IstioState is what istio-cni left in a netns, as far as it can be told
// with certainty.
type IstioState struct {
	// Tables are istio-cni's own: deleted whole.
	Tables []TableRef
	// Chains are istio-cni's chains in tables others share (the host's
	// iptables nat): deleted with the rules that jump to them.
	Chains []istioChain
	// Unknown is everything else that holds rules: while there is any, the
	// netns is not taken over.
	Unknown []string
	// Legacy lists the iptables-legacy (x_tables) tables loaded in the
	// netns: rules nf_tables cannot see, read or replace atomically.
	Legacy []string
}

type istioChain struct {
	table TableRef
	name  string
	jumps []*nftables.Rule // in base chains
}

// Found says whether istio-cni's state is there.
func (s *IstioState) Found() bool { return len(s.Tables)+len(s.Chains) > 0 }

// What lists istio-cni's state found, for logs.
func (s *IstioState) What() []string {
	var out []string
	for _, t := range s.Tables {
		out = append(out, "table "+t.String())
	}
	for _, c := range s.Chains {
		out = append(out, "chain "+c.name+" in table "+c.table.String())
	}
	return out
}

// ForeignError is a netns that holds rules nftcni does not recognise next
// to istio-cni's, or iptables-legacy rules: it is left exactly as it is.
type ForeignError struct{ Unknown, Legacy []string }

func (e *ForeignError) Error() string {
	if len(e.Legacy) > 0 {
		return "holds iptables-legacy (x_tables) tables " + strings.Join(e.Legacy, ", ") +
			", which nf_tables can neither read nor replace atomically: left as it is; drain this node to move it to nftcni"
	}
	return "holds rules that are neither istio-cni's nor ours, left as they are: " + strings.Join(e.Unknown, "; ")
}

// Refused says whether istio-cni's state here must be left as it is:
// someone else's rules are beside it. (Legacy tables are for the caller to
// weigh: they matter only where istio-cni is known to have enrolled.)
func (s *IstioState) Refused() error {
	if s.Found() && len(s.Unknown) > 0 {
		return &ForeignError{Unknown: s.Unknown}
	}
	return nil
}

// SurveyPod reads a pod's netns for istio-cni's in-pod state, and for
// iptables-legacy tables. Our own table is not counted; tables with no
// rules are ignored.
func SurveyPod(fd int) (*IstioState, error) {
	s, err := survey(fd, false)
	if err != nil {
		return nil, err
	}
	if s.Legacy, err = legacyTables(fd); err != nil {
		return nil, err
	}
	return s, nil
}

// legacyTables lists the x_tables tables loaded in the netns behind fd, as
// its /proc/net/ip_tables_names and ip6_tables_names say.
func legacyTables(fd int) ([]string, error) {
	var out []string
	err := nlsend.InNetns(fd, func() error {
		for _, f := range []struct{ fam, path string }{{"ip", "/proc/thread-self/net/ip_tables_names"}, {"ip6", "/proc/thread-self/net/ip6_tables_names"}} {
			b, err := os.ReadFile(f.path)
			if errors.Is(err, os.ErrNotExist) {
				continue // no x_tables in this kernel
			}
			if err != nil {
				return err
			}
			for _, name := range strings.Fields(string(b)) {
				out = append(out, f.fam+" "+name)
			}
		}
		return nil
	})
	return out, err
}

// SurveyHost reads the host's netns for istio-cni's probe SNAT state. Only
// istio-cni's own tables and chains are looked at: the host's other
// tables (kube-proxy's, the primary CNI's) are none of our business.
func SurveyHost(fd int) (*IstioState, error) {
	return survey(fd, true)
}

func survey(fd int, host bool) (*IstioState, error) {
	c, err := conn(fd)
	if err != nil {
		return nil, err
	}
	defer c.CloseLasting()
	tables, err := c.ListTables()
	if err != nil {
		return nil, fmt.Errorf("listing tables: %w", err)
	}
	chains, err := c.ListChains()
	if err != nil {
		return nil, fmt.Errorf("listing chains: %w", err)
	}
	s := &IstioState{}
	for _, t := range tables {
		ref := TableRef{Family: t.Family, Name: t.Name}
		var own []*nftables.Chain
		for _, ch := range chains {
			if ch.Table.Name == t.Name && ch.Table.Family == t.Family {
				own = append(own, ch)
			}
		}
		switch {
		case t.Family == nftables.TableFamilyINet && (t.Name == PodTable || t.Name == HostTable):
		case t.Family == nftables.TableFamilyINet && strings.HasPrefix(t.Name, istioTablePrefix):
			s.Tables = append(s.Tables, ref)
		case t.Family == nftables.TableFamilyIPv4 || t.Family == nftables.TableFamilyIPv6:
			if err := s.iptables(c, ref, own, host); err != nil {
				return nil, err
			}
		case !host:
			if n, err := ruleCount(c, t, own); err != nil {
				return nil, err
			} else if n > 0 {
				s.Unknown = append(s.Unknown, fmt.Sprintf("table %s (%d rules)", ref, n))
			}
		}
	}
	return s, nil
}

// iptables sorts one iptables-nft table: in a pod, Istio's whole (ISTIO_*
// chains, and base chains that only jump to them), or empty, or unknown;
// on the host, only its ISTIO_POSTRT chain and the jumps to it count.
func (s *IstioState) iptables(c *nftables.Conn, ref TableRef, chains []*nftables.Chain, host bool) error {
	t := &nftables.Table{Family: ref.Family, Name: ref.Name}
	var istio []*nftables.Chain
	var jumps []*nftables.Rule
	other := 0
	for _, ch := range chains {
		if strings.HasPrefix(ch.Name, istioChainPrefix) {
			istio = append(istio, ch)
			continue
		}
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return fmt.Errorf("listing table %s chain %s: %w", ref, ch.Name, err)
		}
		for _, r := range rules {
			if target, ok := onlyJump(r); ok && strings.HasPrefix(target, istioChainPrefix) {
				jumps = append(jumps, r)
			} else {
				other++
			}
		}
	}
	if host {
		for _, ch := range istio {
			if ch.Name != istioHostChain {
				continue
			}
			ic := istioChain{table: ref, name: ch.Name}
			for _, j := range jumps {
				if target, _ := onlyJump(j); target == ch.Name {
					ic.jumps = append(ic.jumps, j)
				}
			}
			s.Chains = append(s.Chains, ic)
		}
		return nil
	}
	switch {
	case len(istio) > 0 && other == 0:
		s.Tables = append(s.Tables, ref)
	case other > 0 || len(istio) > 0:
		names := make([]string, 0, len(chains))
		for _, ch := range chains {
			names = append(names, ch.Name)
		}
		slices.Sort(names)
		s.Unknown = append(s.Unknown, fmt.Sprintf("table %s (chains %s; %d rules that do not jump to ISTIO_ chains)", ref, strings.Join(names, ", "), other))
	}
	return nil
}

// onlyJump is the chain a rule jumps to when the rule is nothing but that
// jump (with the counter iptables-nft adds).
func onlyJump(r *nftables.Rule) (string, bool) {
	target := ""
	for _, e := range r.Exprs {
		switch e := e.(type) {
		case *expr.Counter:
		case *expr.Verdict:
			if e.Kind != expr.VerdictJump || target != "" {
				return "", false
			}
			target = e.Chain
		default:
			return "", false
		}
	}
	return target, target != ""
}

func ruleCount(c *nftables.Conn, t *nftables.Table, chains []*nftables.Chain) (int, error) {
	n := 0
	for _, ch := range chains {
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return 0, fmt.Errorf("listing table %s %s chain %s: %w", familyName(t.Family), t.Name, ch.Name, err)
		}
		n += len(rules)
	}
	return n, nil
}

// TakeOver replaces istio-cni's in-pod state with b's ruleset in one
// nf_tables transaction: Istio's tables are deleted and ours created (over
// ours, when a previous agent made it) in the same commit, so no packet
// ever meets both or neither; it goes out as Program's batches do, in one
// send with one ack. The policy routes are the same as Istio's and are
// asserted after. s must come from SurveyPod and hold nothing unknown.
func TakeOver(fd int, b *Batch, s *IstioState) error {
	if len(s.Unknown) > 0 || len(s.Legacy) > 0 {
		return &ForeignError{Unknown: s.Unknown, Legacy: s.Legacy}
	}
	dels, err := capture(func(c *nftables.Conn) error {
		for _, t := range s.Tables {
			c.DelTable(&nftables.Table{Family: t.Family, Name: t.Name})
		}
		return nil
	})
	if err != nil {
		return err
	}
	var pre []byte
	if len(dels) > 2 { // without its own batch begin and end
		pre = frame(dels[1:len(dels)-1], uint32(1<<20), false, false)
	}
	if err := nlsend.Send(fd, nlsend.SpliceReplace(b.Tables, append(pre, b.Replace...)), nil, b.Routes); err != nil {
		return fmt.Errorf("replacing istio-cni's rules: %w", err)
	}
	return nil
}

// RemoveIstioHost removes istio-cni's host probe rules that SurveyHost
// found: its tables, and its chain in the shared nat tables with the rules
// that jump to it, in one transaction; the rest of those tables stays.
// Call it once our own host table is in place. Its ipsets go after, with
// DestroyIstioProbeSets, once the kernel has let go of the rules.
func RemoveIstioHost(fd int, s *IstioState) error {
	if !s.Found() {
		return nil
	}
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	for _, t := range s.Tables {
		c.DelTable(&nftables.Table{Family: t.Family, Name: t.Name})
	}
	for _, ic := range s.Chains {
		for _, j := range ic.jumps {
			if err := c.DelRule(j); err != nil {
				return err
			}
		}
		ch := &nftables.Chain{Name: ic.name, Table: &nftables.Table{Family: ic.table.Family, Name: ic.table.Name}}
		c.FlushChain(ch)
		c.DelChain(ch)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("removing istio-cni's host probe rules: %w", err)
	}
	return nil
}

// UsesIpsets says whether istio-cni's host state here is its iptables
// backend's, which keeps the probe set in ipsets.
func (s *IstioState) UsesIpsets() bool { return len(s.Chains) > 0 }

// ErrIpsetBusy is an ipset still referenced: the rules that used it are
// released by the kernel some time after their removal is committed.
var ErrIpsetBusy = errors.New("still referenced")

// DestroyIstioProbeSets destroys istio-cni's probe ipsets in the netns
// behind fd (those already gone are fine); ErrIpsetBusy while a rule that
// used them is not released yet.
func DestroyIstioProbeSets(fd int) error {
	h, err := netlink.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("ipset socket in the host netns: %w", err)
	}
	defer h.Close()
	var errs []error
	for _, name := range IstioProbeSets {
		switch err := h.IpsetDestroy(name); {
		case err == nil, errors.Is(err, unix.ENOENT):
		case errors.Is(err, unix.EBUSY):
			errs = append(errs, fmt.Errorf("istio-cni's ipset %s: %w", name, ErrIpsetBusy))
		default:
			errs = append(errs, fmt.Errorf("removing istio-cni's ipset %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	case nftables.TableFamilyINet:
		return "inet"
	}
	return fmt.Sprintf("family-%d", f)
}
