package nft

import (
	"fmt"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/userdata"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// ruleCommentType is libnftnl's NFTNL_UDATA_RULE_COMMENT, the TLV nft reads
// a rule's comment from.
const ruleCommentType userdata.Type = 0

// conn opens a netlink connection in the netns behind fd. The library
// dials inside that netns itself; no setns here.
// The connection is lasting: one socket serves the list and the batch
// (a transient one would dial, which means entering the netns, per call).
// Callers CloseLasting it.
func conn(fd int) (*nftables.Conn, error) {
	return nftables.New(nftables.WithNetNSFd(fd), nftables.AsLasting())
}

// ourTables lists which of the named inet tables exist.
func ourTables(c *nftables.Conn, names []string) (map[string]bool, error) {
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("listing inet tables: %w", err)
	}
	have := map[string]bool{}
	for _, t := range ts {
		if slices.Contains(names, t.Name) {
			have[t.Name] = true
		}
	}
	return have, nil
}

// HasTable says whether the netns behind fd holds inet table name.
func HasTable(fd int, name string) (bool, error) {
	c, err := conn(fd)
	if err != nil {
		return false, err
	}
	defer c.CloseLasting()
	have, err := ourTables(c, []string{name})
	return have[name], err
}

func (rs *Ruleset) names() []string {
	var n []string
	for _, t := range rs.Tables {
		n = append(n, t.Name)
	}
	return n
}

// Apply programs rs into the netns behind fd in one
// transaction: into a netns without our tables it only adds (the cheap
// path); over existing ones it deletes and re-adds them in the same
// transaction, an atomic replace. Policy routes follow. Other tables are
// never touched. It is Program of rs's Batch: callers that apply one
// ruleset many times encode it once.
func Apply(fd int, rs *Ruleset) error {
	b, err := Encode(rs)
	if err != nil {
		return err
	}
	return Program(fd, b)
}

// stage queues on c the messages that make rs's tables exist; Encode makes
// the table creation exclusive.
func stage(c *nftables.Conn, rs *Ruleset) error {
	var setID uint32
	for _, t := range rs.Tables {
		nt := c.AddTable(&nftables.Table{Name: t.Name, Family: nftables.TableFamilyINet})
		for _, s := range t.Sets {
			setID++ // per batch, so concurrent applies share no counter
			ns := nftSet(nt, s, setID)
			chunks := elementChunks(kernelElements(s))
			if err := c.AddSet(ns, chunks[0]); err != nil {
				return fmt.Errorf("table %s set %s: %w", t.Name, s.Name, err)
			}
			for _, ch := range chunks[1:] {
				if err := c.SetAddElements(ns, ch); err != nil {
					return fmt.Errorf("table %s set %s: %w", t.Name, s.Name, err)
				}
			}
		}
		chains := make([]*nftables.Chain, len(t.Chains))
		for i, ch := range t.Chains { // all chains first: rules may jump forward
			chains[i] = c.AddChain(nftChain(nt, ch))
		}
		for i, ch := range t.Chains {
			for _, r := range ch.Rules {
				c.AddRule(nftRule(nt, chains[i], r))
			}
		}
	}
	return nil
}

// Delete removes the named tables and the policy routes of rs; anything
// already gone (table, routes, even the netns) is not an error.
func Delete(fd int, rs *Ruleset) error {
	r, err := EncodeRemoval(rs)
	if err != nil {
		return err
	}
	return nlsend.Remove(fd, r)
}

func nftSet(t *nftables.Table, s *Set, id uint32) *nftables.Set {
	return &nftables.Set{Table: t, Name: s.Name, ID: id, KeyType: s.keyType(), Interval: s.Interval, Comment: s.Comment}
}

func nftChain(t *nftables.Table, ch *Chain) *nftables.Chain {
	nc := &nftables.Chain{Name: ch.Name, Table: t}
	if ch.Hook != nil {
		accept := nftables.ChainPolicyAccept
		hook := ch.Hook.Hook
		prio := nftables.ChainPriority(ch.Hook.Priority)
		nc.Type, nc.Hooknum, nc.Priority, nc.Policy = ch.Hook.Type, &hook, &prio, &accept
	}
	return nc
}

func nftRule(t *nftables.Table, c *nftables.Chain, r Rule) *nftables.Rule {
	return &nftables.Rule{Table: t, Chain: c, Exprs: ruleExprs(r), UserData: userdata.AppendString(nil, ruleCommentType, r.Tag())}
}
