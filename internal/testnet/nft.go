package testnet

import (
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// Tests may read rules back with the nft binary; the product never runs it.

var counters = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// NftList runs `nft list table inet <table>` in n, with counters
// normalised to "counter"; a table that is not there reads "error: ...".
func NftList(t testing.TB, n *NS, table string) string {
	t.Helper()
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("the nft binary (Debian nftables) is needed to read rules back")
	}
	out, err := exec.Command("ip", "netns", "exec", n.Name, "nft", "list", "table", "inet", table).CombinedOutput()
	if err != nil {
		return "error: " + strings.TrimSpace(string(out))
	}
	return counters.ReplaceAllString(string(out), "counter")
}

// Nft runs nft with args in n and fails the test when it fails.
func Nft(t testing.TB, n *NS, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", append([]string{"netns", "exec", n.Name, "nft"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("nft %v: %v\n%s", args, err, out)
	}
}

// NftRuleset is `nft list ruleset` in n, counters normalised.
func NftRuleset(t testing.TB, n *NS) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", n.Name, "nft", "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list ruleset: %v\n%s", err, out)
	}
	return counters.ReplaceAllString(string(out), "counter")
}
