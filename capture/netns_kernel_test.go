//go:build !unit

package capture

import (
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// TestApplyMatchesGoldenInNetns programs every variant into a fresh netns and
// checks that nft lists exactly the golden text, that Verify agrees, that a
// second Apply (atomic replace) gives the same, and that Delete removes the
// table and policy routes and succeeds again when they are gone.
func TestApplyMatchesGoldenInNetns(t *testing.T) {
	testnet.RequireRoot(t)
	for _, v := range variants(t) {
		t.Run(v.name, func(t *testing.T) {
			n := testnet.NewNS(t, "nftgold")
			table := v.rs.Tables[0].Name
			if err := nft.Apply(n.FD, v.rs); err != nil {
				t.Fatal(err)
			}
			want := nft.Render(v.rs.Tables...)
			if got := testnet.NftList(t, n, table); got != want {
				t.Fatalf("nft lists:\n%s\nwant:\n%s", got, want)
			}
			if err := nft.Verify(n.FD, v.rs); err != nil {
				t.Fatalf("verify after apply: %v", err)
			}
			// What inspect prints, read through netlink, is what nft prints.
			// (google/nftables v0.3.0 does not read a set's comment back.)
			noSetComments := regexp.MustCompile(`\t\tcomment "[^"]*"\n`).ReplaceAllString(want, "")
			if got, err := nft.Live(n.FD, table, v.rs); err != nil || got != noSetComments {
				t.Fatalf("Live: %v\n%s\nwant:\n%s", err, got, noSetComments)
			}
			if err := nft.Apply(n.FD, v.rs); err != nil {
				t.Fatalf("re-apply: %v", err)
			}
			if got := testnet.NftList(t, n, table); got != want {
				t.Fatalf("after replace nft lists:\n%s", got)
			}
			for _, fam := range []string{"-4", "-6"} {
				out, _ := exec.Command("ip", "-n", n.Name, fam, "rule").CombinedOutput()
				want := 0
				for _, r := range v.rs.Routes {
					if r.V6 == (fam == "-6") {
						want++
					}
				}
				if got := strings.Count(string(out), "fwmark"); got != want {
					t.Errorf("ip %s rule: %d fwmark rules after two applies, want %d:\n%s", fam, got, want, out)
				}
			}
			if err := nft.Delete(n.FD, v.rs); err != nil {
				t.Fatal(err)
			}
			if got := testnet.NftList(t, n, table); !strings.HasPrefix(got, "error:") {
				t.Fatalf("table still there after delete:\n%s", got)
			}
			if err := nft.Verify(n.FD, &nft.Ruleset{Routes: v.rs.Routes}); len(v.rs.Routes) > 0 && err == nil {
				t.Error("policy routes still there after delete")
			}
			if err := nft.Delete(n.FD, v.rs); err != nil {
				t.Errorf("second delete: %v", err)
			}
			var d *nft.DriftError
			if err := nft.Verify(n.FD, v.rs); !errors.As(err, &d) {
				t.Errorf("verify of a deleted ruleset: %v", err)
			}
		})
	}
}

func TestVerifyDetectsDriftAndApplyRepairs(t *testing.T) {
	testnet.RequireRoot(t)
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
	// Each mess is reported by name: the chain and the rule that differs.
	for name, c := range map[string]struct {
		mess []string
		says []string
	}{
		"flushed chain":  {[]string{"flush", "chain", "inet", nft.PodTable, natOut}, []string{"chain nftcni nat-output is empty but should hold 10 rules, the first: meta l4proto tcp ip daddr 169.254.7.127 counter accept"}},
		"extra rule":     {[]string{"add", "rule", "inet", nft.PodTable, natPre, "tcp", "dport", "22", "accept"}, []string{"chain nftcni nat-prerouting: rule 5 is not nftcni's (no nftcni comment): meta(16) cmp(0,06) payload(2,2,2) cmp(0,0016) verdict(1,)"}},
		"deleted table":  {[]string{"delete", "table", "inet", nft.PodTable}, []string{"table inet nftcni is missing"}},
		"foreign chain":  {[]string{"add", "chain", "inet", nft.PodTable, "intruder"}, []string{"chain nftcni intruder is not ours"}},
		"flushed table":  {[]string{"flush", "table", "inet", nft.PodTable}, []string{"chain nftcni mangle-output is empty but should hold 1 rules, the first: ct mark & 0x00000fff == 0x00000111 counter meta mark set ct mark"}},
		"whole ruleset":  {[]string{"flush", "ruleset"}, []string{"table inet nftcni is missing"}},
		"inserted first": {[]string{"insert", "rule", "inet", nft.PodTable, mangleOut, "accept"}, []string{"chain nftcni mangle-output: rule 1 is not nftcni's (no nftcni comment): verdict(1,)"}},
	} {
		mess := c.mess
		t.Run(name, func(t *testing.T) {
			n := testnet.NewNS(t, "nftdrift")
			if err := nft.Apply(n.FD, rs); err != nil {
				t.Fatal(err)
			}
			testnet.Nft(t, n, mess...)
			var d *nft.DriftError
			err := nft.Verify(n.FD, rs)
			if !errors.As(err, &d) {
				t.Fatalf("drift not detected: %v", err)
			}
			for _, want := range c.says {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("drift message does not say %q:\n%v", want, err)
				}
			}
			if name == "extra rule" {
				if live, err := nft.Live(n.FD, nft.PodTable, rs); err != nil || !strings.Contains(live, "# not a rule nftcni wrote") {
					t.Errorf("Live does not show the foreign rule: %v\n%s", err, live)
				}
			}
			if err := nft.Apply(n.FD, rs); err != nil {
				t.Fatal(err)
			}
			if err := nft.Verify(n.FD, rs); err != nil {
				t.Fatalf("still drifting after re-apply: %v", err)
			}
		})
	}
	t.Run("rule replaced under our comment", func(t *testing.T) {
		n := testnet.NewNS(t, "nftdrift")
		if err := nft.Apply(n.FD, rs); err != nil {
			t.Fatal(err)
		}
		// Keep the first rule's tag but change what it does.
		out, err := exec.Command("ip", "netns", "exec", n.Name, "nft", "-a", "list", "chain", "inet", nft.PodTable, mangleOut).CombinedOutput()
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		m := regexp.MustCompile(`comment "(nftcni:[0-9a-f]+)" # handle (\d+)`).FindStringSubmatch(string(out))
		if m == nil {
			t.Fatalf("no tagged rule in:\n%s", out)
		}
		testnet.Nft(t, n, "replace", "rule", "inet", nft.PodTable, mangleOut, "handle", m[2], "meta", "mark", "0x1", "accept", "comment", `"`+m[1]+`"`)
		var d *nft.DriftError
		if err := nft.Verify(n.FD, rs); !errors.As(err, &d) {
			t.Fatalf("replaced rule not detected: %v", err)
		}
	})
	t.Run("policy route removed", func(t *testing.T) {
		n := testnet.NewNS(t, "nftdrift")
		if err := nft.Apply(n.FD, rs); err != nil {
			t.Fatal(err)
		}
		testnet.IP(t, "-n", n.Name, "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100")
		if err := nft.Verify(n.FD, rs); err == nil || !strings.Contains(err.Error(), "ip rule") {
			t.Fatalf("missing ip rule not reported: %v", err)
		}
	})
}

// TestOtherTablesAreLeftAlone puts iptables-nft, iptables-legacy and a plain
// nft table in the pod netns; applying and deleting ours changes none of them.
func TestOtherTablesAreLeftAlone(t *testing.T) {
	testnet.RequireRoot(t)
	n := testnet.NewNS(t, "nftcoex")
	testnet.Nft(t, n, "add", "table", "inet", "someone-else")
	testnet.Nft(t, n, "add", "chain", "inet", "someone-else", "c", "{ type filter hook input priority 0; }")
	ipt := addIptables(t, n)
	before := testnet.NftRuleset(t, n)
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
	if err := nft.Apply(n.FD, rs); err != nil {
		t.Fatal(err)
	}
	if err := nft.Apply(n.FD, rs); err != nil {
		t.Fatal(err)
	}
	if err := nft.Delete(n.FD, rs); err != nil {
		t.Fatal(err)
	}
	if after := testnet.NftRuleset(t, n); after != before {
		t.Errorf("other rules changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	for _, c := range ipt {
		out, err := exec.Command("ip", "netns", "exec", n.Name, c, "-t", "nat", "-S").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "nftcni-coexist") {
			t.Errorf("%s rules lost: %v\n%s", c, err, out)
		}
	}
}

// addIptables adds a nat rule with each iptables variant present.
func addIptables(t *testing.T, n *testnet.NS) []string {
	t.Helper()
	var used []string
	for _, c := range []string{"iptables-nft", "iptables-legacy"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Logf("%s not installed; skipping that part", c)
			continue
		}
		out, err := exec.Command("ip", "netns", "exec", n.Name, c, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9999",
			"-m", "comment", "--comment", "nftcni-coexist", "-j", "RETURN").CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", c, err, out)
		}
		used = append(used, c)
	}
	return used
}

// TestConcurrentAppliesIntoManyNetns applies rulesets into 50 netns at once
// (run with -race to check that applies share no mutable state).
func TestConcurrentAppliesIntoManyNetns(t *testing.T) {
	testnet.RequireRoot(t)
	var nss []*testnet.NS
	for i := 0; i < 50; i++ {
		nss = append(nss, testnet.NewNS(t, "nftconc"))
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(nss))
	for i, n := range nss {
		wg.Add(1)
		go func(i int, n *testnet.NS) {
			defer wg.Done()
			rs := Ambient(AmbientSpec{DNSCapture: i%2 == 0, IPv6: true})
			if i%3 == 0 {
				rs = Sidecar(SidecarSpec{Mode: istio.ModeTProxy, InboundAll: true, OutboundAll: true, ProxyUID: 1337, ProxyGID: 1337, IPv6: true})
			}
			if err := nft.Apply(n.FD, rs); err != nil {
				errs <- fmt.Errorf("netns %d: %w", i, err)
				return
			}
			if err := nft.Verify(n.FD, rs); err != nil {
				errs <- fmt.Errorf("netns %d: %w", i, err)
			}
		}(i, n)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// Sets of thousands of elements are programmed whole: one netlink message
// holds at most 64 KiB of elements, so they go in several. (A single
// message made the kernel read a few hundred of them.) The host probe set
// of a node's restored pods and an annotation's thousands of CIDRs alike.
func TestLargeSetsAreProgrammedWhole(t *testing.T) {
	testnet.RequireRoot(t)
	var members []nft.Member
	var cidrs []string
	for i := range 3000 {
		a := netip.AddrFrom4([4]byte{10, 200 + byte(i>>16), byte(i >> 8), byte(i)})
		members = append(members, nft.Member{UID: fmt.Sprintf("5f0c3c5e-8d7a-4c1e-9c1b-%012d", i), IPs: []netip.Addr{a}})
		cidrs = append(cidrs, a.String()+"/32")
	}
	for _, v := range []variant{
		{"host probe set of 3000 pods", HostProbe(HostSpec{IPv6: true}, members)},
		{"3000 excluded CIDRs", Sidecar(sidecarDefaults(t, map[string]string{istio.AnnExcludeOutboundCIDRs: strings.Join(cidrs, ",")}, SidecarProxy{}))},
	} {
		t.Run(v.name, func(t *testing.T) {
			n := testnet.NewNS(t, "nftbig")
			if err := nft.Apply(n.FD, v.rs); err != nil {
				t.Fatal(err)
			}
			if err := nft.Verify(n.FD, v.rs); err != nil {
				t.Fatal(err)
			}
		})
	}
}
