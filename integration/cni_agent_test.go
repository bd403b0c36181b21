package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// With the agent gone, a pod the policy snapshot enrols fails ADD with a
// message naming the socket (and the runtime's DEL after it succeeds); a pod
// it does not enrol starts.
func TestCNIAgentDown(t *testing.T) {
	n := newCNINode(t, 60)
	n.startAgent() // writes the policy snapshot
	n.stopAgent()
	full := n.list("bridge", "1.0.0", true, false)
	sock := filepath.Join(n.run, wire.SocketName)

	for _, stale := range []bool{false, true} {
		name := "gone"
		if stale {
			// A crashed agent leaves its socket behind: connect is refused.
			name = "stale"
			l, err := (&netListenConfig{}).listen(sock)
			if err != nil {
				t.Fatal(err)
			}
			l.Close()
		}
		t.Run(name, func(t *testing.T) {
			meshPod := testnet.NewNS(t, "nftpod")
			n.pod(meshNS, "app-"+name, nil)
			rt := runtimeConf(meshPod, meshNS, "app-"+name, nil)
			_, err := n.add(full, rt)
			if err == nil {
				t.Fatal("ADD of an enrolled-namespace pod succeeded with no agent")
			}
			if !strings.Contains(err.Error(), sock) || !strings.Contains(err.Error(), "must be enrolled") {
				t.Errorf("ADD error does not name the agent socket: %v", err)
			}
			var cniErr *types.Error
			if !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater {
				t.Errorf("ADD error %#v, want CNI code %d (try again later)", err, types.ErrTryAgainLater)
			}
			if hasTable(t, meshPod) {
				t.Error("a failed ADD left our table behind")
			}
			if err := n.del(full, rt); err != nil {
				t.Errorf("DEL after the failed ADD: %v", err)
			}

			plainPod := testnet.NewNS(t, "nftpod")
			n.pod(plainNS, "web-"+name, nil)
			prt := runtimeConf(plainPod, plainNS, "web-"+name, nil)
			if _, err := n.add(full, prt); err != nil {
				t.Errorf("ADD of a pod outside the mesh failed with the agent down: %v", err)
			}
			if err := n.del(full, prt); err != nil {
				t.Errorf("DEL: %v", err)
			}
		})
	}
	// The plugin wrote what happened to its rolling log, since nobody
	// could take its records.
	b, err := os.ReadFile(filepath.Join(n.run, wire.LogName))
	if err != nil || !strings.Contains(string(b), "letting it through") {
		t.Errorf("plugin log file: %v\n%s", err, b)
	}
}

// fdCount counts this process's open descriptors; the agent runs in-process.
func fdCount(t *testing.T) int { t.Helper(); return openFDs(t, os.Getpid()) }

// settledFDs is fdCount once it has held still for longer than the agent
// keeps the sockets of a removal open (an earlier test's DELs may have
// some still queued for closing).
func settledFDs(t *testing.T) int {
	t.Helper()
	n, since := fdCount(t), time.Now()
	for deadline := since.Add(5 * time.Second); time.Since(since) < 500*time.Millisecond && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if m := fdCount(t); m != n {
			n, since = m, time.Now()
		}
	}
	return n
}

// 50 ADDs at once into 50 namespaces all succeed with the right rules, and
// the agent is back to its descriptors and goroutines after the DELs.
func TestCNIConcurrentAdds(t *testing.T) {
	const pods = 50
	n := newCNINode(t, 61)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	nss := make([]*testnet.NS, pods)
	rts := make([]*libcni.RuntimeConf, pods)
	for i := range nss {
		nss[i] = testnet.NewNS(t, "nftpod")
		name := "app-" + nss[i].Name
		n.pod(meshNS, name, nil)
		rts[i] = runtimeConf(nss[i], meshNS, name, nil)
	}
	fds, goroutines := settledFDs(t), runtime.NumGoroutine()

	run := func(f func(i int) error) []error {
		errs := make([]error, pods)
		var wg sync.WaitGroup
		for i := range pods {
			wg.Add(1)
			go func() { defer wg.Done(); errs[i] = f(i) }()
		}
		wg.Wait()
		return errs
	}
	for i, err := range run(func(i int) error { _, err := n.add(full, rts[i]); return err }) {
		if err != nil {
			t.Errorf("ADD %d: %v", i, err)
		}
	}
	want := capture.Ambient(capture.AmbientSpec{DNSCapture: true})
	for i, p := range nss {
		if err := nft.Verify(p.FD, want); err != nil {
			t.Errorf("pod %d: %v", i, err)
		}
	}
	if got := len(n.enroller().Members()); got != pods {
		t.Errorf("agent enrolled %d pods, want %d", got, pods)
	}
	// Per pod, this process holds: the agent's one netns descriptor (the
	// ZDS server borrows it), and the test ztunnel's netns and three
	// listeners.
	if got := fdCount(t); got != fds+5*pods {
		t.Errorf("descriptors after %d ADDs: %d, want %d (5 per pod)", pods, got, fds+5*pods)
	}
	if got := len(n.ztunnel.UIDs()); got != pods {
		t.Errorf("ztunnel holds %d pods, want %d", got, pods)
	}
	for i, err := range run(func(i int) error { return n.del(full, rts[i]) }) {
		if err != nil {
			t.Errorf("DEL %d: %v", i, err)
		}
	}
	// The agent closes the sockets it removed rules with after its answer
	// (nft.Kernel's closeLater), so both counts settle shortly after the DELs.
	deadline := time.Now().Add(2 * time.Second)
	for (fdCount(t) != fds || runtime.NumGoroutine() > goroutines) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := fdCount(t); got != fds {
		t.Errorf("descriptors after DELs: %d, want %d", got, fds)
	}
	if got := runtime.NumGoroutine(); got > goroutines {
		t.Errorf("goroutines after DELs: %d, before ADDs: %d", got, goroutines)
	}
	if got := n.metric("istio_cni_plugin_requests_total", "type", "add", "result", "success"); got != pods {
		t.Errorf("add requests counted: %v", got)
	}
}

// A sidecar-injected pod whose annotations come with the runtime's call
// gets the sidecar ruleset the agent decides from its spec (the proxy's
// UID lives there), with the exclusions its annotations name.
func TestCNISidecarFromRuntimeAnnotations(t *testing.T) {
	n := newCNINode(t, 59)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	ann := map[string]string{
		istio.AnnSidecarStatus:        `{"initContainers":["istio-validation"],"containers":["istio-proxy"],"revision":"default"}`,
		istio.AnnExcludeOutboundPorts: "9999",
	}
	p := n.pod(plainNS, "sidecar", ann)
	p.Spec.Containers = []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}
	pod := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(pod, plainNS, "sidecar", ann)
	r, err := n.add(full, rt)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	spec, err := capture.ParseSidecar(ann, capture.SidecarProxy{})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Verify(pod.FD, capture.Sidecar(spec)); err != nil {
		t.Errorf("sidecar ruleset: %v", err)
	}
	if got := n.metric("istio_cni_plugin_requests_total", "type", "add", "result", "success"); got != 1 {
		t.Errorf("the agent decided %v ADDs, want the sidecar pod's one", got)
	}
	// REDIRECT capture: outbound lands on the sidecar's 15001, except the
	// excluded port, which goes straight out.
	gw := gateway(t, r)
	proxy := pod.Listen(t, ":15001", false)
	if _, err := pod.Dial(t, "tcp", gw.String()+":80", testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, proxy, 2*time.Second); err != nil {
		t.Errorf("outbound did not land on the sidecar: %v", err)
	}
	upstream := n.node.Listen(t, gw.String()+":9999", false)
	if _, err := pod.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("excluded port was captured: %v", err)
	}
	if err := n.del(full, rt); err != nil {
		t.Errorf("DEL: %v", err)
	}
	if hasTable(t, pod) {
		t.Error("table still there after DEL")
	}
}

// Without runtime annotations the agent decides a sidecar pod from its
// spec: here a proxy running as uid 2000, so the rules exempt uid 2000.
func TestCNISidecarFromAgent(t *testing.T) {
	n := newCNINode(t, 65)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	uid := int64(2000)
	p := n.pod(plainNS, "side", map[string]string{istio.AnnSidecarStatus: `{"containers":["istio-proxy"]}`})
	p.Spec.Containers = []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: &uid}}}
	pod := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(pod, plainNS, "side", nil)
	if _, err := n.add(full, rt); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	spec, err := capture.ParseSidecar(p.Annotations, capture.SidecarProxy{UID: 2000})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Verify(pod.FD, capture.Sidecar(spec)); err != nil {
		t.Errorf("sidecar ruleset from the agent: %v", err)
	}
	if got := n.enroller().Members(); len(got) != 1 || got[0].Mode != wire.ModeSidecar {
		t.Errorf("members %+v", got)
	}
	if err := n.del(full, rt); err != nil {
		t.Errorf("DEL: %v", err)
	}
}

// STATUS fails only when the entry opts in; GC releases what the agent holds
// for attachments the runtime no longer has.
func TestCNIStatusAndGC(t *testing.T) {
	n := newCNINode(t, 63)
	lenient := n.list("bridge", "1.1.0", true, false)
	strict := n.list("bridge", "1.1.0", true, true)
	status := func(l *libcni.NetworkConfigList) error {
		return n.inNode(func() error { return n.cni.GetStatusNetworkList(context.Background(), l) })
	}
	if err := status(lenient); err != nil {
		t.Errorf("STATUS without the agent, status_requires_agent=false: %v", err)
	}
	err := status(strict)
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrPluginNotAvailable || !strings.Contains(err.Error(), n.run) {
		t.Errorf("STATUS without the agent, status_requires_agent=true: %v, want code 50 naming the socket", err)
	}
	n.startAgent()
	if err := status(strict); err != nil {
		t.Errorf("STATUS with the agent: %v", err)
	}

	kept, gone := testnet.NewNS(t, "nftpod"), testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "kept", nil)
	n.pod(meshNS, "gone", nil)
	krt := runtimeConf(kept, meshNS, "kept", nil)
	if _, err := n.add(lenient, krt); err != nil {
		t.Fatal(err)
	}
	// "gone" is enrolled by a direct plugin call, so the runtime's cache
	// does not know it and only our GC can release it.
	grt := runtimeConf(gone, meshNS, "gone", nil)
	prev, err := n.add(n.list("bridge", "1.1.0", false, false), grt)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.execNftcni("ADD", "1.1.0", prev, grt); err != nil {
		t.Fatal(err)
	}
	if got := len(n.enroller().Members()); got != 2 {
		t.Fatalf("members before GC: %d", got)
	}
	err = n.inNode(func() error {
		return n.cni.GCNetworkList(context.Background(), lenient, &libcni.GCArgs{
			ValidAttachments: []types.GCAttachment{{ContainerID: krt.ContainerID, IfName: "eth0"}}})
	})
	if err != nil {
		t.Fatalf("GC: %v", err)
	}
	if got := n.enroller().Members(); len(got) != 1 || got[0].Pod.Name != "kept" {
		t.Errorf("members after GC: %+v, want only kept", got)
	}

	// A GC while no agent runs: the plugin leaves the runtime's list, and
	// the restarted agent releases every pod the list does not name
	// instead of handing it to ztunnel again.
	later := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "later", nil)
	lrt := runtimeConf(later, meshNS, "later", nil)
	// Out of the runtime's cache: only the GC's list can say it is gone
	// (libcni's GC first DELs every attachment its cache holds).
	bridgeOnly := n.list("bridge", "1.1.0", false, false)
	if prev, err = n.add(bridgeOnly, lrt); err != nil {
		t.Fatal(err)
	}
	if _, err := n.execNftcni("ADD", "1.1.0", prev, lrt); err != nil {
		t.Fatal(err)
	}
	if err := n.del(bridgeOnly, lrt); err != nil {
		t.Fatal(err)
	}
	n.stopAgent()
	err = n.inNode(func() error {
		return n.cni.GCNetworkList(context.Background(), lenient, &libcni.GCArgs{
			ValidAttachments: []types.GCAttachment{{ContainerID: krt.ContainerID, IfName: "eth0"}}})
	})
	if err != nil {
		t.Fatalf("GC without the agent: %v", err)
	}
	n.startAgent()
	if got := n.enroller().Members(); len(got) != 1 || got[0].Pod.Name != "kept" {
		t.Errorf("members after a GC while no agent ran: %+v, want only kept", got)
	}
	for _, e := range n.ztunnel.Seen() {
		if e.UID == "uid-later" {
			t.Errorf("ztunnel got %s for a pod the runtime's GC dropped", e.Kind)
		}
	}
}

// A pod that was running before the agent knew it (no ADD ever reached
// this agent) is enrolled late through a /proc scan: its UID from its
// cgroup path, its netns checked for its IP.
func TestLateEnrolmentFindsThePodThroughProc(t *testing.T) {
	n := newCNINode(t, 73)
	n.startAgent()
	const uid = "7d2a4c1e-0000-4111-8222-933344445555"
	p := testnet.NewPair(t, 34)
	testnet.PodProcess(t, p.Pod, uid)
	pod := n.pod(meshNS, "old", nil)
	pod.UID = uid
	pod.Status.PodIPs = []corev1.PodIP{{IP: p.PodIP4.String()}}
	if err := n.enroller().Reconcile(context.Background(), meshNS, "old"); err != nil {
		t.Fatal(err)
	}
	if e := n.ztunnel.Wait(zds.KindAdd, uid, 3*time.Second); e.FDs != 1 {
		t.Errorf("ZDS Add carried %d fds", e.FDs)
	}
	if err := nft.Verify(p.Pod.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("rules in the found netns: %v", err)
	}
	if err := nft.Verify(p.Node.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err == nil {
		t.Error("rules landed in the node netns")
	}
	if set := n.probeSet(t); !strings.Contains(set, p.PodIP4.String()) {
		t.Errorf("probe set lacks the pod:\n%s", set)
	}
}

// ztunnel refusing a pod fails its ADD: the plugin had programmed the rules
// (the agent hands the netns to ztunnel meanwhile) and removes them again,
// the agent keeps nothing for the pod, and the runtime's DEL succeeds.
func TestCNIZtunnelRefusalFailsTheAdd(t *testing.T) {
	n := newCNINode(t, 76)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	n.ztunnel.Refuse("uid-refused", "cannot enter netns")
	pod := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "refused", nil)
	rt := runtimeConf(pod, meshNS, "refused", nil)
	_, err := n.add(full, rt)
	if err == nil || !strings.Contains(err.Error(), "cannot enter netns") {
		t.Fatalf("ADD: %v, want ztunnel's refusal", err)
	}
	n.failedAddLeftNothing(t, pod, full, rt)
	// The next pod is enrolled as usual.
	ok := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "ok", nil)
	if _, err := n.add(full, runtimeConf(ok, meshNS, "ok", nil)); err != nil {
		t.Fatalf("ADD after a refusal: %v", err)
	}
	if !hasTable(t, ok) {
		t.Error("no rules for the next pod")
	}
}

// A ztunnel that never acks fails the ADD with an error naming ztunnel:
// the agent stops waiting for the ack before the plugin stops waiting for
// the agent, so the slowest party is the one the runtime reports (it used
// to be "i/o timeout" waiting for the agent). Nothing is left behind.
func TestCNIHungZtunnelIsNamed(t *testing.T) {
	n := newCNINode(t, 77)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	n.ztunnel.Stall("uid-hung", 6*time.Second) // past the plugin's 5 s
	pod := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "hung", nil)
	rt := runtimeConf(pod, meshNS, "hung", nil)
	_, err := n.add(full, rt)
	if err == nil || !strings.Contains(err.Error(), "ztunnel did not ack AddWorkload uid-hung") || strings.Contains(err.Error(), "waiting for the agent") {
		t.Fatalf("ADD with a hung ztunnel: %v, want an error naming ztunnel", err)
	}
	t.Logf("ADD: %v", err)
	n.failedAddLeftNothing(t, pod, full, rt)
}

// OpenShift-shaped: the runtime passes the pod's annotations, and its
// istio-proxy runs with an assigned UID (not 1337). The ruleset must exempt
// that UID, which only the pod spec says: the app's outbound is captured,
// the proxy's own is not (else it would loop back into itself). With the
// agent down, such a pod fails closed instead of getting a guessed UID.
func TestCNISidecarWithRuntimeAnnotationsTakesTheProxyUIDFromTheSpec(t *testing.T) {
	n := newCNINode(t, 62)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	const proxyUID = 1000650000
	uid := int64(proxyUID)
	ann := map[string]string{istio.AnnSidecarStatus: `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}
	p := n.pod(plainNS, "openshift", ann)
	p.Spec.Containers = []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}}}
	pod := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(pod, plainNS, "openshift", ann) // annotations in runtimeConfig, as containerd passes them
	if _, err := n.add(full, rt); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	spec, err := capture.ParseSidecar(ann, capture.SidecarProxy{UID: proxyUID, GID: proxyUID})
	if err != nil {
		t.Fatal(err)
	}
	if err := nft.Verify(pod.FD, capture.Sidecar(spec)); err != nil {
		t.Errorf("sidecar ruleset: %v", err)
	}

	gw := fmt.Sprintf("10.88.%d.1", n.subnet)
	upstream := n.node.Listen(t, gw+":0", false)
	proxy := pod.Listen(t, ":15001", false)
	// The app (any other UID): captured, to the proxy's 15001.
	if _, err := pod.Dial(t, "tcp", upstream.Addr().String(), testnet.DialOpts{}); err != nil {
		t.Fatal(err)
	}
	if _, err := testnet.Accept(t, proxy, 2*time.Second); err != nil {
		t.Errorf("the app's outbound did not land on 15001: %v", err)
	}
	// The proxy itself: straight out.
	host, port, _ := net.SplitHostPort(upstream.Addr().String())
	cmd := exec.Command("ip", "netns", "exec", pod.Name, "setpriv", fmt.Sprintf("--reuid=%d", proxyUID), fmt.Sprintf("--regid=%d", proxyUID),
		"--clear-groups", "bash", "-c", fmt.Sprintf("exec 3<>/dev/tcp/%s/%s && echo hi >&3", host, port))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("dialling as the proxy's UID: %v\n%s", err, out)
	}
	if _, err := testnet.Accept(t, upstream, 2*time.Second); err != nil {
		t.Errorf("the proxy's own outbound was captured (did not reach upstream): %v", err)
	}
	if err := n.del(full, rt); err != nil {
		t.Errorf("DEL: %v", err)
	}

	n.stopAgent()
	other := testnet.NewNS(t, "nftpod")
	_, err = n.add(full, runtimeConf(other, plainNS, "openshift2", ann))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater || !strings.Contains(err.Error(), "UID") {
		t.Errorf("sidecar ADD with the agent down: %v, want code 11 saying the proxy UID needs the agent", err)
	}
	if hasTable(t, other) {
		t.Error("a sidecar pod got a ruleset with a guessed proxy UID")
	}
}

// failedAddLeftNothing checks what a failed ADD leaves, as soon as it has
// returned: no rules in the pod, no pod held by the agent, and a DEL that
// succeeds. The plugin's error says the rules were removed again, so the
// agent's undo must be over when the runtime has that error.
func (n *cniNode) failedAddLeftNothing(t *testing.T, pod *testnet.NS, l *libcni.NetworkConfigList, rt *libcni.RuntimeConf) {
	t.Helper()
	if hasTable(t, pod) {
		t.Error("rules left in the pod of a failed enrolment when its ADD returned")
	}
	if held := len(n.enroller().Members()); held != 0 {
		t.Errorf("agent holds %d pods when the failed ADD returned", held)
	}
	if err := n.del(l, rt); err != nil {
		t.Errorf("DEL after the failed ADD: %v", err)
	}
}

// The agent's undo of a failed enrolment follows the plugin's outcome,
// and ztunnel's ack of the undo's Del comes before the rules go: with a
// slow ztunnel, a plugin that returned once it had sent its outcome
// reported the rules "removed again" while they were still in the pod
// (CI found the race once, in TestCNIHungZtunnelIsNamed). Here the agent's
// own part fails (its host probe table is gone) after ztunnel has acked.
func TestCNIFailedAddReturnsOnceUndone(t *testing.T) {
	n := newCNINode(t, 78)
	n.startAgent()
	full := n.list("bridge", "1.0.0", true, false)
	testnet.Nft(t, n.node, "delete", "table", "inet", nft.HostTable)
	n.ztunnel.SlowAcks(300 * time.Millisecond)
	pod := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "undone", nil)
	rt := runtimeConf(pod, meshNS, "undone", nil)
	start := time.Now()
	_, err := n.add(full, rt)
	if err == nil || !strings.Contains(err.Error(), "host probe set") {
		t.Fatalf("ADD without the host probe table: %v, want the probe set's error", err)
	}
	t.Logf("ADD returned after %v: %v", time.Since(start).Round(time.Millisecond), err)
	n.failedAddLeftNothing(t, pod, full, rt)
	if uids := n.ztunnel.UIDs(); len(uids) != 0 {
		t.Errorf("ztunnel still holds %v after the undo", uids)
	}
}

// TestCNIAgentBackWithinTheWait: the agent is down (a reboot, an upgrade)
// when a mesh pod's ADD runs; the ADD waits for it instead of failing, and
// once the agent is back the pod is enrolled in that same ADD: captured,
// in ztunnel's hands, with no failed sandbox for the runtime to retry.
func TestCNIAgentBackWithinTheWait(t *testing.T) {
	n := newCNINode(t, 61)
	n.startAgent() // writes the policy snapshot
	n.stopAgent()
	took := addWithinTheWait(t, n, "the agent", n.startAgent)
	t.Logf("the ADD waited for the agent and enrolled the pod %v after it began", took)
}

// An ADD to enrol a pod while the agent runs but no ztunnel is connected
// (after a reboot the agent's pod can be back before ztunnel's) asks the
// agent again until a ztunnel connects, within its wait for the agent,
// then the pod is enrolled and the new ztunnel holds it. Before, the ADD
// failed at once ("no ztunnel connection") into the kubelet's back-off.
func TestCNIZtunnelBackWithinTheWait(t *testing.T) {
	n := newCNINode(t, 62)
	n.startAgent()
	n.ztunnel.Close()
	n.ztunnel = nil
	for deadline := time.Now().Add(3 * time.Second); n.agent.ZDS.Accepting(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the agent still counts the closed ztunnel as connected")
		}
	}
	took := addWithinTheWait(t, n, "ztunnel", func() { n.ztunnel = ztunneltest.Connect(t, n.zsock) })
	t.Logf("the ADD asked again until ztunnel connected and enrolled the pod %v after it began", took)
}

// addWithinTheWait runs a mesh pod's ADD through libcni and the real
// plugin binary, with a 20 s wait for the agent, while what is missing
// (the agent, a ztunnel) is away; 1.5 s in, with the ADD still waiting and
// nothing programmed, back() brings it back; the ADD must then succeed
// with the pod's ruleset in place and ztunnel holding the pod. It returns
// the ADD's time, and deletes the pod.
func addWithinTheWait(t *testing.T, n *cniNode, missing string, back func()) time.Duration {
	t.Helper()
	n.agentWait = 20
	full := n.list("bridge", "1.0.0", true, false)
	pod := testnet.NewNS(t, "nftpod")
	n.pod(meshNS, "late", nil)
	rt := runtimeConf(pod, meshNS, "late", nil)
	type result struct {
		err  error
		took time.Duration
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() { _, err := n.add(full, rt); done <- result{err, time.Since(start)} }()
	const away = 1500 * time.Millisecond
	select {
	case r := <-done:
		t.Fatalf("the ADD ended while %s was away: %v after %v", missing, r.err, r.took)
	case <-time.After(away):
	}
	if hasTable(t, pod) {
		t.Errorf("the pod has a ruleset while its ADD waits for %s", missing)
	}
	back()
	r := <-done
	if r.err != nil {
		t.Fatalf("ADD with %s back after %v: %v", missing, away, r.err)
	}
	if r.took > away+5*time.Second {
		t.Errorf("the ADD took %v with %s back after %v", r.took, missing, away)
	}
	if !hasTable(t, pod) {
		t.Error("the pod has no ruleset after its ADD")
	}
	if n.ztunnel.Pod("uid-late") == nil {
		t.Error("ztunnel does not hold the pod")
	}
	if err := n.del(full, rt); err != nil {
		t.Errorf("DEL: %v", err)
	}
	return r.took.Round(time.Millisecond)
}
