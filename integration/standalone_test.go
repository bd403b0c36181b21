package integration

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/templates"
)

// TestStandaloneNetwork runs nftcni's standalone conflist (installMode
// standalone: what Multus attaches as an extra network, the OpenShift
// profile) through libcni after a pod's primary network is up, as Multus
// runs a delegate: no prevResult, an interface name of its own. An
// enrolled pod gets its ruleset with the addresses its netns holds, and
// its traffic lands on ztunnel; the result is a valid, empty one; CHECK
// and DEL work; a pod outside the mesh is left alone.
func TestStandaloneNetwork(t *testing.T) {
	n := newCNINode(t, 62)
	n.startAgent()
	primary := n.list("bridge", "1.0.0", false, false)
	doc, err := templates.Standalone(templates.Values{LogLevel: n.pluginLogLevel, AgentRunDir: n.run,
		ExcludeNamespaces: []string{"kube-system"}, PodNamespace: "nftcni-system"}, "1.0.0", "nftcni")
	if err != nil {
		t.Fatal(err)
	}
	standalone, err := libcni.NetworkConfFromBytes(doc)
	if err != nil {
		t.Fatalf("the standalone conflist does not load: %v\n%s", err, doc)
	}
	attach := func(pod *testnet.NS, ns, name string) (*libcni.RuntimeConf, *current.Result) {
		t.Helper()
		rt := runtimeConf(pod, ns, name, nil)
		prev, err := n.add(primary, rt)
		if err != nil {
			t.Fatalf("primary ADD: %v", err)
		}
		extra := *rt
		extra.IfName = "net1" // Multus's name for the first extra network
		r, err := n.add(standalone, &extra)
		if err != nil {
			t.Fatalf("standalone ADD of %s/%s: %v\n%s", ns, name, err, n.log)
		}
		res, err := current.NewResultFromResult(r)
		if err != nil || len(res.IPs) != 0 || len(res.Interfaces) != 0 || r.Version() != "1.0.0" {
			t.Errorf("standalone ADD result %+v (version %s) %v, want an empty 1.0.0 result", res, r.Version(), err)
		}
		t.Cleanup(func() {
			_ = n.del(standalone, &extra)
			_ = n.del(primary, rt)
		})
		p, err := current.NewResultFromResult(prev)
		if err != nil {
			t.Fatal(err)
		}
		return &extra, p
	}

	enrolled := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "app", nil)
	rt, prev := attach(enrolled, meshNS, "app")
	if !hasTable(t, enrolled) {
		t.Fatalf("no ruleset in the enrolled pod:\n%s", n.log)
	}
	n.ztunnel.Wait(zds.KindAdd, "uid-app", 2*time.Second)
	podIP, _ := netip.AddrFromSlice(prev.IPs[0].Address.IP)
	if set := n.probeSet(t); !strings.Contains(set, podIP.Unmap().String()+` comment "uid-app"`) {
		t.Errorf("host probe set lacks the pod's address %s, read from its netns:\n%s", podIP, set)
	}
	gw, _ := netip.AddrFromSlice(prev.IPs[0].Gateway)
	if _, err := enrolled.Dial(t, "tcp", netip.AddrPortFrom(gw.Unmap(), 80).String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if a, err := testnet.Accept(t, n.ztunnel.Pod("uid-app").Outbound, 2*time.Second); err != nil || a.OrigDst != netip.AddrPortFrom(gw.Unmap(), 80) {
		t.Errorf("outbound TCP of the enrolled pod: %+v %v, want it on ztunnel's 15001", a, err)
	}
	if err := n.inNode(func() error { return n.cni.CheckNetworkList(context.Background(), standalone, rt) }); err != nil {
		t.Errorf("CHECK: %v", err)
	}
	if err := n.del(standalone, rt); err != nil {
		t.Errorf("DEL: %v", err)
	}
	if hasTable(t, enrolled) {
		t.Error("ruleset left after DEL")
	}

	plain := testnet.NewNS(t, "nftpod")
	n.pod(plainNS, "web", nil)
	attach(plain, plainNS, "web")
	if hasTable(t, plain) {
		t.Error("a pod outside the mesh got a ruleset")
	}
}
