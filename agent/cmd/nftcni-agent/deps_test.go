package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoBinaryRun: production code programs everything through netlink and
// never runs a binary (iptables, nft, ip, tc). No package of ours that the
// agent or the plugin links imports os/exec, and neither links the
// test-only internal/testnet (which runs ip and nft to set up and read
// back network namespaces). client-go's own use of os/exec (exec
// credential plugins) is not ours and is left out.
func TestNoBinaryRun(t *testing.T) {
	out, err := exec.Command("go", "list", "-buildvcs=false", "-deps", "-f", "{{.ImportPath}} {{join .Imports \",\"}}",
		".", "../../../plugin/cmd/nftcni").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	ours := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, imports, _ := strings.Cut(line, " ")
		if !strings.HasPrefix(pkg, "github.com/nftcni/nftcni/") {
			continue
		}
		ours++
		if pkg == "github.com/nftcni/nftcni/internal/testnet" {
			t.Errorf("a production binary links %s", pkg)
		}
		for _, imp := range strings.Split(imports, ",") {
			if imp == "os/exec" {
				t.Errorf("%s imports os/exec", pkg)
			}
		}
	}
	if ours < 10 {
		t.Fatalf("go list gave %d packages of ours:\n%s", ours, out)
	}
}
