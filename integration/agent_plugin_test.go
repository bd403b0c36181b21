package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nftcni/nftcni/templates"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"

	"github.com/containernetworking/cni/libcni"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

const podSource = `apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Pod
metadata: {name: app, namespace: mesh, uid: uid-app}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: plain, uid: uid-web}
`

// agentNode is a node run the real way: the agent process manages the host
// layout h (conf and bin dirs, run dir, ztunnel socket, a netns standing in
// for the host's), whose primary CNI config is given, and libcni runs the
// chain the agent installed from the node netns.
type agentNode struct {
	*cniNode
	h       *host
	primary string
}

// newAgentNode writes primary (nil: the bridge chain) as the node's only
// CNI config.
func newAgentNode(t testing.TB, subnet int, primary []byte) *agentNode {
	t.Helper()
	a := &agentNode{cniNode: newCNINode(t, subnet), h: newHost(t)}
	if err := os.Remove(a.h.path()); err != nil {
		t.Fatal(err)
	}
	if primary == nil {
		primary = a.cniNode.primary("bridge", "1.0.0")
	}
	a.primary = filepath.Join(a.h.conf, "10-nftnet.conflist")
	if err := os.WriteFile(a.primary, primary, 0o644); err != nil {
		t.Fatal(err)
	}
	a.cni = libcni.NewCNIConfigWithCacheDir([]string{a.h.bin, referencePlugins(t)}, t.TempDir(), nil)
	return a
}

// start runs the agent with args until ready and connects a test ztunnel,
// which has had its snapshot when start returns.
func (a *agentNode) start(t testing.TB, args ...string) (*exec.Cmd, *ztunneltest.Ztunnel) {
	t.Helper()
	cmd, addr, _ := startAgent(t, a.h, args...)
	waitReady(t, addr)
	z := ztunneltest.Connect(t, a.h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
	return cmd, z
}

// installed reads the conflist as the agent patched it.
//
// The tests that stop or kill the agent assert what an ADD does without
// it, so the list they run has the entry's agent_wait_seconds at 0 (the
// ADD fails at once); the wait itself has tests of its own
// (TestCNIAgentBackWithinTheWait, and the node tests run the default).
func (a *agentNode) installed(t testing.TB) *libcni.NetworkConfigList {
	t.Helper()
	b, err := os.ReadFile(a.primary)
	if err != nil {
		t.Fatal(err)
	}
	return withAgentWait(t, b, 0)
}

// withAgentWait is the conflist doc with our entry's agent_wait_seconds set.
func withAgentWait(t testing.TB, doc []byte, seconds float64) *libcni.NetworkConfigList {
	t.Helper()
	for i, p := range gjson.GetBytes(doc, "plugins").Array() {
		if p.Get("type").Str == templates.PluginType {
			var err error
			if doc, err = sjson.SetBytes(doc, fmt.Sprintf("plugins.%d.agent_wait_seconds", i), seconds); err != nil {
				t.Fatal(err)
			}
		}
	}
	l, err := libcni.NetworkConfFromBytes(doc)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// podSourceDir writes manifests into a fresh pod source dir.
func podSourceDir(t testing.TB, manifests string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "pods.yaml"), []byte(manifests), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// The node as it runs: the agent process installs the plugin into the bin
// dir and patches the primary's conflist, serves the plugin from its
// static pod source, and keeps the policy snapshot current; the runtime
// (libcni) reads the patched conflist and runs the installed binary.
func TestAgentProcessServesThePlugin(t *testing.T) {
	n := newAgentNode(t, 64, nil)
	h := n.h
	src := podSourceDir(t, podSource)
	cmd, z := n.start(t, "--pod-source", src, "--plugin-log-level", "debug")
	list := n.installed(t)
	if !strings.Contains(string(list.Bytes), h.run) {
		t.Fatalf("installed entry does not point at the agent's run dir:\n%s", list.Bytes)
	}

	app, web := testnet.NewNS(t, "nftpod"), testnet.NewNS(t, "nftpod")
	if _, err := n.add(list, runtimeConf(app, "mesh", "app", nil)); err != nil {
		t.Fatalf("ADD mesh/app: %v", err)
	}
	if _, err := n.add(list, runtimeConf(web, "plain", "web", nil)); err != nil {
		t.Fatalf("ADD plain/web: %v", err)
	}
	if !hasTable(t, app) || hasTable(t, web) {
		t.Errorf("tables: mesh/app %v (want true), plain/web %v (want false)", hasTable(t, app), hasTable(t, web))
	}
	// The agent process handed mesh/app's netns to ztunnel, whose listener
	// in the pod now takes the pod's outbound TCP.
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	if _, err := app.Dial(t, "tcp", "192.0.2.1:443", testnet.DialOpts{}); err != nil {
		t.Fatalf("dial from mesh/app: %v", err)
	}
	if _, err := testnet.Accept(t, z.Pod("uid-app").Outbound, 2*time.Second); err != nil {
		t.Errorf("mesh/app's outbound did not reach ztunnel: %v", err)
	}

	// Label the other namespace: the snapshot follows the pod source.
	if err := os.WriteFile(filepath.Join(src, "pods.yaml"),
		[]byte(strings.Replace(podSource, "{name: plain}", "{name: plain, labels: {istio.io/dataplane-mode: ambient}}", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	pol := filepath.Join(h.run, wire.PolicyName)
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := wire.ReadPolicy(pol)
		if err == nil && slices.Contains(p.EnrolledNamespaces, "plain") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("policy snapshot never enrolled namespace plain: %+v %v", p, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Agent stopped (restart, upgrade): the entry stays, and a new pod in
	// the now-enrolled namespace is held back rather than started un-captured.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	late := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(late, "plain", "web2", nil)
	_, err := n.add(list, rt)
	if err == nil || !strings.Contains(err.Error(), filepath.Join(h.run, wire.SocketName)) {
		t.Errorf("ADD with the agent stopped: %v, want a refusal naming the socket", err)
	}
	if err := n.del(list, rt); err != nil {
		t.Errorf("DEL after the refused ADD: %v", err)
	}
}

// An agent killed and restarted while a pod talks: the pod's capture never
// lapses (a connection loop runs across the restart and every connection
// lands on ztunnel), the new agent finds the pod again from its record,
// re-verifies its rules and hands it to the reconnecting ztunnel in the
// snapshot, and the pod's DEL still works afterwards.
func TestAgentRestartKeepsCapture(t *testing.T) {
	n := newAgentNode(t, 67, nil)
	src := podSourceDir(t, podSource)
	cmd, z1 := n.start(t, "--pod-source", src)
	list := n.installed(t)
	app := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(app, "mesh", "app", nil)
	if _, err := n.add(list, rt); err != nil {
		t.Fatal(err)
	}
	z1.Wait(zds.KindAdd, "uid-app", 5*time.Second)

	// The pod keeps opening connections to an address nothing answers:
	// each one only succeeds if capture sends it to ztunnel.
	stopLoop := make(chan struct{})
	type result struct{ ok, failed int }
	done := make(chan result)
	go func() {
		var r result
		for {
			select {
			case <-stopLoop:
				done <- r
				return
			case <-time.After(20 * time.Millisecond):
			}
			if c, err := app.Dial(t, "tcp", "192.0.2.9:80", testnet.DialOpts{}); err == nil {
				c.Close()
				r.ok++
			} else {
				r.failed++
			}
		}
	}()
	time.Sleep(200 * time.Millisecond)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_, _ = cmd.Process.Wait()
	time.Sleep(200 * time.Millisecond) // no agent at all for a while

	_, addr, logs2 := startAgent(t, n.h, "--pod-source", src)
	waitReady(t, addr)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("restarted agent's log:\n%s", logs2)
		}
	})
	z2 := ztunneltest.Connect(t, n.h.zsock)
	if e := z2.Wait(zds.KindAdd, "uid-app", 5*time.Second); e.FDs != 1 {
		t.Errorf("snapshot Add after restart carried %d fds", e.FDs)
	}
	z2.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	time.Sleep(200 * time.Millisecond)
	close(stopLoop)
	r := <-done
	if r.failed > 0 || r.ok < 10 {
		t.Errorf("connections across the restart: %d landed, %d failed (want all landing)", r.ok, r.failed)
	}
	if err := nft.Verify(app.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("rules after the restart: %v", err)
	}
	if err := n.del(list, rt); err != nil {
		t.Fatalf("DEL through the new agent: %v", err)
	}
	z2.Wait(zds.KindDel, "uid-app", 5*time.Second)
}

// inspect, run as an operator would beside a running agent: a pod's live
// ruleset with its verdict, enrolment and ztunnel state; the host's probe
// table; exit 1 once someone flushes a pod's chain, 2 for an unknown pod.
func TestInspect(t *testing.T) {
	n := newAgentNode(t, 68, nil)
	src := podSourceDir(t, podSource)
	_, z := n.start(t, "--pod-source", src)
	list := n.installed(t)
	app, web := testnet.NewNS(t, "nftpod"), testnet.NewNS(t, "nftpod")
	r, err := n.add(list, runtimeConf(app, "mesh", "app", nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.add(list, runtimeConf(web, "plain", "web", nil)); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	inspect := func(target string) (string, int) {
		cmd := n.h.agent("inspect", target)
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	out, code := inspect("mesh/app")
	for _, want := range []string{"enrolment: ambient", "handed to ztunnel with its netns", "ruleset:   matches", "table inet " + nft.PodTable, "redirect to :15001"} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect mesh/app lacks %q:\n%s", want, out)
		}
	}
	if code != 0 {
		t.Errorf("inspect mesh/app exit %d:\n%s", code, out)
	}
	if out, code := inspect("plain/web"); code != 0 || !strings.Contains(out, "none, as expected") {
		t.Errorf("inspect plain/web exit %d:\n%s", code, out)
	}
	appIP := podIPs(t, r)[0].String()
	if out, code := inspect("host"); code != 0 || !strings.Contains(out, appIP) || !strings.Contains(out, "uid-app") {
		t.Errorf("inspect host exit %d, want the probe set holding %s:\n%s", code, appIP, out)
	}
	if out, code := inspect("mesh/nobody"); code != 2 || !strings.Contains(out, "no record of pod mesh/nobody") {
		t.Errorf("inspect of an unknown pod: exit %d\n%s", code, out)
	}
	// Someone flushes the pod's chains: inspect says so, and exits 1.
	if out, err := exec.Command("ip", "netns", "exec", app.Name, "nft", "flush", "table", "inet", nft.PodTable).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, code := inspect("mesh/app"); code != 1 || !strings.Contains(out, "DRIFT") {
		t.Errorf("inspect after a flush: exit %d\n%s", code, out)
	}
}
