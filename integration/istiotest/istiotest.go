// Package istiotest runs Istio's own CNI node agent (install-cni, ambient
// mode) and plugin (istio-cni), built from the Go module proxy by
// hack/istio-bins.sh, so benchmarks can measure them through the same
// harness as nftcni. Test-only.
//
// install-cni reads fixed paths: its service account at
// /var/run/secrets/kubernetes.io/serviceaccount, the plugin to copy at
// /opt/cni/bin, the host's bin dir at /host/opt/cni/bin, the host's netns
// at /host/proc/1/ns/net and pod netns under /host. It runs here in a
// private mount namespace, chrooted into a root made of bind mounts (the
// machine's /usr, /etc, /dev, /proc, /sys, /tmp and /run/netns, plus those
// paths, /host/proc/1/ns/net being the test's node netns), and in that node
// netns, so nothing it writes lands on the machine.
package istiotest

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nftcni/nftcni/internal/testnet"
)

// Bins is the dir holding install-cni and istio-cni.
func Bins(t testing.TB) string {
	t.Helper()
	dir := testnet.Cached("NFTCNI_ISTIO_BIN", "istio-eed52ebb66ad")
	for _, b := range []string{"install-cni", "istio-cni"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			msg := fmt.Sprintf("%s not found in %s: run `make istio-bins` (make test and make bench do) or set NFTCNI_ISTIO_BIN", b, dir)
			if os.Getenv("NFTCNI_REQUIRE_ISTIO") != "" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	return dir
}

// Options say where the agent runs.
type Options struct {
	// HostNetns is the node's netns (a path as the agent's process sees
	// it): the agent's host netns.
	HostNetns string
	ConfDir   string // the node's CNI conf dir, holding the primary conflist
	BinDir    string // the node's CNI bin dir: install-cni copies istio-cni there
	APIHost   string // the API server as seen from the node netns (host:port)
	Token     string // a bearer token for it
	NodeName  string
	// Nftables selects Istio's native nftables backend (NATIVE_NFTABLES);
	// false: its iptables backend (iptables-nft here).
	Nftables bool
	// OwnedConfig is ISTIO_OWNED_CNI_CONFIG: a conflist of Istio's own
	// (02-istio-cni.conflist, the primary's plugins and its own) instead
	// of patching the primary's.
	OwnedConfig bool
	// Command starts the agent's process (default exec.Command): a node's
	// nsenter puts it in that node's mount, net and pid namespaces, where
	// its kubelet and containerd run. Root is where the test sees that
	// mount namespace's files ("" for the machine's).
	Command func(name string, args ...string) *exec.Cmd
	Root    string
	// ZtunnelSocket is where the agent serves ztunnel (default: in a
	// temporary dir); its dir is bound into the agent's root at the same
	// path, so a ztunnel on that node's host path finds it.
	ZtunnelSocket string
}

// Agent is a running install-cni.
type Agent struct {
	RunDir        string // CNI_AGENT_RUN_DIR: its sockets and the plugin's kubeconfig
	ZtunnelSocket string
	log           string
	stop          func()
}

// Stop stops the agent as Kubernetes stops a pod (SIGTERM, then SIGKILL
// after 5 s) and waits for it.
func (a *Agent) Stop() { a.stop() }

// Log is the agent's output so far.
func (a *Agent) Log() string {
	b, _ := os.ReadFile(a.log)
	return string(b)
}

// setup builds the root and execs the agent in it: $1 root, $2 node netns,
// $3 the bins dir, $4 the service account dir, $5 the node's bin dir, $6
// the ztunnel socket's dir; the rest is the agent's command line.
const setup = `set -eu
R=$1 NETNS=$2 BINS=$3 SA=$4 HOSTBIN=$5 ZDIR=$6; shift 6
mkdir -p /run/netns "$ZDIR"
mount -t tmpfs tmpfs "$R"
for d in usr etc dev proc sys tmp run/netns opt/istio opt/cni/bin host/opt/cni/bin host/proc/1/ns host/var/run/netns var/run/secrets/kubernetes.io/serviceaccount "$ZDIR"; do mkdir -p "$R/$d"; done
for l in bin sbin lib lib32 lib64 libx32; do [ -L /$l ] && ln -s "$(readlink /$l)" "$R/$l"; done
for d in usr etc dev proc sys tmp run/netns; do mount --rbind /$d "$R/$d"; done
mount --bind "$ZDIR" "$R$ZDIR"
mount --rbind /run/netns "$R/host/var/run/netns"
: >"$R/host/proc/1/ns/net"
mount --bind "$NETNS" "$R/host/proc/1/ns/net"
# The nftables backend matches kubelet's probes by kubelet's UID, read from
# a process named kubelet under /host/proc (istio#58185): one, as root.
mkdir -p "$R/host/proc/4242"
printf 'kubelet\n' >"$R/host/proc/4242/comm"
printf '/usr/bin/kubelet\0' >"$R/host/proc/4242/cmdline"
printf 'Name:\tkubelet\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n' >"$R/host/proc/4242/status"
mount --bind "$BINS" "$R/opt/istio"
mount --bind "$BINS" "$R/opt/cni/bin"
mount --bind "$HOSTBIN" "$R/host/opt/cni/bin"
mount --bind "$SA" "$R/var/run/secrets/kubernetes.io/serviceaccount"
exec nsenter --net="$NETNS" -- chroot "$R" "$@"
`

// Start runs install-cni until the test ends and waits until it has
// patched the primary conflist and listens for ztunnel.
func Start(t testing.TB, o Options) *Agent {
	t.Helper()
	bins := Bins(t)
	dir := t.TempDir()
	a := &Agent{RunDir: filepath.Join(dir, "run"), ZtunnelSocket: o.ZtunnelSocket, log: filepath.Join(dir, "install-cni.log")}
	if a.ZtunnelSocket == "" {
		a.ZtunnelSocket = filepath.Join(dir, "ztunnel", "ztunnel.sock")
		if err := os.MkdirAll(filepath.Dir(a.ZtunnelSocket), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if o.Command == nil {
		o.Command = exec.Command
	}
	sa := filepath.Join(dir, "serviceaccount")
	root := filepath.Join(dir, "root")
	for _, d := range []string{a.RunDir, sa, root} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	host, port, err := net.SplitHostPort(o.APIHost)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	files := map[string]string{
		filepath.Join(sa, "token"):     o.Token,
		filepath.Join(sa, "namespace"): "istio-system",
		kubeconfig: fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://%s', insecure-skip-tls-verify: true}}]\n"+
			"users: [{name: u, user: {token: %s}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n", o.APIHost, o.Token),
	}
	for p, c := range files {
		if err := os.WriteFile(p, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	log, err := os.Create(a.log)
	if err != nil {
		t.Fatal(err)
	}
	// Slave propagation, as the istio-cni chart's HostToContainer mount of
	// the netns dir: pod netns made after the agent started reach it.
	args := []string{"-m", "--propagation", "slave", "--", "sh", "-c", setup, "istio-node",
		root, o.HostNetns, bins, sa, o.BinDir, filepath.Dir(a.ZtunnelSocket),
		"/opt/istio/install-cni",
		"--mounted-cni-net-dir", o.ConfDir, "--cni-agent-run-dir", a.RunDir, "--ztunnel-uds-address", a.ZtunnelSocket,
		"--ambient-enabled", "--repair-enabled=false", "--skip-tls-verify", "--chained-cni-plugin", "--log-level", "info"}
	cmd := o.Command("unshare", args...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"KUBERNETES_SERVICE_HOST=" + host, "KUBERNETES_SERVICE_PORT=" + port, "KUBECONFIG=" + kubeconfig,
		"NODE_NAME=" + o.NodeName, "KUBERNETES_NODE_NAME=" + o.NodeName, "POD_NAMESPACE=istio-system", "POD_NAME=istio-cni-node-test",
		// The istio-cni chart's defaults, which nftcni's match.
		"EXCLUDE_NAMESPACES=kube-system", "AMBIENT_DNS_CAPTURE=true", "AMBIENT_IPV6=true",
		"AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE=false", // reads /host/proc/sys, for AWS nodes only
		`AMBIENT_ENABLEMENT_SELECTOR=[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},` +
			`{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},` +
			`"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]`,
		fmt.Sprintf("NATIVE_NFTABLES=%v", o.Nftables), fmt.Sprintf("ISTIO_OWNED_CNI_CONFIG=%v", o.OwnedConfig)}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	var once sync.Once
	a.stop = func() {
		once.Do(func() {
			defer log.Close()
			select {
			case <-exited: // killed with its node: its pid may be another's now
				return
			default:
			}
			// nsenter forks into a pid namespace and passes no signal on:
			// signal the agent itself.
			pid := agentPID(cmd.Process.Pid)
			_ = syscall.Kill(pid, syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(5 * time.Second):
				_ = syscall.Kill(pid, syscall.SIGKILL)
				_ = cmd.Process.Kill()
				<-exited
			}
		})
	}
	t.Cleanup(a.stop)
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		patched := false
		if ents, _ := os.ReadDir(o.ConfDir); len(ents) > 0 {
			for _, e := range ents {
				b, _ := os.ReadFile(filepath.Join(o.ConfDir, e.Name()))
				patched = patched || strings.Contains(string(b), `"istio-cni"`)
			}
		}
		_, zerr := os.Stat(o.Root + a.ZtunnelSocket)
		if patched && zerr == nil {
			return a
		}
		select {
		case <-exited:
			t.Fatalf("install-cni exited:\n%s", tail(a.log))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("install-cni did not install itself and serve ztunnel within 60 s:\n%s", tail(a.log))
		}
	}
}

// agentPID is the process started as pid, past any nsenter that forked
// to run it.
func agentPID(pid int) int {
	for {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if strings.TrimSpace(string(comm)) != "nsenter" {
			return pid
		}
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		f := strings.Fields(string(kids))
		if len(f) == 0 {
			return pid
		}
		next, err := strconv.Atoi(f[0])
		if err != nil {
			return pid
		}
		pid = next
	}
}

func tail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	b, _ := io.ReadAll(f)
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}

// Relay listens on 127.0.0.1 inside the netns ns and forwards each
// connection to target in the test's own netns: the API server, for
// processes in a node netns. It returns the address inside ns.
func Relay(t testing.TB, ns *testnet.NS, target string) string {
	t.Helper()
	ln := ns.Listen(t, "127.0.0.1:0", false)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				up, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer up.Close()
				go func() { _, _ = io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
				_, _ = io.Copy(c, up)
			}()
		}
	}()
	return ln.Addr().String()
}
