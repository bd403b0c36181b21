package integration

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
)

// TestCRIEveryInstallMode: each install mode the agent offers for a node
// whose runtime runs the primary network (chained, owned, drop-in), as
// containerd's CRI loads it, on containerd 1.6 and 2.x: an enrolled pod
// starts captured (its ruleset, ztunnel has its netns, its outbound lands
// on ztunnel's 15001), a pod outside the mesh starts untouched, and
// uninstall leaves the primary's conflist byte-identical with nothing of
// ours in the conf dir. Drop-ins are read by libcni v1.3+ only: containerd
// 2.x runs nftcni from one, 1.6 never does (the test holds the docs to
// that). Standalone mode is an extra network that only Multus runs:
// TestStandaloneNetwork.
func TestCRIEveryInstallMode(t *testing.T) {
	for i, gen := range containerdtest.Generations(t) {
		for j, mode := range []string{"chained", "owned", "dropin"} {
			t.Run(gen.Name+"/"+mode, func(t *testing.T) { testCRIMode(t, gen, 70+3*i+j, mode) })
		}
	}
}

func testCRIMode(t *testing.T, gen containerdtest.Generation, subnet int, mode string) {
	n := placeCRINode(t, subnet, "1.0.0", "")
	orig, err := os.ReadFile(n.primary)
	if err != nil {
		t.Fatal(err)
	}
	n.podSrc = podSourceDir(t, criPods())
	n.startAgent("--mode", mode)
	n.startContainerd(gen, nil)
	readsDropIns := !strings.HasPrefix(gen.Name, "containerd-1.")

	app, appNS := n.run("mesh", "app", "uid-app", nil)
	if mode == "dropin" && !readsDropIns {
		if hasTable(t, appNS) {
			t.Errorf("%s ran nftcni from a drop-in: the docs say it reads none", gen.Name)
		}
		t.Logf("%s reads no drop-ins: mesh/app started without nftcni (use owned mode on it)", gen.Name)
	} else {
		if err := nft.Verify(appNS.FD, nft.Ambient(nft.AmbientSpec{DNSCapture: true})); err != nil {
			t.Errorf("mesh/app's ruleset in %s mode: %v", mode, err)
		}
		n.z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
		if _, err := appNS.Dial(t, "tcp", "192.0.2.1:443", testnet.DialOpts{}); err != nil {
			t.Fatal(err)
		}
		if a, err := testnet.Accept(t, n.z.Pod("uid-app").Outbound, 2*time.Second); err != nil || a.OrigDst.String() != "192.0.2.1:443" {
			t.Errorf("mesh/app's outbound in %s mode: %+v %v, want it on ztunnel's 15001", mode, a, err)
		}
	}
	web, webNS := n.run("plain", "web", "uid-web", nil)
	if hasTable(t, webNS) {
		t.Errorf("plain/web got a ruleset in %s mode", mode)
	}
	upstream := n.h.netns.Listen(t, n.gateway()+":8080", false)
	if _, err := webNS.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("plain/web's connection in %s mode: %v", mode, err)
	}
	n.remove(app)
	n.remove(web)

	// Uninstall: the primary as it was, and nothing of ours left.
	n.killAgent()
	run(t, n.h.agent("uninstall"))
	if got, _ := os.ReadFile(n.primary); !bytes.Equal(got, orig) {
		t.Errorf("after uninstall in %s mode the primary differs:\n%s\nwas:\n%s", mode, got, orig)
	}
	_ = filepath.WalkDir(n.h.conf, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && p != n.primary {
			b, _ := os.ReadFile(p)
			if bytes.Contains(b, []byte(`"nftcni"`)) {
				t.Errorf("after uninstall in %s mode %s is left:\n%s", mode, p, b)
			}
		}
		return nil
	})
}
