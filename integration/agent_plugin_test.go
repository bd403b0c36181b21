package integration

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/integration/testnet"
	"github.com/nftcni/nftcni/integration/ztunneltest"
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

// The node as it runs: the agent process installs the plugin into the bin
// dir and patches the primary's conflist, serves the plugin from its
// static pod source, and keeps the policy snapshot current; the runtime
// (libcni) reads the patched conflist and runs the installed binary.
func TestAgentProcessServesThePlugin(t *testing.T) {
	n := newCNINode(t, 64)
	h := newHost(t)
	if err := os.Remove(h.path()); err != nil {
		t.Fatal(err)
	}
	primary := filepath.Join(h.conf, "10-nftnet.conflist")
	if err := os.WriteFile(primary, n.primary("bridge", "1.0.0"), 0o644); err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "pods.yaml"), []byte(podSource), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd, addr, logs := startAgent(t, h, "--pod-source", src, "--plugin-log-level", "debug")
	waitReady(t, addr)
	z := ztunneltest.Connect(t, h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{h.bin, referencePlugins(t)}, t.TempDir(), nil)
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(list.Bytes), h.run) {
		t.Fatalf("installed entry does not point at the agent's run dir:\n%s", list.Bytes)
	}

	app, web := testnet.NewNS(t, "nftpod"), testnet.NewNS(t, "nftpod")
	if _, err := n.add(list, runtimeConf(app, "mesh", "app", nil)); err != nil {
		t.Fatalf("ADD mesh/app: %v\n%s", err, logs)
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
	_, err = n.add(list, rt)
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
	n := newCNINode(t, 67)
	h := newHost(t)
	if err := os.Remove(h.path()); err != nil {
		t.Fatal(err)
	}
	primary := filepath.Join(h.conf, "10-nftnet.conflist")
	if err := os.WriteFile(primary, n.primary("bridge", "1.0.0"), 0o644); err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "pods.yaml"), []byte(podSource), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd, addr, _ := startAgent(t, h, "--pod-source", src)
	waitReady(t, addr)
	z1 := ztunneltest.Connect(t, h.zsock)
	z1.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	n.cni = libcni.NewCNIConfigWithCacheDir([]string{h.bin, referencePlugins(t)}, t.TempDir(), nil)
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
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

	_, addr, _ = startAgent(t, h, "--pod-source", src)
	waitReady(t, addr)
	z2 := ztunneltest.Connect(t, h.zsock)
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
	if err := nft.Verify(app.FD, nft.Ambient(nft.AmbientSpec{DNSCapture: true})); err != nil {
		t.Errorf("rules after the restart: %v", err)
	}
	if err := n.del(list, rt); err != nil {
		t.Fatalf("DEL through the new agent: %v", err)
	}
	z2.Wait(zds.KindDel, "uid-app", 5*time.Second)
}
