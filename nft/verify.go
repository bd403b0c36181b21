package nft

import (
	"fmt"
	"slices"
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
	if err := routesPresent(fd, rs.Routes, rs.LoopbackAddrs); err != nil {
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
		drift = append(drift, ruleDrift(t.Name, ch, rules)...)
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
		if d := elementDrift(elementKeys(els), elementKeys(kernelElements(s))); d != "" {
			drift = append(drift, fmt.Sprintf("set %s %s: elements differ: %s", t.Name, s.Name, d))
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

// maxRuleProblems bounds how many rules of one chain a drift report names.
const maxRuleProblems = 5

// ruleDrift names, in chain order, each rule that is missing from a live
// chain or should not be there, by its position and its text (ours) or
// what can be read of it (anyone else's), aligning want with have on their
// longest common run so that one inserted rule is one problem.
func ruleDrift(table string, ch *Chain, live []*nftables.Rule) []string {
	key := func(tag string, ex []expr.Any) string { return tag + " " + shape(ex) }
	have := make([]string, len(live))
	tags := make([]string, len(live))
	for i, r := range live {
		tags[i], _ = userdata.GetString(r.UserData, ruleCommentType)
		have[i] = key(tags[i], r.Exprs)
	}
	want := make([]string, len(ch.Rules))
	byTag := map[string]Rule{}
	for i, r := range ch.Rules {
		want[i] = key(r.Tag(), ruleExprs(r))
		byTag[r.Tag()] = r
	}
	if slices.Equal(have, want) {
		return nil
	}
	if len(have) == 0 {
		return []string{fmt.Sprintf("chain %s %s is empty but should hold %d rules, the first: %s", table, ch.Name, len(want), ch.Rules[0].Text())}
	}
	// lcs[i][j]: longest common subsequence of want[i:] and have[j:].
	lcs := make([][]int, len(want)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(have)+1)
	}
	for i := len(want) - 1; i >= 0; i-- {
		for j := len(have) - 1; j >= 0; j-- {
			if want[i] == have[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var out []string
	more := 0
	note := func(p string) {
		if len(out) < maxRuleProblems {
			out = append(out, fmt.Sprintf("chain %s %s: %s", table, ch.Name, p))
		} else {
			more++
		}
	}
	for i, j := 0, 0; i < len(want) || j < len(have); {
		switch {
		case i < len(want) && j < len(have) && want[i] == have[j]:
			i, j = i+1, j+1
		case j < len(have) && (i == len(want) || lcs[i][j+1] >= lcs[i+1][j]):
			note(foreignRule(j+1, tags[j], live[j].Exprs, byTag))
			j++
		default:
			note(fmt.Sprintf("rule %d is missing: %s", i+1, ch.Rules[i].Text()))
			i++
		}
	}
	if more > 0 {
		out = append(out, fmt.Sprintf("chain %s %s: %d more rules differ", table, ch.Name, more))
	}
	return out
}

// foreignRule describes live rule n that is not one of ours as it stands.
func foreignRule(n int, tag string, ex []expr.Any, ours map[string]Rule) string {
	read := strings.TrimSpace(shape(ex))
	switch r, ok := ours[tag]; {
	case ok:
		return fmt.Sprintf("rule %d carries the comment of %q but is not that rule: %s", n, r.Text(), read)
	case strings.HasPrefix(tag, TagPrefix):
		return fmt.Sprintf("rule %d carries an nftcni comment of no rule here (%q): %s", n, tag, read)
	case tag == "":
		return fmt.Sprintf("rule %d is not nftcni's (no nftcni comment): %s", n, read)
	}
	return fmt.Sprintf("rule %d is not nftcni's (comment %q): %s", n, tag, read)
}
