package integration

// A real node: kubelet, the image, the chart installed with the real helm,
// and ztunnel's stand-in as a DaemonSet pod (nodetest). Everything a user
// does on a node, checked without kubectl exec: the workload reports what
// it reached.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/nftcni/nftcni/agent/install"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/runlock"
	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/integration/nodetest"
	"github.com/nftcni/nftcni/internal/ociimage"
)

const (
	nodeImageTag = "node-test"
	appImage     = "localhost/nodeapp:" + nodeImageTag
	ztunnelImage = "localhost/ztunnel-stub:" + nodeImageTag
)

// nodeImages builds the test's two images from the test binaries: the
// workload and ztunnel's stand-in (nftcni's is nftcniImage).
func nodeImages(t testing.TB) map[string][]byte {
	t.Helper()
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(binDir, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	archive := func(tag string, files []ociimage.File, entry, cmd []string) []byte {
		img, err := ociimage.Build(files, ociimage.Config{Entrypoint: entry, Cmd: cmd, Arch: "amd64"})
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(t.TempDir(), "image.tar")
		if err := ociimage.WriteArchive(img, tag, out); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	return map[string][]byte{
		"nodeapp":      archive(appImage, []ociimage.File{{Path: "/nodeapp", Data: read("nodeapp")}}, []string{"/nodeapp"}, []string{"serve"}),
		"ztunnel-stub": archive(ztunnelImage, []ociimage.File{{Path: "/ztunnel-stub", Data: read("ztunnel-stub")}}, []string{"/ztunnel-stub"}, nil),
	}
}

// nftcniImage is the image users install: the archive `make image` built
// ($NFTCNI_IMAGE, named $NFTCNI_IMAGE_REF; make test passes both), or, run
// without make, the same program (hack/mkimage) on the test's binaries. It
// returns the archive and the chart values that name it.
func nftcniImage(t testing.TB) ([]byte, []string) {
	t.Helper()
	path, ref := os.Getenv("NFTCNI_IMAGE"), os.Getenv("NFTCNI_IMAGE_REF")
	if path == "" {
		path, ref = filepath.Join(t.TempDir(), "nftcni-image.oci.tar"), "localhost/nftcni/nftcni:"+nodeImageTag
		if out, err := exec.Command("go", "run", "../hack/mkimage", "-bin", binDir, "-tag", ref, "-out", path).CombinedOutput(); err != nil {
			t.Fatalf("hack/mkimage: %v\n%s", err, out)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the image archive (make image): %v", err)
	}
	repo, tag, ok := strings.Cut(ref[strings.LastIndexByte(ref, '/')+1:], ":")
	hub := ref[:strings.LastIndexByte(ref, '/')]
	if !ok || repo != "nftcni" {
		t.Fatalf("image reference %q: want <hub>/nftcni:<tag>, as the chart names it", ref)
	}
	digest, err := ociimage.ArchiveDigest(b)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("installing the image %s (%s, manifest %s)", ref, path, digest)
	return b, []string{"--set", "hub=" + hub, "--set-string", "tag=" + tag}
}

func TestNode(t *testing.T) {
	for _, gen := range containerdtest.Generations(t) {
		t.Run(gen.Name, func(t *testing.T) { testNode(t, gen) })
	}
}

func testNode(t *testing.T, gen containerdtest.Generation) {
	n := nodetest.Start(t, gen)
	ctx := context.Background()
	imageValues := importImages(t, n)
	// A new node carries Istio's not-ready taint (as kubelet
	// --register-with-taints sets it): the real scheduler must place the
	// agent on it, and nothing else until the agent removes it.
	taint := `{"spec":{"taints":[{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]}}`
	if _, err := n.Client.CoreV1().Nodes().Patch(ctx, nodetest.NodeName, types.MergePatchType, []byte(taint), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	mkNamespace(t, n, "plain", nil)
	gated := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "gated", Namespace: "plain"}, Spec: corev1.PodSpec{
		Containers: []corev1.Container{{Name: "app", Image: appImage, ImagePullPolicy: corev1.PullNever}}}}
	if _, err := n.Client.CoreV1().Pods("plain").Create(ctx, gated, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	chart, _ := filepath.Abs("../deploy/charts/nftcni")
	values := append(imageValues, "--set", "pullPolicy=Never",
		"--set", "cniBinDir="+n.BinDir, "--set", "cniConfDir="+n.ConfDir)
	if out, err := n.Helm(append([]string{"install", "nftcni", chart, "--namespace", "kube-system", "--wait", "--timeout", "120s"}, values...)...); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	agent := waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node")
	t.Logf("agent pod %s Ready", agent)
	if _, err := os.Stat(filepath.Join(n.BinDir, "nftcni")); err != nil {
		t.Fatalf("the agent did not install the plugin: %v", err)
	}
	// The chart's default install mode, owned: our own conflist, the
	// primary's plugins plus ours, loaded first; the primary's untouched.
	owned := filepath.Join(n.ConfDir, install.DefaultOwnedName)
	conf, _ := os.ReadFile(owned)
	if !strings.Contains(string(conf), `"nftcni"`) || !strings.Contains(string(conf), `"bridge"`) {
		t.Fatalf("%s does not chain nftcni after the primary's plugins:\n%s", owned, conf)
	}
	if primary, _ := os.ReadFile(filepath.Join(n.ConfDir, nodetest.ConfFile)); string(primary) != n.PrimaryConflist() {
		t.Errorf("the primary's conflist changed:\n%s", primary)
	}

	// Still tainted: the gate waits for a ztunnel with its snapshot acked.
	if p, _ := n.Client.CoreV1().Pods("plain").Get(ctx, "gated", metav1.GetOptions{}); p == nil || p.Spec.NodeName != "" {
		t.Errorf("a pod was scheduled onto the node before ztunnel connected")
	}
	deployZtunnel(t, n)
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")
	n.WaitFor("the readiness gate: taint removed, condition nftcni.io/NetworkReady True", 60*time.Second, func() bool {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, nodetest.NodeName, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, tn := range node.Spec.Taints {
			if tn.Key == "cni.istio.io/not-ready" {
				return false
			}
		}
		for _, c := range node.Status.Conditions {
			if c.Type == "nftcni.io/NetworkReady" {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	})
	n.WaitFor("the gated pod scheduled once the taint is gone", 60*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("plain").Get(ctx, "gated", metav1.GetOptions{})
		return err == nil && p.Spec.NodeName == nodetest.NodeName
	})

	mkNamespace(t, n, "amb", map[string]string{"istio.io/dataplane-mode": "ambient"})
	plain := runApp(t, n, "plain", "app", false)
	amb := runApp(t, n, "amb", "app", true, corev1.EnvVar{Name: "LOOP", Value: plain + ":8081"})
	pod, err := n.Client.CoreV1().Pods("amb").Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pod.Annotations["ambient.istio.io/redirection"]; got != "enabled" {
		t.Errorf("ambient pod annotation ambient.istio.io/redirection = %q, want enabled", got)
	}
	ask := func(podIP, path string) string { t.Helper(); return askApp(t, n, podIP, path) }
	capturedOut := func(ip string) bool {
		return strings.HasPrefix(ask(ip, "/dial?addr="+plain+":8081"), "ztunnel:15001 dst="+plain+":8081")
	}
	// Outbound from the ambient pod lands on ztunnel's 15001; inbound from
	// another pod on 15006; the plain pod reaches the real server.
	if got := ask(amb, "/dial?addr="+plain+":8081"); !strings.HasPrefix(got, "ztunnel:15001 dst="+plain+":8081") {
		t.Errorf("ambient pod's outbound: %q, want ztunnel:15001 dst=%s:8081", got, plain)
	}
	if got := ask(plain, "/dial?addr="+amb+":8081"); !strings.HasPrefix(got, "ztunnel:15006 dst="+amb+":8081") {
		t.Errorf("inbound to the ambient pod: %q, want ztunnel:15006 dst=%s:8081", got, amb)
	}
	if got := ask(plain, "/dial?addr="+plain+":8081"); got != "app:8081" {
		t.Errorf("plain pod's outbound: %q, want the real server's app:8081", got)
	}
	// kubelet's probes reach the ambient pod through the host probe SNAT.
	if got := ask(amb, "/probes"); !strings.HasPrefix(got, "169.254.7.127:") {
		t.Errorf("last probe of the ambient pod came from %q, want 169.254.7.127 (the host probe SNAT)", got)
	}
	if got := ask(plain, "/probes"); strings.HasPrefix(got, "169.254.7.127:") || got == "" {
		t.Errorf("last probe of the plain pod came from %q, want the node's bridge address", got)
	}

	// Labelling a running pod's namespace enrols it; removing the label
	// releases it.
	mkNamespace(t, n, "late", nil)
	late := runApp(t, n, "late", "app", false)
	if capturedOut(late) {
		t.Fatal("a pod of an unlabelled namespace is captured")
	}
	labelNamespace(t, n, "late", `{"metadata":{"labels":{"istio.io/dataplane-mode":"ambient"}}}`)
	n.WaitFor("late enrolment after labelling the namespace", 30*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("late").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && p.Annotations["ambient.istio.io/redirection"] == "enabled" && capturedOut(late)
	})
	labelNamespace(t, n, "late", `{"metadata":{"labels":{"istio.io/dataplane-mode":null}}}`)
	n.WaitFor("release after removing the label", 30*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("late").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && p.Annotations["ambient.istio.io/redirection"] == "" && ask(late, "/dial?addr="+plain+":8081") == "app:8081"
	})

	// A rolling restart of the agent while the ambient pod's connection
	// loop runs: nothing escapes. A pod created while no agent runs waits
	// (its sandbox fails closed), then starts captured (its proof would
	// fail otherwise). The gap between the old agent's exit and the new
	// one's start is short, so the test holds it open: it takes the run
	// dir's lock the moment the old agent drops it, and the new agent exits
	// naming the holder until the test lets go.
	before := loopStats(t, ask(amb, "/loop"))
	gap := holdRunDirLock(t, n)
	restartedAt := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))
	if _, err := n.Client.AppsV1().DaemonSets("kube-system").Patch(ctx, "nftcni-node", types.StrategicMergePatchType, []byte(restartedAt), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	gap.wait(t, 90*time.Second)
	createApp(t, n, "amb", "during", true)
	n.WaitFor("the pod created while no agent runs to fail closed", 60*time.Second, func() bool {
		return sandboxFailure(n, "amb", "during", "will not start un-captured")
	})
	gap.release()
	n.WaitFor("the restarted agent pod", 90*time.Second, func() bool {
		p := daemonSetPodReady(n, "kube-system", "k8s-app=nftcni-node")
		return p != "" && p != agent
	})
	during := waitApp(t, n, "amb", "during", true)
	agent = daemonSetPodReady(n, "kube-system", "k8s-app=nftcni-node")
	if !capturedOut(during) {
		t.Error("the pod created during the agent's restart is not captured")
	}
	after := loopStats(t, ask(amb, "/loop"))
	if after["escaped"] != before["escaped"] || after["captured"] <= before["captured"] {
		t.Errorf("connection loop across the agent's restart: before %v, after %v (escaped must not grow, captured must)", before, after)
	}
	t.Logf("connection loop across the agent's rolling restart: %v -> %v", before, after)

	// The agent's label is the DaemonSet's selector: an upgrade that would
	// change it is refused by the chart, with the reason, and changes nothing.
	if out, err := n.Helm(append([]string{"upgrade", "nftcni", chart, "--namespace", "kube-system", "--set", "readiness.istiodLabel=true"}, values...)...); err == nil ||
		!strings.Contains(out, "a selector cannot change") {
		t.Errorf("helm upgrade flipping readiness.istiodLabel: err %v, want the chart's refusal naming the selector:\n%s", err, out)
	}
	// helm upgrade with a changed value keeps every pod enrolled.
	if out, err := n.Helm(append([]string{"upgrade", "nftcni", chart, "--namespace", "kube-system", "--wait", "--timeout", "120s", "--set", "logging.level=debug"}, values...)...); err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}
	n.WaitFor("the upgraded agent pod", 90*time.Second, func() bool {
		p := daemonSetPodReady(n, "kube-system", "k8s-app=nftcni-node")
		return p != "" && p != agent
	})
	if got := ask(amb, "/dial?addr="+plain+":8081"); !strings.HasPrefix(got, "ztunnel:15001") {
		t.Errorf("after helm upgrade the ambient pod's outbound: %q, want ztunnel:15001", got)
	}

	// Node reboot: every process killed at once, the primary CNI rewrites
	// its conflist with other bytes (an MTU it did not set before) before
	// the node's services start, then everything boots. The test holds the
	// agent off at first: pods outside the mesh start from the policy
	// snapshot the agent left on persistent storage, the ambient ones wait.
	ambUID := string(pod.UID)
	ids := map[string]string{}
	for _, ref := range []string{"plain/app", "amb/app", "amb/during"} {
		ids[ref] = containerID(t, n, ref)
	}
	rewritten := strings.Replace(n.PrimaryConflist(), `"hairpinMode": true,`, `"hairpinMode": true, "mtu": 1400,`, 1)
	n.Reboot(func() { n.WriteConflist(rewritten) })
	down := holdRunDirLockAtBoot(t, n)
	n.WaitFor("plain/app running again while no agent runs", 120*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods("plain").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && podReady(p) && len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].ContainerID != ids["plain/app"]
	})
	n.WaitFor("amb/app's sandbox to fail closed while no agent runs", 60*time.Second, func() bool {
		return sandboxFailure(n, "amb", "app", "will not start un-captured")
	})
	down.release()
	waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node")
	waitDaemonSetPodReady(t, n, "istio-system", "app=ztunnel")
	ips := map[string]string{}
	for _, ref := range []string{"plain/app", "amb/app", "amb/during"} {
		ns, name, _ := strings.Cut(ref, "/")
		n.WaitFor(ref+" running again after the reboot", 120*time.Second, func() bool {
			p, err := n.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil || !podReady(p) || len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].ContainerID == ids[ref] {
				return false
			}
			for _, s := range p.Status.InitContainerStatuses {
				if lt := s.LastTerminationState.Terminated; lt != nil && lt.ExitCode != 0 {
					t.Fatalf("%s's capture proof failed after the reboot (it ran un-captured): %+v", ref, lt)
				}
			}
			ips[ref] = p.Status.PodIP
			return true
		})
	}
	plain, amb = ips["plain/app"], ips["amb/app"]
	for _, ref := range []string{"amb/app", "amb/during"} {
		if !capturedOut(ips[ref]) {
			t.Errorf("%s is not captured after the reboot", ref)
		}
	}
	if got := ask(plain, "/dial?addr="+plain+":8081"); got != "app:8081" {
		t.Errorf("after the reboot the plain pod's outbound: %q, want app:8081", got)
	}
	// No record is left from before the reboot: one per pod at most, each
	// naming a pod that exists, both ambient pods among them.
	all, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	live := map[string]string{}
	for _, p := range all.Items {
		live[string(p.UID)] = p.Namespace + "/" + p.Name
	}
	out, err := n.Run("sh", "-c", "for f in /var/run/nftcni/pods/*.json; do cat $f; echo; done")
	if err != nil {
		t.Fatalf("reading the agent's records: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	var recs []records.Record
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r records.Record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("record %q: %v", line, err)
		}
		if live[r.UID] == "" || seen[r.UID] {
			t.Errorf("stale record after the reboot: %s", line)
		}
		seen[r.UID] = true
		recs = append(recs, r)
	}
	checkAgentNetnsFds(t, n, recs)
	if b, _ := os.ReadFile(owned); !strings.Contains(string(b), `"mtu": 1400`) || !strings.Contains(string(b), `"nftcni"`) {
		t.Errorf("after the reboot our own conflist does not follow the primary's new bytes:\n%s", b)
	}
	for _, ref := range []string{"amb/app", "amb/during"} {
		found := false
		for uid := range seen {
			found = found || live[uid] == ref
		}
		if !found {
			t.Errorf("no record of %s after the reboot", ref)
		}
	}

	// On containerd 2.x the primary moves to cniVersion 1.1.0 (containerd
	// then calls CNI STATUS; 1.6 reads no 1.1.0 config), nftcni is upgraded
	// to statusRequiresAgent, and the node reboots: until the agent is back
	// STATUS fails, and the kubelet starts no pod outside the node's network
	// namespace, so the agent's own pod must be in it (the chart makes it
	// hostNetwork) or the node never gets an agent, nor any pod, back. The
	// agent enrols from there as before: the ambient pods run again
	// captured, a new one is captured.
	if gen.V2 {
		n.WriteConflist(strings.Replace(rewritten, `"cniVersion": "1.0.0"`, `"cniVersion": "1.1.0"`, 1))
		n.WaitFor("our conflist following the primary to cniVersion 1.1.0", 30*time.Second, func() bool {
			b, _ := os.ReadFile(owned)
			return strings.Contains(string(b), `"cniVersion": "1.1.0"`)
		})
	}
	if out, err := n.Helm(append([]string{"upgrade", "nftcni", chart, "--namespace", "kube-system", "--wait", "--timeout", "120s", "--set", "statusRequiresAgent=true"}, values...)...); err != nil {
		t.Fatalf("helm upgrade to statusRequiresAgent: %v\n%s", err, out)
	}
	agent = waitNewAgentPod(t, n, agent)
	ids = map[string]string{}
	for _, ref := range []string{"kube-system/" + agent, "amb/app", "amb/during"} {
		ids[ref] = containerID(t, n, ref)
	}
	n.Reboot(nil)
	for _, ref := range []string{"kube-system/" + agent, "amb/app", "amb/during"} {
		ips[ref] = runningAgain(t, n, ref, ids[ref], 180*time.Second)
	}
	if p, err := n.Client.CoreV1().Pods("kube-system").Get(ctx, agent, metav1.GetOptions{}); err != nil || !p.Spec.HostNetwork || p.Status.PodIP != nodetest.NodeIP {
		t.Fatalf("agent pod with statusRequiresAgent: %v, want it in the node's network namespace (hostNetwork, IP %s)", err, nodetest.NodeIP)
	}
	amb = ips["amb/app"]
	for _, ref := range []string{"amb/app", "amb/during"} {
		if !capturedOut(ips[ref]) {
			t.Errorf("%s is not captured after the reboot with statusRequiresAgent", ref)
		}
	}
	later := runApp(t, n, "amb", "after-reboot", true)
	if !capturedOut(later) {
		t.Error("a pod enrolled by the agent in the node's network namespace is not captured")
	}

	// Deleting the pod sends ZDS Del and leaves no rules, records or probe
	// entries.
	if err := n.Client.CoreV1().Pods("amb").Delete(ctx, "app", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.WaitFor("amb/app gone, its DelWorkload sent and its state removed", 60*time.Second, func() bool {
		if _, err := n.Client.CoreV1().Pods("amb").Get(ctx, "app", metav1.GetOptions{}); err == nil {
			return false
		}
		logs, _ := n.Run("sh", "-c", "cat /var/log/pods/istio-system_ztunnel-*/*/*.log "+n.Dir+"/podlogs/istio-system_ztunnel-*/*/*.log 2>/dev/null")
		recs, _ := n.Run("sh", "-c", "cat /var/run/nftcni/pods/* 2>/dev/null")
		probes, _ := n.Run("nft", "list", "set", "inet", "nftcni-host", "probe-v4")
		return strings.Contains(logs, "DelWorkload") && !strings.Contains(recs, ambUID) && !strings.Contains(probes, amb)
	})

	// helm uninstall removes the conflist entry, the binary and the host table.
	if out, err := n.Helm("uninstall", "nftcni", "--namespace", "kube-system", "--wait", "--timeout", "120s"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	n.WaitFor("the agent's clean-up on uninstall", 60*time.Second, func() bool {
		_, ownedErr := os.Stat(owned)
		_, binErr := os.Stat(filepath.Join(n.BinDir, "nftcni"))
		tables, _ := n.Run("nft", "list", "tables")
		return os.IsNotExist(ownedErr) && os.IsNotExist(binErr) && !strings.Contains(tables, "nftcni-host")
	})
}

// waitNewAgentPod waits for an agent pod other than old to be Ready (helm's
// --wait takes a DaemonSet of one node with maxUnavailable 1 as ready with
// none) and returns its name.
func waitNewAgentPod(t *testing.T, n *nodetest.Node, old string) string {
	t.Helper()
	var p string
	n.WaitFor("a new agent pod Ready", 90*time.Second, func() bool {
		p = daemonSetPodReady(n, "kube-system", "k8s-app=nftcni-node")
		return p != "" && p != old
	})
	return p
}

// runningAgain waits until pod ref (namespace/name) is Ready in a container
// other than oldID and returns its IP, or fails saying where the pod and
// the node are.
func runningAgain(t *testing.T, n *nodetest.Node, ref, oldID string, limit time.Duration) string {
	t.Helper()
	ns, name, _ := strings.Cut(ref, "/")
	var p *corev1.Pod
	for deadline := time.Now().Add(limit); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		var err error
		if p, err = n.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{}); err == nil &&
			podReady(p) && len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].ContainerID != oldID {
			return p.Status.PodIP
		}
	}
	var ready string
	if node, err := n.Client.CoreV1().Nodes().Get(context.Background(), nodetest.NodeName, metav1.GetOptions{}); err == nil {
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				ready = fmt.Sprintf("%s: %s", c.Status, c.Message)
			}
		}
	}
	var status any
	if p != nil {
		status = p.Status.Conditions
	}
	t.Fatalf("%s not running again within %v: %+v; node Ready %s", ref, limit, status, ready)
	return ""
}

func mkNamespace(t testing.TB, n *nodetest.Node, name string, labels map[string]string) {
	t.Helper()
	_, err := n.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.WaitFor("namespace "+name+"'s default ServiceAccount", 30*time.Second, func() bool {
		_, err := n.Client.CoreV1().ServiceAccounts(name).Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil
	})
}

// runApp runs the workload (createApp) and returns its IP once Ready.
func runApp(t *testing.T, n *nodetest.Node, ns, name string, proof bool, env ...corev1.EnvVar) string {
	t.Helper()
	createApp(t, n, ns, name, proof, env...)
	return waitApp(t, n, ns, name, proof)
}

// createApp creates the workload with kubelet's httpGet probes; with proof,
// an init container that fails unless its connection is captured.
func createApp(t *testing.T, n *nodetest.Node, ns, name string, proof bool, env ...corev1.EnvVar) {
	t.Helper()
	createAppAnnotated(t, n, ns, name, proof, nil, env...)
}

// createAppAnnotated is createApp with the pod's annotations.
func createAppAnnotated(t *testing.T, n *nodetest.Node, ns, name string, proof bool, ann map[string]string, env ...corev1.EnvVar) {
	t.Helper()
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt(8080)}},
		PeriodSeconds: 1, FailureThreshold: 3}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: ann}, Spec: corev1.PodSpec{
		NodeName: nodetest.NodeName,
		Containers: []corev1.Container{{Name: "app", Image: appImage, ImagePullPolicy: corev1.PullNever,
			ReadinessProbe: probe, LivenessProbe: probe, Env: env}},
	}}
	if proof {
		// The bridge's address, where nothing listens: only capture makes
		// this connection succeed.
		pod.Spec.InitContainers = []corev1.Container{{Name: "capture-proof", Image: appImage, ImagePullPolicy: corev1.PullNever,
			Args: []string{"check", "10.88.0.1:9"}}}
	}
	if _, err := n.Client.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitApp returns the pod's IP once Ready, failing if its capture proof
// ever ran un-captured.
func waitApp(t *testing.T, n *nodetest.Node, ns, name string, proof bool) string {
	t.Helper()
	var ip string
	n.WaitFor("pod "+ns+"/"+name+" Ready", 120*time.Second, func() bool {
		p, err := n.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil || !podReady(p) {
			return false
		}
		if proof && (len(p.Status.InitContainerStatuses) != 1 || p.Status.InitContainerStatuses[0].RestartCount != 0) {
			t.Fatalf("the capture proof of %s/%s ran more than once (a run was not captured): %+v", ns, name, p.Status.InitContainerStatuses)
		}
		ip = p.Status.PodIP
		return true
	})
	return ip
}

// sandboxFailure reports whether kubelet recorded a failed sandbox start
// for pod ns/name whose message contains want.
func sandboxFailure(n *nodetest.Node, ns, name, want string) bool {
	evs, err := n.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return false
	}
	for _, e := range evs.Items {
		if e.Reason == "FailedCreatePodSandBox" && strings.Contains(e.Message, want) {
			return true
		}
	}
	return false
}

// checkAgentNetnsFds checks that the agent holds exactly one fd to each
// recorded pod's netns and none to any other netns but the node's own: a
// netns kept from before the reboot would show as an unknown inode.
func checkAgentNetnsFds(t *testing.T, n *nodetest.Node, recs []records.Record) {
	t.Helper()
	agents := n.Processes("nftcni-agent")
	if len(agents) != 1 {
		t.Fatalf("agent processes on the node: %v, want one", agents)
	}
	dir := fmt.Sprintf("/proc/%d/fd", agents[0])
	fds, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A netns opened by path (a bind mount under /var/run/netns) reads back
	// as that path, not as net:[N]: know them by their file system (nsfs)
	// and inode.
	node, held := n.Netns(), map[string]int{}
	for _, fd := range fds {
		p := filepath.Join(dir, fd.Name())
		var fs unix.Statfs_t
		var st unix.Stat_t
		if unix.Statfs(p, &fs) != nil || fs.Type != unix.NSFS_MAGIC || unix.Stat(p, &st) != nil {
			continue
		}
		if ino := fmt.Sprintf("net:[%d]", st.Ino); ino != node {
			held[ino]++
		}
	}
	for _, r := range recs {
		ino := fmt.Sprintf("net:[%d]", r.NetnsIno)
		if held[ino] != 1 {
			t.Errorf("the agent holds %d fds to %s's netns %s, want 1", held[ino], r.Pod.Key(), ino)
		}
		delete(held, ino)
	}
	if len(held) > 0 {
		t.Errorf("the agent holds netns fds no record names (kept from before the reboot?): %v", held)
	}
}

// runDirLock is the agent's run dir lock, taken by the test to keep the
// agent from starting.
type runDirLock struct {
	f    *os.File
	held chan error
}

// holdRunDirLock starts waiting for the agent's run dir lock; it is taken
// as soon as the running agent drops it.
func holdRunDirLock(t *testing.T, n *nodetest.Node) *runDirLock {
	t.Helper()
	f, err := os.OpenFile(n.Path("/run/nftcni/"+runlock.Name), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	l := &runDirLock{f: f, held: make(chan error, 1)}
	t.Cleanup(l.release)
	go func() { l.held <- unix.Flock(int(f.Fd()), unix.LOCK_EX) }()
	return l
}

func (l *runDirLock) wait(t *testing.T, limit time.Duration) {
	t.Helper()
	select {
	case err := <-l.held:
		if err != nil {
			t.Fatalf("taking the agent's run dir lock: %v", err)
		}
	case <-time.After(limit):
		t.Fatalf("the agent did not drop its run dir lock within %v", limit)
	}
}

// holdRunDirLockAtBoot takes the agent's run dir lock on a node that has
// just booted (its /run is empty), before the agent's pod can: the agent
// exits naming the holder until release.
func holdRunDirLockAtBoot(t *testing.T, n *nodetest.Node) *runDirLock {
	t.Helper()
	dir := n.Path("/run/nftcni")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, runlock.Name), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		t.Fatalf("the agent took its run dir lock before the test could, right after boot: %v", err)
	}
	l := &runDirLock{f: f, held: make(chan error, 1)}
	t.Cleanup(l.release)
	return l
}

// release lets the agent start; closing the file drops the lock.
func (l *runDirLock) release() { l.f.Close() }

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func daemonSetPodReady(n *nodetest.Node, ns, selector string) string {
	pods, err := n.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return ""
	}
	for i := range pods.Items {
		if p := &pods.Items[i]; p.DeletionTimestamp == nil && podReady(p) {
			return p.Name
		}
	}
	return ""
}

func waitDaemonSetPodReady(t testing.TB, n *nodetest.Node, ns, selector string) string {
	t.Helper()
	var name string
	n.WaitFor(fmt.Sprintf("a Ready pod %s in %s", selector, ns), 120*time.Second, func() bool {
		name = daemonSetPodReady(n, ns, selector)
		return name != ""
	})
	return name
}

// deployZtunnel runs the stand-in as ztunnel's chart runs ztunnel: a
// DaemonSet in istio-system with the host's ZDS socket dir mounted.
func deployZtunnel(t testing.TB, n *nodetest.Node) {
	t.Helper()
	mkNamespace(t, n, "istio-system", nil)
	priv := true
	labels := map[string]string{"app": "ztunnel"}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "ztunnel", Namespace: "istio-system"}, Spec: appsv1.DaemonSetSpec{
		Selector: &metav1.LabelSelector{MatchLabels: labels},
		Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: corev1.PodSpec{
			// As ztunnel's chart: it runs on every node, tainted or not.
			Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			Containers: []corev1.Container{{Name: "istio-proxy", Image: ztunnelImage, ImagePullPolicy: corev1.PullNever,
				Args:            []string{"/var/run/ztunnel/ztunnel.sock"},
				SecurityContext: &corev1.SecurityContext{Privileged: &priv},
				VolumeMounts:    []corev1.VolumeMount{{Name: "cni-ztunnel-sock-dir", MountPath: "/var/run/ztunnel"}}}},
			Volumes: []corev1.Volume{{Name: "cni-ztunnel-sock-dir", VolumeSource: corev1.VolumeSource{
				HostPath: &corev1.HostPathVolumeSource{Path: "/var/run/ztunnel", Type: ptr(corev1.HostPathDirectoryOrCreate)}}}},
		}},
	}}
	if _, err := n.Client.AppsV1().DaemonSets("istio-system").Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func ptr[T any](v T) *T { return &v }

// containerID is the current container of pod ns/name's app.
func containerID(t *testing.T, n *nodetest.Node, ref string) string {
	t.Helper()
	ns, name, _ := strings.Cut(ref, "/")
	p, err := n.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil || len(p.Status.ContainerStatuses) == 0 {
		t.Fatalf("pod %s: %v", ref, err)
	}
	return p.Status.ContainerStatuses[0].ContainerID
}

func labelNamespace(t *testing.T, n *nodetest.Node, ns, patch string) {
	t.Helper()
	if _, err := n.Client.CoreV1().Namespaces().Patch(context.Background(), ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// loopStats parses nodeapp's /loop answer.
func loopStats(t *testing.T, s string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, f := range strings.Fields(s) {
		k, v, ok := strings.Cut(f, "=")
		n, err := strconv.Atoi(v)
		if !ok || err != nil {
			t.Fatalf("connection loop stats %q", s)
		}
		out[k] = n
	}
	return out
}

// askApp asks nodeapp in the pod at podIP (its HTTP port) for path.
func askApp(t *testing.T, n *nodetest.Node, podIP, path string) string {
	t.Helper()
	resp, err := n.HTTP().Get("http://" + podIP + ":8080" + path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", podIP, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// containerd2 is the containerd 2.x generation the one-runtime node tests
// use; without one the test skips.
func containerd2(t testing.TB) containerdtest.Generation {
	t.Helper()
	for _, g := range containerdtest.Generations(t) {
		if g.V2 {
			return g
		}
	}
	t.Skip("no containerd 2.x")
	return containerdtest.Generation{}
}

// importImages loads the node tests' workload images and the nftcni image
// into the node, and returns the chart values that name the latter.
func importImages(t testing.TB, n *nodetest.Node) []string {
	t.Helper()
	for name, archive := range nodeImages(t) {
		n.Import(name, archive)
	}
	image, imageValues := nftcniImage(t)
	n.Import("nftcni", image)
	return imageValues
}

// installChained imports the test images and the nftcni image into the
// node and installs the chart in chained mode, until the agent is ready.
func installChained(t *testing.T, n *nodetest.Node) { t.Helper(); installInMode(t, n, "chained") }

// installInMode is installChained in another install mode.
func installInMode(t testing.TB, n *nodetest.Node, mode string) {
	t.Helper()
	helmInstall(t, n, importImages(t, n), mode)
}

// helmInstall installs the chart in an install mode with the image that
// imageValues name, and waits for the agent to be Ready.
func helmInstall(t testing.TB, n *nodetest.Node, imageValues []string, mode string) {
	t.Helper()
	chart, _ := filepath.Abs("../deploy/charts/nftcni")
	values := append(imageValues, "--set", "pullPolicy=Never", "--set", "installMode="+mode,
		"--set", "cniBinDir="+n.BinDir, "--set", "cniConfDir="+n.ConfDir)
	if out, err := n.Helm(append([]string{"install", "nftcni", chart, "--namespace", "kube-system", "--wait", "--timeout", "120s"}, values...)...); err != nil {
		t.Fatalf("helm install in %s mode: %v\n%s", mode, err, out)
	}
	waitDaemonSetPodReady(t, n, "kube-system", "k8s-app=nftcni-node")
}
