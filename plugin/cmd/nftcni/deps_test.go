package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLinksNoEncoder: the plugin is exec'd for every pod sandbox, and each
// package it links runs its init before main; the netlink encoders cost a
// fresh process about 75 page faults. The agent encodes, the plugin only
// sends bytes (package nlsend). Nor does it link package net (with
// net/netip and unique: about 11 page faults, wherever it comes from:
// containernetworking/cni's types, a net.Conn) or log/slog (about 6, with
// log and context): it writes its own CNI errors and JSON log records.
func TestLinksNoEncoder(t *testing.T) {
	out, err := exec.Command("go", "list", "-buildvcs=false", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 {
		t.Fatalf("go list gave %d packages: %s", len(deps), out)
	}
	for _, d := range deps {
		for _, banned := range []string{"github.com/google/nftables", "github.com/mdlayher/netlink", "github.com/vishvananda/netlink", "github.com/nftcni/nftcni/nft",
			"net", "log/slog", "github.com/containernetworking/cni"} {
			if d == banned || strings.HasPrefix(d, banned+"/") && !strings.HasPrefix(d, "github.com/nftcni/nftcni/nft/nlsend") {
				t.Errorf("the plugin links %s", d)
			}
		}
	}
}
