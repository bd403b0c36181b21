package integration

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	types040 "github.com/containernetworking/cni/pkg/types/040"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/nftcni/nftcni/internal/testnet"
)

// A node whose primary is a single-plugin .conf at cniVersion 0.2.0 (the
// shape of the CNI project's README example), with the real reference
// bridge plugin: the agent's installer asks bridge which versions it
// speaks, converts the file to a list at the lowest one that chains
// (0.3.0 for bridge v1.10), pods get their network through bridge and
// nftcni at that version, and uninstall puts the original bytes back.
func TestOldConfIsChainedAtAVersionItsPluginSpeaks(t *testing.T) {
	h := newHost(t)
	if err := os.Remove(h.path()); err != nil {
		t.Fatal(err)
	}
	ref := referencePlugins(t)
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		copyFile(t, filepath.Join(ref, p), filepath.Join(h.bin, p))
	}
	conf := filepath.Join(h.conf, "10-mynet.conf")
	orig := []byte(fmt.Sprintf(`{
	"cniVersion": "0.2.0",
	"name": "mynet",
	"type": "bridge",
	"bridge": "nftold0",
	"isGateway": true,
	"ipMasq": false,
	"ipam": {
		"type": "host-local",
		"subnet": "10.94.0.0/24",
		"dataDir": %q
	}
}
`, filepath.Join(t.TempDir(), "ipam")))
	if err := os.WriteFile(conf, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := h.agent("install", "--once").CombinedOutput(); err != nil {
		t.Fatalf("install --once: %v\n%s", err, out)
	} else if !strings.Contains(string(out), "converted-to=0.3.0") {
		t.Errorf("the conversion is not logged with its version:\n%s", out)
	}
	if _, err := os.Stat(conf); !os.IsNotExist(err) {
		t.Fatalf("%s still there: it would sort first and bypass nftcni (%v)", conf, err)
	}
	list, err := libcni.ConfListFromFile(filepath.Join(h.conf, "10-mynet.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	if list.CNIVersion != "0.3.0" || len(list.Plugins) != 2 || list.Plugins[1].Network.Type != "nftcni" {
		t.Fatalf("converted list: cniVersion %s, plugins %d:\n%s", list.CNIVersion, len(list.Plugins), list.Bytes)
	}

	// A pod in an excluded namespace: bridge and nftcni both run at 0.3.0,
	// and no agent is needed to pass it through.
	pod := testnet.NewNS(t, "nftold")
	cni := libcni.NewCNIConfigWithCacheDir([]string{h.bin}, t.TempDir(), nil)
	rt := runtimeConf(pod, "kube-system", "old", nil)
	var res *types040.Result
	var got string // the result's own cniVersion, before any conversion
	err = ns.WithNetNSPath(h.netns.Path, func(ns.NetNS) error {
		r, err := cni.AddNetworkList(context.Background(), list, rt)
		if err != nil {
			return err
		}
		got = r.Version()
		if res, err = types040.GetResult(r); err != nil {
			return err
		}
		return cni.DelNetworkList(context.Background(), list, rt)
	})
	if err != nil {
		t.Fatalf("ADD/DEL through the converted list: %v", err)
	}
	if got != "0.3.0" || len(res.IPs) != 1 || !strings.HasPrefix(res.IPs[0].Address.String(), "10.94.0.") {
		t.Errorf("result at %s: %+v, want bridge's 0.3.0 result with an address from 10.94.0.0/24", got, res)
	}

	if out, err := h.agent("uninstall").CombinedOutput(); err != nil {
		t.Fatalf("uninstall: %v\n%s", err, out)
	}
	back, err := os.ReadFile(conf)
	if err != nil || !bytes.Equal(back, orig) {
		t.Fatalf("after uninstall %s is not the original (%v):\n%s", conf, err, back)
	}
	if ents, _ := os.ReadDir(h.conf); len(ents) != 1 {
		t.Errorf("conf dir after uninstall holds %d files, want only the original", len(ents))
	}
}
