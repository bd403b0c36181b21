package conformance

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// TestSuiteCatchesTProxyHBONEReturn is the suite checked against a known
// defect: nftcni's TPROXY ruleset with the `tcp dport 15008 return` put
// back into its mangle inbound chain (where it was before the suite found
// it) must differ from Istio's rules, and the difference must name the
// probe to 15008.
func TestSuiteCatchesTProxyHBONEReturn(t *testing.T) {
	testnet.RequireRoot(t)
	golden, err := os.ReadFile(filepath.Join(IstioModule(t), "cni", "pkg", "plugin", "testdata", "tproxy.txt.golden"))
	if err != nil {
		t.Fatal(err)
	}
	pol, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	rs := decided(t, pol, sidecarPod(map[string]string{istio.AnnInterceptionMode: istio.ModeTProxy}, nil, nil, nil), nil, []string{PodIP4.String() + "/24"})
	mutated := false
	for _, ch := range rs.Tables[0].Chains {
		if ch.Name == "mangle-inbound" && len(ch.Rules) > 3 {
			ch.Rules = slices.Insert(ch.Rules, 3, nft.Rule{nft.DPort(nft.TCP, nft.Eq, istio.HBONEPort), nft.Counter(), nft.Return()})
			mutated = true
		}
	}
	if !mutated {
		t.Fatal("no mangle-inbound chain to put the return back into")
	}
	c := Case{Name: "mutant/tproxy-15008-return", ProxyUID: istio.ProxyID, ProxyGID: istio.ProxyID}
	istioTwin, nftTwin := NewTwin(t, "istio", c.Shape), NewTwin(t, "nftcni", c.Shape)
	istioTwin.LoadIptables(t, string(golden))
	istioSidecarNetlink(t, istioTwin, true, true, false)
	applyNftcni(t, nftTwin, rs)
	r := Differ(t, c, istioTwin, nftTwin)
	want := fmt.Sprintf("in tcp node -> %s", netip.AddrPortFrom(PodIP4, istio.HBONEPort))
	found := false
	for _, d := range r.Diffs {
		t.Logf("the suite reports: %q: Istio %q, nftcni %q", d.Probe, d.Istio, d.Nftcni)
		found = found || d.Probe == want
	}
	if !found {
		t.Errorf("the mutant was not caught by probe %q (differences: %v)", want, r.Diffs)
	}
}
