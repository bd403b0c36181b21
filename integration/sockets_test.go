package integration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/istiotest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/sockfile"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

// TestLiveZDSSocketIsNeverTaken: an agent whose ZDS socket path another
// live process serves — a second nftcni agent with a run dir of its own,
// or istio-cni's agent still running during a rollout — waits, then
// refuses, naming that process; the one serving goes on serving ztunnel.
func TestLiveZDSSocketIsNeverTaken(t *testing.T) {
	newcomer := func(t *testing.T, n *cniNode, zsock, holder string) {
		t.Helper()
		logs := &syncBuffer{}
		_, err := node.Start(context.Background(), node.Config{RunDir: t.TempDir(), HostNetns: n.node.Path, ZtunnelSocket: zsock,
			ZtunnelSocketWait: 500 * time.Millisecond, IPv6: true, Policy: n.policy, Store: n.store,
			Log: slog.New(slog.NewTextHandler(logs, nil))})
		var inUse *sockfile.InUseError
		if !errors.As(err, &inUse) || !strings.Contains(err.Error(), holder) {
			t.Fatalf("a second agent on a served ZDS socket: %v, want a refusal naming %q\n%s", err, holder, logs)
		}
		// The holder still serves: a new ztunnel connects and gets its snapshot.
		z := ztunneltest.Connect(t, zsock)
		z.Wait(zds.KindSnapshotSent, "", 10*time.Second)
	}
	t.Run("nftcni", func(t *testing.T) {
		n := newCNINode(t, 63)
		n.startAgent()
		newcomer(t, n, n.zsock, fmt.Sprintf("pid %d", os.Getpid())) // this test binary serves it
	})
	t.Run("istio-cni", func(t *testing.T) {
		istiotest.Bins(t)
		kube := kubetest.Start(t)
		istioNamespaces(t, kube)
		h := enrolWithIstio(t, kube, 64, 0, true)
		newcomer(t, h.n, h.agent.ZtunnelSocket, "install-cni")
	})
}
