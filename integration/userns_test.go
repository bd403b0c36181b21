package integration

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/nft"
)

// TestCRIUserNamespacePod: a pod with a user namespace of its own
// (hostUsers: false; kubelet asks CRI for one with these ID mappings) gets
// a network namespace owned by that user namespace. It starts captured
// all the same — its ruleset, ztunnel has its netns, its outbound lands on
// ztunnel's 15001 — with nothing run on the host: the agent writes the
// rules through netlink sockets it makes in the pod's netns as root of the
// host's user namespace. (istio-cni needed nsenter for such pods.) Through
// containerd 2.x's CRI, as kubelet would ask it; containerd 1.6 has no
// user namespaces for pods.
func TestCRIUserNamespacePod(t *testing.T) {
	var gen *containerdtest.Generation
	for _, g := range containerdtest.Generations(t) {
		if !strings.HasPrefix(g.Name, "containerd-1.") {
			gen = &g
		}
	}
	if gen == nil {
		t.Skip("no containerd 2.x")
	}
	n := newCRINode(t, *gen, 80, "1.0.0", "nftcni")
	cfg := n.ctrd.Pod("mesh", "app", "uid-app", nil)
	ids := []*runtimeapi.IDMapping{{HostId: 1 << 20, ContainerId: 0, Length: 65536}}
	cfg.Linux.SecurityContext = &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: &runtimeapi.NamespaceOption{
		Network: runtimeapi.NamespaceMode_POD, Pid: runtimeapi.NamespaceMode_CONTAINER, Ipc: runtimeapi.NamespaceMode_POD,
		UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_POD, Uids: ids, Gids: ids}}}
	id, err := n.ctrd.Run(cfg)
	if err != nil {
		t.Fatalf("RunPodSandbox with a user namespace: %v\n%s", err, tail(n.ctrd.Log(), 20))
	}
	s, err := n.ctrd.Status(id)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(s.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	ns := &testnet.NS{Name: s.Netns[strings.LastIndexByte(s.Netns, '/')+1:], Path: s.Netns, FD: fd}

	// The pod's netns belongs to a user namespace that is not the host's.
	owner, err := unix.IoctlRetInt(fd, unix.NS_GET_USERNS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(owner)
	var own, host unix.Stat_t
	if err := unix.Fstat(owner, &own); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat("/proc/self/ns/user", &host); err != nil {
		t.Fatal(err)
	}
	if own.Ino == host.Ino {
		t.Fatal("the sandbox's netns belongs to the host's user namespace: the runtime gave the pod none of its own")
	}

	if err := nft.Verify(fd, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("the user-namespace pod's ruleset: %v", err)
	}
	n.z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	if _, err := ns.Dial(t, "tcp", "192.0.2.1:443", testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if a, err := testnet.Accept(t, n.z.Pod("uid-app").Outbound, 2*time.Second); err != nil || a.OrigDst.String() != "192.0.2.1:443" {
		t.Errorf("the user-namespace pod's outbound: %+v %v, want it on ztunnel's 15001", a, err)
	}
	n.remove(s)
}
