package integration

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

// A new node: an ambient pod started before nftcni was ever installed on
// it (no ADD reached any agent, nothing recorded). The agent's first start
// finds the pod's netns through /proc and enrols it once ztunnel is there;
// the pod's outbound TCP then lands on ztunnel's 15001.
func TestPodRunningBeforeTheAgentsFirstStartIsEnrolled(t *testing.T) {
	const uid = "5e1f2a3b-0000-4aaa-8bbb-9cccddddeeee"
	p := testnet.NewPair(t, 36)
	testnet.PodProcess(t, p.Pod, uid)
	src := podSourceDir(t, fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Pod
metadata: {name: early, namespace: mesh, uid: %s}
status: {phase: Running, podIP: %s, podIPs: [{ip: %s}]}
`, uid, p.PodIP4, p.PodIP4))
	h := newHost(t)
	_, addr, alog := startAgent(t, h, "--pod-source", src)
	waitReady(t, addr)
	z := ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	if e := z.Wait(zds.KindAdd, uid, 10*time.Second); e.FDs != 1 {
		t.Fatalf("ZDS Add carried %d fds\n%s", e.FDs, alog)
	}
	// ztunnel has the pod before its traffic is redirected: the rules
	// follow its ack.
	eventually(t, "the pod's ruleset", func() bool { return hasTable(t, p.Pod) })
	if _, err := p.Pod.Dial(t, "tcp", netip.AddrPortFrom(p.NodeIP4, 80).String(), testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from the pod: %v", err)
	}
	a, err := testnet.Accept(t, z.Pod(uid).Outbound, 2*time.Second)
	if err != nil {
		t.Fatalf("the pod's outbound did not land on ztunnel's 15001: %v\n%s", err, alog)
	}
	if a.OrigDst != netip.AddrPortFrom(p.NodeIP4, 80) {
		t.Errorf("original destination %v", a.OrigDst)
	}
}
