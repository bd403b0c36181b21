//go:build !unit

package nft

import (
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/nftcni/nftcni/internal/testnet"
)

// istioShape builds in fd what each istio-cni backend leaves in a pod (the
// shapes the handover test reads from Istio's real agent), with
// google/nftables: iptables-nft's ip/ip6 nat, mangle and raw tables of
// ISTIO_* chains jumped to from base chains, or the native backend's inet
// istio-ambient-* tables. extra adds a rule of someone else's.
func istioShape(t *testing.T, fd int, native, extra bool) {
	t.Helper()
	c, err := conn(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseLasting()
	accept := []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictAccept}}
	if native {
		for _, name := range []string{"istio-ambient-nat", "istio-ambient-mangle", "istio-ambient-raw"} {
			tb := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: name})
			pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: tb, Type: nftables.ChainTypeFilter,
				Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityMangle})
			c.AddChain(&nftables.Chain{Name: "istio-prerouting", Table: tb})
			c.AddRule(&nftables.Rule{Table: tb, Chain: pre, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: "istio-prerouting"}}})
		}
	} else {
		for _, fam := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
			for _, name := range []string{"nat", "mangle", "raw"} {
				tb := c.AddTable(&nftables.Table{Family: fam, Name: name})
				typ, prio := nftables.ChainTypeFilter, nftables.ChainPriorityMangle
				if name == "nat" {
					typ, prio = nftables.ChainTypeNAT, nftables.ChainPriorityNATDest
				}
				pre := c.AddChain(&nftables.Chain{Name: "PREROUTING", Table: tb, Type: typ, Hooknum: nftables.ChainHookPrerouting, Priority: prio})
				istio := c.AddChain(&nftables.Chain{Name: "ISTIO_PRERT", Table: tb})
				c.AddRule(&nftables.Rule{Table: tb, Chain: pre, Exprs: []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictJump, Chain: "ISTIO_PRERT"}}})
				c.AddRule(&nftables.Rule{Table: tb, Chain: istio, Exprs: accept})
				if extra && fam == nftables.TableFamilyIPv4 && name == "nat" {
					c.AddRule(&nftables.Rule{Table: tb, Chain: pre, Exprs: accept})
				}
			}
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
}

// In one transaction, istio-cni's in-pod state goes and ours comes, for
// either backend; a netns holding anything else beside it is refused and
// left as it was.
func TestTakeOverFromIstio(t *testing.T) {
	rs := sample(true)
	b, err := Encode(rs)
	if err != nil {
		t.Fatal(err)
	}
	for _, native := range []bool{false, true} {
		name := map[bool]string{false: "iptables", true: "nftables"}[native]
		t.Run(name, func(t *testing.T) {
			n := testnet.NewNS(t, "takeover")
			istioShape(t, n.FD, native, false)
			s, err := SurveyPod(n.FD)
			if err != nil {
				t.Fatal(err)
			}
			if len(s.Unknown) > 0 || len(s.Tables) != 3+3*b2i(!native) {
				t.Fatalf("survey: tables %v unknown %v", s.Tables, s.Unknown)
			}
			if err := TakeOver(n.FD, b, s); err != nil {
				t.Fatal(err)
			}
			got := testnet.NftRuleset(t, n)
			if strings.Contains(got, "istio") || strings.Contains(got, "ISTIO") || !strings.Contains(got, "table inet nftcni") {
				t.Errorf("after the takeover:\n%s", got)
			}
			if err := Verify(n.FD, rs); err != nil {
				t.Errorf("our ruleset after the takeover: %v", err)
			}
			// A second survey finds nothing left to take over.
			if s, err := SurveyPod(n.FD); err != nil || s.Found() || len(s.Unknown) > 0 {
				t.Errorf("survey after the takeover: %+v %v", s, err)
			}
		})
	}
	t.Run("unknown rules beside Istio's", func(t *testing.T) {
		n := testnet.NewNS(t, "takeover")
		istioShape(t, n.FD, false, true)
		before := testnet.NftRuleset(t, n)
		s, err := SurveyPod(n.FD)
		if err != nil {
			t.Fatal(err)
		}
		if len(s.Unknown) != 1 || !strings.Contains(s.Unknown[0], "table ip nat") {
			t.Fatalf("survey: unknown %v, want table ip nat named", s.Unknown)
		}
		var fe *ForeignError
		if err := TakeOver(n.FD, b, s); !errors.As(err, &fe) {
			t.Fatalf("TakeOver of a netns with unknown rules: %v, want a ForeignError", err)
		}
		if after := testnet.NftRuleset(t, n); after != before {
			t.Errorf("a refused netns changed:\n%s\nwas:\n%s", after, before)
		}
	})
}

// A pod whose capture lives in iptables-legacy (x_tables, which nf_tables
// cannot see) is refused with the advice to drain, and left as it is.
func TestTakeOverRefusesIptablesLegacy(t *testing.T) {
	if _, err := exec.LookPath("iptables-legacy"); err != nil {
		t.Skip("iptables-legacy (Debian iptables) makes the fixture")
	}
	n := testnet.NewNS(t, "legacy")
	if out, err := exec.Command("ip", "netns", "exec", n.Name, "iptables-legacy", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001").CombinedOutput(); err != nil {
		t.Skipf("iptables-legacy cannot add a rule here: %v %s", err, out)
	}
	s, err := SurveyPod(n.FD)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Legacy) != 1 || s.Legacy[0] != "ip nat" {
		t.Fatalf("survey of a netns with iptables-legacy rules: legacy %v", s.Legacy)
	}
	var fe *ForeignError
	b, err := Encode(sample(false))
	if err != nil {
		t.Fatal(err)
	}
	if err := TakeOver(n.FD, b, s); !errors.As(err, &fe) || !strings.Contains(err.Error(), "drain") {
		t.Errorf("TakeOver: %v, want a refusal that says to drain", err)
	}
	if got := testnet.NftRuleset(t, n); strings.Contains(got, "nftcni") {
		t.Errorf("a refused netns got our table:\n%s", got)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
