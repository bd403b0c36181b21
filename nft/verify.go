package nft

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
)

// DriftError lists how a netns differs from the ruleset it should hold.
type DriftError struct{ Problems []string }

func (e *DriftError) Error() string {
	return "ruleset drift: " + strings.Join(e.Problems, "; ")
}

// Verify reports nil when the netns behind fd holds exactly rs: our tables,
// their base-chain hooks, sets with their elements, each chain's rules (by
// tag, in order, nothing extra) and the policy routes. Otherwise it returns
// a *DriftError naming every difference (or another error if it could not
// look). It reads only; it never changes anything.
func Verify(fd int, rs *Ruleset) error {
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	have, err := ourTables(c, rs.names())
	if err != nil {
		return err
	}
	var drift []string
	var allChains []*nftables.Chain
	if len(have) > 0 {
		if allChains, err = c.ListChainsOfTableFamily(nftables.TableFamilyINet); err != nil {
			return fmt.Errorf("listing chains: %w", err)
		}
	}
	for _, t := range rs.Tables {
		if !have[t.Name] {
			drift = append(drift, fmt.Sprintf("table inet %s is missing", t.Name))
			continue
		}
		p, err := verifyTable(c, t, allChains)
		if err != nil {
			return err
		}
		drift = append(drift, p...)
	}
	if err := routesPresent(fd, rs.Routes); err != nil {
		drift = append(drift, err.Error())
	}
	if len(drift) > 0 {
		return &DriftError{Problems: drift}
	}
	return nil
}

func verifyTable(c *nftables.Conn, t *Table, all []*nftables.Chain) ([]string, error) {
	var drift []string
	nt := &nftables.Table{Name: t.Name, Family: nftables.TableFamilyINet}
	live := map[string]*nftables.Chain{}
	for _, ch := range all {
		if ch.Table.Name == t.Name {
			live[ch.Name] = ch
		}
	}
	for _, ch := range t.Chains {
		lc := live[ch.Name]
		delete(live, ch.Name)
		if lc == nil {
			drift = append(drift, fmt.Sprintf("chain %s %s is missing", t.Name, ch.Name))
			continue
		}
		if p := hookDrift(ch, lc); p != "" {
			drift = append(drift, fmt.Sprintf("chain %s %s: %s", t.Name, ch.Name, p))
		}
		rules, err := c.GetRules(nt, lc)
		if err != nil {
			return nil, fmt.Errorf("listing rules of %s %s: %w", t.Name, ch.Name, err)
		}
		var got, want []string
		for _, r := range rules {
			tag, _ := userdata.GetString(r.UserData, ruleCommentType)
			got = append(got, tag+" "+shape(r.Exprs))
		}
		for _, r := range ch.Rules {
			want = append(want, r.Tag()+" "+shape(ruleExprs(r)))
		}
		if !slices.Equal(got, want) {
			drift = append(drift, fmt.Sprintf("chain %s %s: rules differ (have %d, want %d)", t.Name, ch.Name, len(got), len(want)))
		}
	}
	for name := range live {
		drift = append(drift, fmt.Sprintf("chain %s %s is not ours", t.Name, name))
	}
	sets, err := c.GetSets(nt)
	if err != nil {
		return nil, fmt.Errorf("listing sets of %s: %w", t.Name, err)
	}
	liveSets := map[string]*nftables.Set{}
	for _, s := range sets {
		liveSets[s.Name] = s
	}
	for _, s := range t.Sets {
		ls := liveSets[s.Name]
		delete(liveSets, s.Name)
		if ls == nil {
			drift = append(drift, fmt.Sprintf("set %s %s is missing", t.Name, s.Name))
			continue
		}
		els, err := c.GetSetElements(ls)
		if err != nil {
			return nil, fmt.Errorf("listing set %s %s: %w", t.Name, s.Name, err)
		}
		var got, want []string
		for _, e := range els {
			a, _ := netip.AddrFromSlice(e.Key)
			got = append(got, a.String()+" "+e.Comment)
		}
		for _, e := range s.Elements {
			want = append(want, e.Addr.String()+" "+e.Comment)
		}
		sort.Strings(got)
		sort.Strings(want)
		if !slices.Equal(got, want) {
			drift = append(drift, fmt.Sprintf("set %s %s: elements differ (have %v, want %v)", t.Name, s.Name, got, want))
		}
	}
	for name := range liveSets {
		drift = append(drift, fmt.Sprintf("set %s %s is not ours", t.Name, name))
	}
	return drift, nil
}

// shape describes the part of a rule google/nftables v0.3.0 decodes
// faithfully: expression kinds, and the operands of loads and compares.
// tproxy and socket are skipped (the library drops them when reading), and
// ct is compared by kind only (it reads `ct ... set` back as a load). With
// the tag this catches a rule replaced under our comment.
func shape(ex []expr.Any) string {
	var b strings.Builder
	for _, e := range ex {
		switch e := e.(type) {
		case *expr.TProxy, *expr.Socket:
			continue
		case *expr.Meta:
			fmt.Fprintf(&b, "meta(%d) ", e.Key)
		case *expr.Payload:
			fmt.Fprintf(&b, "payload(%d,%d,%d) ", e.Base, e.Offset, e.Len)
		case *expr.Cmp:
			fmt.Fprintf(&b, "cmp(%d,%x) ", e.Op, e.Data)
		case *expr.Verdict:
			fmt.Fprintf(&b, "verdict(%d,%s) ", e.Kind, e.Chain)
		default:
			fmt.Fprintf(&b, "%T ", e)
		}
	}
	return b.String()
}

func hookDrift(want *Chain, got *nftables.Chain) string {
	if want.Hook == nil {
		if got.Hooknum != nil {
			return "is a base chain, want a regular chain"
		}
		return ""
	}
	h := want.Hook
	switch {
	case got.Hooknum == nil:
		return "is a regular chain, want a base chain"
	case *got.Hooknum != h.Hook || got.Type != h.Type || got.Priority == nil || int32(*got.Priority) != h.Priority:
		return fmt.Sprintf("hook differs (want type %s hook %s priority %d)", h.Type, hookName(h.Hook), h.Priority)
	case got.Policy != nil && *got.Policy != nftables.ChainPolicyAccept:
		return "policy is not accept"
	}
	return ""
}
