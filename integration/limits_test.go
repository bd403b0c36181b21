package integration

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// bigAnnotations are n KiB of pod annotations (Kubernetes allows 256 KiB).
func bigAnnotations(kib int) map[string]string {
	ann := map[string]string{}
	for i := 0; i < kib; i++ {
		ann[fmt.Sprintf("example.com/blob-%03d", i)] = strings.Repeat("x", 1000)
	}
	return ann
}

// TestHugeAnnotationsEnrol: a pod with 200 KiB of annotations, which the
// runtime passes to the plugin (io.kubernetes.cri.pod-annotations), starts
// captured. The plugin forwarded every annotation in its add message,
// which then passed the socket's 64 KiB limit, and the failed send was
// taken for "agent cannot be reached": such a pod could never start.
func TestHugeAnnotationsEnrol(t *testing.T) {
	n := newCNINode(t, 67)
	n.startAgent()
	ann := bigAnnotations(200)
	n.pod(meshNS, "big", ann)
	pod := testnet.NewNS(t, "nftpod")
	if _, err := n.add(n.list("bridge", "1.0.0", true, false), runtimeConf(pod, meshNS, "big", ann)); err != nil {
		t.Fatalf("ADD of a pod with 200 KiB of annotations: %v", err)
	}
	if !hasTable(t, pod) {
		t.Error("the pod is not captured")
	}
	n.ztunnel.Wait(zds.KindAdd, "uid-big", 5*time.Second)
}

// sidecarCIDRs are count distinct /32s, as an excludeOutboundIPRanges
// annotation lists them.
func sidecarCIDRs(count int) string {
	var out []string
	for i := 0; i < count; i++ {
		out = append(out, netip.AddrFrom4([4]byte{100, 64 + byte(i>>16), byte(i >> 8), byte(i)}).String()+"/32")
	}
	return strings.Join(out, ",")
}

// TestSidecarManyCIDRsEnrol: a sidecar pod whose
// traffic.sidecar.istio.io/excludeOutboundIPRanges lists 2000 addresses
// (a valid 30 KB annotation) starts with its ruleset in place. One rule
// per CIDR made the decision's encoded ruleset pass the 64 KiB message
// limit at about 168 CIDRs, and the ADD failed ("plugin went away before
// the decision"), naming neither the annotation nor the cause. In a set
// they encode to 88 KB, still past the limit: the agent programs the
// batch itself, and every element is in the kernel.
func TestSidecarManyCIDRsEnrol(t *testing.T) {
	n := newCNINode(t, 68)
	n.startAgent()
	ann := map[string]string{istio.AnnSidecarStatus: `{"containers":["istio-proxy"]}`,
		istio.AnnExcludeOutboundCIDRs: sidecarCIDRs(2000)}
	p := n.pod(plainNS, "side", ann)
	p.Spec.Containers = []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}
	pod := testnet.NewNS(t, "nftpod")
	if _, err := n.add(n.list("bridge", "1.0.0", true, false), runtimeConf(pod, plainNS, "side", nil)); err != nil {
		t.Fatalf("ADD of a sidecar pod excluding 2000 CIDRs: %v", err)
	}
	spec, err := capture.ParseSidecar(ann, capture.SidecarProxy{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Verify(pod.FD, capture.Sidecar(spec)); err != nil {
		t.Errorf("the sidecar ruleset: %v", err)
	}
}
