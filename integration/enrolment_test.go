package integration

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/unixsock"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Each test here reproduces a defect seen when the product was tried as a
// new user would (static pod source, an independent ztunnel stand-in),
// through the agent binary and the plugin run by libcni.

const meshNamespace = `apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
`

const appPod = `apiVersion: v1
kind: Pod
metadata: {name: app, namespace: mesh, uid: uid-app}
`

// sourceDir writes each manifest to its own file in a fresh pod source.
func sourceDir(t testing.TB, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// ipRules lists the pod netns's `ip rule`s (tests may run ip).
func ipRules(t testing.TB, n *testnet.NS) string {
	t.Helper()
	out, err := exec.Command("ip", "-n", n.Name, "rule", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip rule list: %v\n%s", err, out)
	}
	return string(out)
}

// reaches says whether a TCP connection from pod to addr lands on a
// listener the node netns opens there.
func reaches(t *testing.T, node, pod *testnet.NS, addr netip.AddrPort) bool {
	t.Helper()
	ln := node.Listen(t, addr.String(), false)
	if _, err := pod.Dial(t, "tcp", addr.String(), testnet.DialOpts{}); err != nil {
		return false
	}
	_, err := testnet.Accept(t, ln, time.Second)
	return err == nil
}

// A pod released while its netns lives on (its manifest removed from the
// pod source) keeps no rules: with the table and the connmark rule left
// behind, every connection it opens goes to a ztunnel that no longer
// serves it and is refused.
func TestReleasedPodIsNotBlackHoled(t *testing.T) {
	for i, agentDown := range []bool{true, false} {
		name := "while the agent runs"
		if agentDown {
			name = "while the agent is down"
		}
		t.Run(name, func(t *testing.T) {
			n := newAgentNode(t, 80+i, nil)
			src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod})
			cmd, z := n.start(t, "--pod-source", src)
			list := n.installed(t)
			app := testnet.NewNS(t, "nftpod")
			r, err := n.add(list, runtimeConf(app, "mesh", "app", nil))
			if err != nil {
				t.Fatal(err)
			}
			z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
			gw := gateway(t, r)
			if reaches(t, n.node, app, netip.AddrPortFrom(gw, 18000)) {
				t.Fatal("an enrolled pod's connection bypassed ztunnel")
			}
			if agentDown {
				_ = cmd.Process.Kill()
				_, _ = cmd.Process.Wait()
				z.Close()
			}
			if err := os.Remove(filepath.Join(src, "app.yaml")); err != nil {
				t.Fatal(err)
			}
			if agentDown {
				_, z = n.start(t, "--pod-source", src)
				if z.Pod("uid-app") != nil {
					t.Error("ztunnel's snapshot holds a pod the pod source no longer has")
				}
			} else {
				z.Wait(zds.KindDel, "uid-app", 5*time.Second)
			}
			eventually(t, "the released pod's table to go", func() bool { return !hasTable(t, app) })
			if rules := ipRules(t, app); strings.Contains(rules, "lookup 100") {
				t.Errorf("the connmark ip rule stayed:\n%s", rules)
			}
			if !reaches(t, n.node, app, netip.AddrPortFrom(gw, 18001)) {
				t.Error("the released pod cannot reach the node: its traffic is still sent where nothing takes it")
			}
			if set := probeSet(t, n.h.netns); strings.Contains(set, "uid-app") {
				t.Errorf("the probe set still holds the released pod:\n%s", set)
			}
		})
	}
}

// A pod's DEL while no agent runs still takes its rules away: the plugin
// sends the removal the agent left in its policy snapshot (the plugin
// links no nf_tables encoder of its own). The DEL is final: the restarted
// agent hands the pod to ztunnel no more, and its verification passes put
// no rules back into the netns (which lives on here, as a sandbox's may
// while the runtime tears it down).
func TestDelWithoutTheAgentRemovesTheRules(t *testing.T) {
	n := newAgentNode(t, 88, nil)
	src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod})
	cmd, z := n.start(t, "--pod-source", src)
	list := n.installed(t)
	app := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(app, "mesh", "app", nil)
	if _, err := n.add(list, rt); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	if !hasTable(t, app) || !strings.Contains(ipRules(t, app), "lookup 100") {
		t.Fatal("the enrolled pod has no ruleset to remove")
	}
	_ = cmd.Process.Kill()
	_, _ = cmd.Process.Wait()
	if err := n.del(list, rt); err != nil {
		t.Fatalf("DEL without the agent: %v", err)
	}
	if hasTable(t, app) {
		t.Error("the pod's table stayed after its DEL")
	}
	if rules := ipRules(t, app); strings.Contains(rules, "lookup 100") {
		t.Errorf("the connmark ip rule stayed after the DEL:\n%s", rules)
	}

	_, z = n.start(t, "--pod-source", src, "--verify-interval", "100ms")
	time.Sleep(time.Second) // several verification passes
	for _, e := range z.Seen() {
		if e.UID == "uid-app" {
			t.Errorf("the restarted agent sent ztunnel %s for the deleted pod", e.Kind)
		}
	}
	if hasTable(t, app) || strings.Contains(ipRules(t, app), "lookup 100") {
		t.Errorf("the restarted agent put the deleted pod's rules back:\n%s", ipRules(t, app))
	}
	// The agent knows the pod no more: a DEL the runtime repeats is quiet.
	if err := n.del(list, rt); err != nil {
		t.Errorf("the runtime's repeated DEL: %v", err)
	}
	if _, err := os.Stat(filepath.Join(n.h.run, wire.RecordsDir)); err != nil {
		t.Fatal(err)
	}
	if marks, _ := filepath.Glob(filepath.Join(n.h.run, wire.RecordsDir, "*.mark")); len(marks) != 0 {
		t.Errorf("tombstones left after the agent acted on them: %v", marks)
	}
}

// A Pod without metadata.uid is refused by name, and never goes to
// ztunnel with an empty UID (ztunnel refuses that); the other files load.
func TestPodWithoutUIDIsRefusedByName(t *testing.T) {
	n := newAgentNode(t, 82, nil)
	src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod,
		"nouid.yaml": "apiVersion: v1\nkind: Pod\nmetadata: {name: nouid, namespace: mesh}\n"})
	_, addr, logs := startAgent(t, n.h, "--pod-source", src)
	waitReady(t, addr)
	z := ztunneltest.Connect(t, n.h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	if l := logs.String(); !strings.Contains(l, "nouid.yaml") || !strings.Contains(l, "pod mesh/nouid has no metadata.uid") {
		t.Errorf("the agent's log does not name the file and the problem:\n%s", l)
	}
	list := n.installed(t)
	nouid := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(nouid, "mesh", "nouid", nil)
	rt.Args = withoutArg(rt.Args, "K8S_POD_UID")
	if _, err := n.add(list, rt); err == nil {
		t.Error("a pod without any UID was enrolled")
	}
	if _, err := n.add(list, runtimeConf(testnet.NewNS(t, "nftpod"), "mesh", "app", nil)); err != nil {
		t.Errorf("the pod of a good file: %v", err)
	}
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	for _, e := range z.Seen() {
		if e.UID == "" && e.Kind != zds.KindSnapshotSent {
			t.Errorf("ztunnel got %s with an empty uid", e.Kind)
		}
	}
}

func withoutArg(args [][2]string, key string) [][2]string {
	var out [][2]string
	for _, a := range args {
		if a[0] != key {
			out = append(out, a)
		}
	}
	return out
}

// DEL of a pod the agent has no record of sends ztunnel nothing: not its
// namespace/name in the UID field, and not a UID ztunnel never had.
func TestDelOfAnUnknownPodSendsNoZDSDel(t *testing.T) {
	n := newAgentNode(t, 83, nil)
	src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod})
	_, z := n.start(t, "--pod-source", src)
	list := n.installed(t)
	for _, withUID := range []bool{false, true} {
		ghost := testnet.NewNS(t, "nftpod")
		rt := runtimeConf(ghost, "mesh", "ghost", nil)
		if !withUID {
			rt.Args = withoutArg(rt.Args, "K8S_POD_UID")
		}
		if err := n.del(list, rt); err != nil {
			t.Errorf("DEL of an unknown pod: %v", err)
		}
	}
	// A pod the agent does know, to be sure Dels get through at all.
	app := testnet.NewNS(t, "nftpod")
	rt := runtimeConf(app, "mesh", "app", nil)
	if _, err := n.add(list, rt); err != nil {
		t.Fatal(err)
	}
	if err := n.del(list, rt); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindDel, "uid-app", 5*time.Second)
	for _, e := range z.Seen() {
		if e.Kind == zds.KindDel && e.UID != "uid-app" {
			t.Errorf("ztunnel got DelWorkload for %q", e.UID)
		}
	}
}

// A second agent on the same run dir exits, naming the first one's PID,
// and leaves the live sockets alone: ADDs still reach the first agent and
// ztunnel stays connected to it.
func TestSecondAgentOnTheSameRunDir(t *testing.T) {
	n := newAgentNode(t, 84, nil)
	src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod})
	first, z := n.start(t, "--pod-source", src)
	second := n.h.agent("run", "--health-addr", "127.0.0.1:0", "--monitoring-port", "0", "--pod-source", src)
	var out bytes.Buffer
	second.Stdout, second.Stderr = &out, &out
	if err := second.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = second.Process.Kill(); _ = second.Wait() })
	exited := make(chan error, 1)
	go func() { exited <- second.Wait() }()
	select {
	case err := <-exited:
		if err == nil {
			t.Error("the second agent exited 0")
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the second agent still runs:\n%s", out.String())
	}
	if want := fmt.Sprintf("pid %d", first.Process.Pid); !strings.Contains(out.String(), want) {
		t.Errorf("the second agent's error does not name %s:\n%s", want, out.String())
	}
	for _, s := range []string{filepath.Join(n.h.run, "plugin.sock"), n.h.zsock} {
		if _, err := os.Stat(s); err != nil {
			t.Errorf("socket %s after the second agent: %v", s, err)
		}
	}
	app := testnet.NewNS(t, "nftpod")
	if _, err := n.add(n.installed(t), runtimeConf(app, "mesh", "app", nil)); err != nil {
		t.Fatalf("ADD after the second agent gave up: %v", err)
	}
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
}

// Someone flushing a pod's ruleset is found and put back within one
// verification interval, without a restart: logged with the pod and the
// rule, counted, and shown by inspect.
func TestDriftIsRepairedWithinOneInterval(t *testing.T) {
	n := newAgentNode(t, 85, nil)
	src := sourceDir(t, map[string]string{"ns.yaml": meshNamespace, "app.yaml": appPod})
	port := testnet.FreePort(t)
	_, addr, logs := startAgent(t, n.h, "--pod-source", src, "--verify-interval", "1s", "--monitoring-port", strconv.Itoa(port))
	waitReady(t, addr)
	z := ztunneltest.Connect(t, n.h.zsock)
	z.Wait(zds.KindSnapshotSent, "", 5*time.Second)
	app := testnet.NewNS(t, "nftpod")
	if _, err := n.add(n.installed(t), runtimeConf(app, "mesh", "app", nil)); err != nil {
		t.Fatal(err)
	}
	want := capture.Ambient(capture.AmbientSpec{DNSCapture: true})
	if out, err := exec.Command("ip", "netns", "exec", app.Name, "nft", "flush", "table", "inet", nft.PodTable).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	testnet.IP(t, "-n", app.Name, "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100")
	start := time.Now()
	eventually(t, "the ruleset is back", func() bool { return nft.Verify(app.FD, want) == nil })
	if took := time.Since(start); took > 2500*time.Millisecond {
		t.Errorf("repaired after %v with a 1 s interval", took)
	}
	eventually(t, "the repair is logged", func() bool { return strings.Contains(logs.String(), "pod ruleset drifted; put back") })
	l := logs.String()
	for _, s := range []string{"pod=mesh/app", "chain nftcni nat-output is empty but should hold 6 rules, the first: meta l4proto tcp ip daddr 169.254.7.127 counter accept"} {
		if !strings.Contains(l, s) {
			t.Errorf("the drift log does not say %q:\n%s", s, l)
		}
	}
	metrics := scrape(t, port)
	if !strings.Contains(metrics, "nftcni_ruleset_repairs_total 1") {
		t.Errorf("repairs not counted:\n%s", grepLines(metrics, "nftcni_ruleset"))
	}
	eventually(t, "a pass counts the pod as verified", func() bool {
		return strings.Contains(scrape(t, port), "nftcni_ruleset_verified_pods 1")
	})
	out, _ := n.h.agent("inspect", "mesh/app").CombinedOutput()
	if !strings.Contains(string(out), "verified:") || !strings.Contains(string(out), "put back 1 times") {
		t.Errorf("inspect does not show the verification:\n%s", out)
	}
}

// Removing a pod's label leaves it outside the mesh with a reason inspect
// can print.
func TestInspectAfterUnenrolmentGivesTheReason(t *testing.T) {
	n := newAgentNode(t, 86, nil)
	labelled := "apiVersion: v1\nkind: Pod\nmetadata: {name: app, namespace: plain, uid: uid-app, labels: {istio.io/dataplane-mode: ambient}}\n"
	src := sourceDir(t, map[string]string{"ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata: {name: plain}\n", "app.yaml": labelled})
	_, z := n.start(t, "--pod-source", src)
	app := testnet.NewNS(t, "nftpod")
	if _, err := n.add(n.installed(t), runtimeConf(app, "plain", "app", nil)); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindAdd, "uid-app", 5*time.Second)
	if err := os.WriteFile(filepath.Join(src, "app.yaml"), []byte(strings.Replace(labelled, ", labels: {istio.io/dataplane-mode: ambient}", "", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	z.Wait(zds.KindDel, "uid-app", 5*time.Second)
	eventually(t, "the table goes", func() bool { return !hasTable(t, app) })
	out, _ := n.h.agent("inspect", "plain/app").CombinedOutput()
	if !strings.Contains(string(out), "enrolment: none (unenrolled: no enablement selector matches)") || strings.Contains(string(out), "()") {
		t.Errorf("inspect after unenrolment:\n%s", out)
	}
}

// An enrolled ADD is four messages on the plugin socket — add (with the
// pod's netns) and decision (with the pod's two netlink sockets), then done
// (the agent's part in place, sent without waiting for the plugin) and the
// outcome (carrying the call's logs), which the plugin sends last, once it
// has read done — and a pod outside the mesh one round trip, followed by
// its debug records one way (the conflist here logs at debug); counted by
// a relay between the plugin and the agent. A decision that
// comes without sockets (an older agent; the relay drops them) still gets
// the pod its rules: the plugin makes its own.
func TestADDRoundTrips(t *testing.T) {
	n := newCNINode(t, 87)
	n.startAgent()
	relay := newRelay(t, filepath.Join(n.run, "plugin.sock"))
	full := n.listVia(relay.dir)
	for _, tc := range []struct {
		namespace, name string
		strip           bool
		want            []string
	}{
		{meshNS, "app", false, []string{"add+1", "decision+2", "done", "outcome"}},
		{plainNS, "web", false, []string{"add+1", "decision", "log"}},
		{meshNS, "old", true, []string{"add+1", "decision", "done", "outcome"}},
	} {
		n.pod(tc.namespace, tc.name, nil)
		pod := testnet.NewNS(t, "nftpod")
		before := len(relay.kinds())
		relay.setStrip(tc.strip)
		if _, err := n.add(full, runtimeConf(pod, tc.namespace, tc.name, nil)); err != nil {
			t.Fatal(err)
		}
		if got := relay.kinds()[before:]; !slices.Equal(got, tc.want) {
			t.Errorf("%s/%s: messages %v, want %v", tc.namespace, tc.name, got, tc.want)
		}
		if want := tc.namespace == meshNS; hasTable(t, pod) != want {
			t.Errorf("%s/%s: table inet %s present: %v, want %v", tc.namespace, tc.name, nft.PodTable, !want, want)
		}
	}
}

// listVia is the full chain with the plugin pointed at run dir dir.
func (n *cniNode) listVia(dir string) *libcni.NetworkConfigList {
	n.t.Helper()
	l := n.list("bridge", "1.0.0", true, false)
	b := bytes.Replace(l.Bytes, []byte(`"`+n.run+`"`), []byte(`"`+dir+`"`), 1)
	out, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		n.t.Fatal(err)
	}
	return out
}

// scrape reads the agent's Prometheus endpoint on port.
func scrape(t testing.TB, port int) string {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// relay sits between the plugin and the agent: it listens on dir's plugin
// socket, passes every datagram (and its descriptor) through to the
// agent's, and counts them each way.
type relay struct {
	dir   string
	mu    sync.Mutex
	seq   []string // message kinds (+N: with N descriptors), in the order they passed
	strip bool     // drop the descriptors of the agent's answers
}

func (r *relay) setStrip(strip bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.strip = strip
}

func newRelay(t *testing.T, agentSock string) *relay {
	t.Helper()
	r := &relay{dir: t.TempDir()}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: filepath.Join(r.dir, wire.SocketName), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			in, err := l.AcceptUnix()
			if err != nil {
				return
			}
			out, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: agentSock, Net: "unixpacket"})
			if err != nil {
				in.Close()
				continue
			}
			go r.pipe(in, out, false)
			go r.pipe(out, in, true)
		}
	}()
	return r
}

// pipe copies datagrams from src to dst until either closes; fromAgent
// says which way that is.
func (r *relay) pipe(src, dst *net.UnixConn, fromAgent bool) {
	defer src.Close()
	defer dst.Close()
	buf := make([]byte, wire.MaxMessage+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := src.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return
		}
		fds, _ := unixsock.Rights(oob[:oobn])
		kind := "?"
		if m, err := wire.Decode(buf[:n]); err == nil {
			kind = string(m.Kind)
		}
		r.mu.Lock()
		pass := oob[:oobn]
		if fromAgent && r.strip {
			pass = nil
		} else if len(fds) > 0 {
			kind += fmt.Sprintf("+%d", len(fds))
		}
		r.seq = append(r.seq, kind)
		r.mu.Unlock()
		_, _, err = dst.WriteMsgUnix(buf[:n], pass, nil)
		wire.CloseAll(fds) // passed on: the relay keeps none
		if err != nil {
			return
		}
	}
}

func (r *relay) kinds() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seq...)
}
