package nft

import (
	"fmt"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
)

// Live prints the table named name as the netns behind fd holds it, in
// the layout Render uses, read through netlink (no nft binary). Chains,
// hooks, sets and their elements are printed from what the kernel returns.
// A rule is printed from want's rule with the same tag when its readable
// structure matches too (the tag is a hash of that rule's text, and
// google/nftables cannot decode tproxy, socket or `ct ... set` back into
// text); any other rule is printed as a comment describing the expressions
// it could read, so a foreign or edited rule is visible, never hidden.
// A set's own comment is left out: google/nftables v0.3.0 does not read it
// back (element comments it does). It returns "" when the table does not
// exist.
func Live(fd int, name string, want *Ruleset) (string, error) {
	c, err := conn(fd)
	if err != nil {
		return "", err
	}
	defer c.CloseLasting()
	have, err := ourTables(c, []string{name})
	if err != nil || !have[name] {
		return "", err
	}
	known := map[string]Rule{}
	if want != nil {
		for _, t := range want.Tables {
			for _, ch := range t.Chains {
				for _, r := range ch.Rules {
					known[r.Tag()+" "+shape(ruleExprs(r))] = r
				}
			}
		}
	}
	nt := &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
	var b strings.Builder
	fmt.Fprintf(&b, "table inet %s {\n", name)
	first := true
	sep := func() {
		if !first {
			b.WriteString("\n")
		}
		first = false
	}
	sets, err := c.GetSets(nt)
	if err != nil {
		return "", fmt.Errorf("listing sets of %s: %w", name, err)
	}
	for _, s := range sets {
		els, err := c.GetSetElements(s)
		if err != nil {
			return "", fmt.Errorf("listing set %s %s: %w", name, s.Name, err)
		}
		sep()
		renderSet(&b, setFromKernel(s, els))
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return "", fmt.Errorf("listing chains: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name != name {
			continue
		}
		sep()
		fmt.Fprintf(&b, "\tchain %s {\n", ch.Name)
		if ch.Hooknum != nil && ch.Priority != nil {
			h := &Hook{Type: ch.Type, Hook: *ch.Hooknum, Priority: int32(*ch.Priority)}
			policy := "accept"
			if ch.Policy != nil && *ch.Policy == nftables.ChainPolicyDrop {
				policy = "drop"
			}
			fmt.Fprintf(&b, "\t\ttype %s hook %s priority %s; policy %s;\n", h.Type, hookName(h.Hook), prioName(h), policy)
		}
		rules, err := c.GetRules(nt, ch)
		if err != nil {
			return "", fmt.Errorf("listing rules of %s %s: %w", name, ch.Name, err)
		}
		for _, r := range rules {
			tag, _ := userdata.GetString(r.UserData, ruleCommentType)
			if k, ok := known[tag+" "+shape(r.Exprs)]; ok {
				fmt.Fprintf(&b, "\t\t%s comment %q\n", k.Text(), tag)
				continue
			}
			fmt.Fprintf(&b, "\t\t# not a rule nftcni wrote (comment %q): %s\n", tag, strings.TrimSpace(shape(r.Exprs)))
		}
		b.WriteString("\t}\n")
	}
	b.WriteString("}\n")
	return b.String(), nil
}

func ruleExprs(r Rule) []expr.Any {
	var ex []expr.Any
	for _, term := range r {
		ex = append(ex, term.Exprs()...)
	}
	return ex
}
