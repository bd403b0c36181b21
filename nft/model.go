// Package nft is the mechanism under nftcni's rulesets: a ruleset as plain
// data (tables, chains, sets, rules made of Terms, policy routes), encoded
// into one netlink batch and programmed into a network namespace through
// github.com/google/nftables, verified against the live kernel, and read
// back. It never runs the nft or iptables binaries. What the rulesets say
// (Istio's ambient and sidecar capture, the host probe table) is package
// capture's. Fake is the kernel in memory, for the callers' tests.
//
// Render prints a Ruleset the way `nft list table` does, which is what
// golden tests and debug output compare against. Apply sends a whole
// Ruleset as one netlink batch, so the kernel applies all of it or nothing.
//
// Design notes:
//   - One `inet` table per scope ("nftcni" in a pod, "nftcni-host" on the
//     host). We never touch another table, so rules made by iptables-nft,
//     iptables-legacy or other nft users in the same netns stay as they are.
//   - google/nftables v0.3.0 cannot decode tproxy, socket or `ct ... set`
//     expressions back, so Verify does not compare expressions. Every rule
//     carries a comment with a hash of its own text; Verify compares tables,
//     base-chain hooks, sets and, per chain, the exact list of rule tags.
//     A flushed, edited, reordered or extended chain shows up as drift.
//   - Address and port lists are named sets (CIDRs in interval sets), one
//     rule per list rather than Istio's one rule per entry, so a pod's
//     ruleset does not grow by a rule per CIDR. Anonymous sets are avoided:
//     applies share no set IDs and can run concurrently in different netns
//     without v0.3.0's global set-ID counter being touched.
package nft

import (
	"encoding/binary"
	"encoding/hex"
	"hash/fnv"
	"net/netip"
	"strings"

	"github.com/google/nftables"
)

// PodTable is our table in a pod netns.
const PodTable = "nftcni"

// Table is one nftables table of ours.
type Table struct {
	Name   string
	Sets   []*Set
	Chains []*Chain
}

// Hook makes a chain a base chain.
type Hook struct {
	Type     nftables.ChainType
	Hook     nftables.ChainHook
	Priority int32
}

// Chain is a base chain (Hook set) or a regular chain (jump target).
type Chain struct {
	Name  string
	Hook  *Hook
	Rules []Rule
}

// Rule is an ordered list of terms; Tag identifies its content.
type Rule []Term

// Set is a named set: of addresses (V6 says which family), of address
// prefixes (Interval), or of transport ports (Ports). Each element may
// carry a comment (the host probe set stores the pod UID there).
type Set struct {
	Name     string
	V6       bool
	Interval bool
	Ports    bool
	Comment  string
	Elements []Element
}

// Element is one set member: Addr, Prefix (an interval set's) or Port.
type Element struct {
	Addr    netip.Addr
	Prefix  netip.Prefix
	Port    uint16
	Comment string
	last    netip.Addr // Live only: the end of a range that is no prefix
}

// Route is policy routing that goes with a ruleset: `ip rule fwmark
// Mark/Mask lookup Table` plus a local default route in Table, per family.
type Route struct {
	Mark, Mask uint32
	Table      int
	Priority   int
	V6         bool
}

// Ruleset is everything one scope needs.
type Ruleset struct {
	Tables []*Table
	Routes []Route
	// LoopbackAddrs are addresses the scope needs on lo (a sidecar's IPv6
	// inbound passthrough source, ::6/128).
	LoopbackAddrs []netip.Prefix
}

// TagPrefix starts every rule comment we write.
const TagPrefix = "nftcni:"

// Text is the rule's nft syntax without its comment.
func (r Rule) Text() string {
	parts := make([]string, len(r))
	for i, t := range r {
		parts[i] = t.Text()
	}
	return strings.Join(parts, " ")
}

// Tag is the comment stored with the rule: a short hash of its text, so
// Verify can tell our rules apart without decoding them. The hash only has
// to tell the rules of one chain apart, not resist anyone: FNV-1a, whose
// package needs no init (crypto/sha256's FIPS packages cost the plugin's
// every exec a few page faults; rules tagged by older versions with a
// SHA-256 prefix are seen as drift once and replaced atomically).
func (r Rule) Tag() string {
	h := fnv.New64a()
	h.Write([]byte(r.Text()))
	sum := binary.BigEndian.AppendUint64(nil, h.Sum64())
	return TagPrefix + hex.EncodeToString(sum[:6])
}

func (t *Table) chain(name string) *Chain {
	for _, c := range t.Chains {
		if c.Name == name {
			return c
		}
	}
	return nil
}

// Add appends a rule to the named chain, creating a regular chain if needed.
func (t *Table) Add(chain string, terms ...Term) {
	c := t.chain(chain)
	if c == nil {
		c = &Chain{Name: chain}
		t.Chains = append(t.Chains, c)
	}
	c.Rules = append(c.Rules, Rule(terms))
}

// Base declares a base chain; declare them first, in listing order.
func (t *Table) Base(name string, typ nftables.ChainType, hook *nftables.ChainHook, prio int32) {
	t.Chains = append(t.Chains, &Chain{Name: name, Hook: &Hook{Type: typ, Hook: *hook, Priority: prio}})
}
