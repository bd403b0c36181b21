// Package nodetest runs a real one-node Kubernetes for a test: etcd,
// kube-apiserver, kube-controller-manager, kube-scheduler, containerd (either
// generation) and kubelet, all inside one private net + mount + pid
// namespace (the recipe of ../shared/reference/lab-kubelet.md). Inside it
// PID 1 is the node's init, so the chart's HOST_NETNS=/host/proc/1/ns/net is
// the node's netns, never the machine's; kubelet's global writes (sysctls,
// /var/lib/kubelet, /var/log/containers, /var/lib/cni) land in the test's
// dir. Killing the init kills every process of the node at once: that is
// both the cleanup and the tests' node reboot. Tests only.
package nodetest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/nftcni/nftcni/integration/containerdtest"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
)

// Node addresses: the node IP on a veth pair (no dummy links here), the
// kubernetes Service VIP a one-rule kube-proxy stand-in sends to the API
// server, and the pod subnet of the bridge conflist.
const (
	NodeName  = "nftcni-node"
	NodeIP    = "192.168.250.1"
	ServiceIP = "10.0.0.1"
	PodSubnet = "10.88.0.0/16"
	Bridge    = "nodebr0"
	// ConfFile is the primary CNI's conflist in ConfDir.
	ConfFile = "10-node.conflist"
	// AdminToken is a bearer token of system:masters on the node's API server.
	AdminToken  = "node-admin-token"
	kubeletTok  = "node-kubelet-token"
	apiPort     = 6443
	etcdPort    = 2379
	etcdPeerPrt = 2380
	// containerdSock is inside the node's mount namespace.
	containerdSock = "/run/containerd/containerd.sock"
)

// Node is a running one-node cluster.
type Node struct {
	t   testing.TB
	Gen containerdtest.Generation
	// Dir holds everything of the node; ConfDir and BinDir are its CNI dirs.
	Dir, ConfDir, BinDir string
	Client               kubernetes.Interface
	Config               *rest.Config
	K8sBin               string
	cgroup               string
	init                 *exec.Cmd
	pid                  int
	services             []string
	running              map[string]*exec.Cmd // a service's process, by name
}

// Start brings up the node with gen's containerd and waits until the Node
// is Ready and the default ServiceAccount exists (about 15 s).
func Start(t testing.TB, gen containerdtest.Generation) *Node {
	t.Helper()
	testnet.RequireRoot(t)
	n := &Node{t: t, Gen: gen, K8sBin: kubetest.Bins(t)}
	for _, b := range []string{"kubelet", "kube-controller-manager", "kube-scheduler"} {
		if _, err := os.Stat(filepath.Join(n.K8sBin, b)); err != nil {
			t.Fatalf("%s not found in %s: run `make k8s-bins` (make test does)", b, n.K8sBin)
		}
	}
	dir, err := os.MkdirTemp("", "nftcni-node-")
	if err != nil {
		t.Fatal(err)
	}
	n.Dir, n.ConfDir, n.BinDir = dir, filepath.Join(dir, "cni/net.d"), filepath.Join(dir, "cni/bin")
	n.cgroup = filepath.Base(dir)
	t.Cleanup(n.cleanup)
	for _, d := range []string{"cni/net.d", "cni/bin", "logs", "pki", "run", "varlog", "sysctl", "mnt-cg", "containerd", "ipam", "podlogs", "kubelet"} {
		n.mkdir(d)
	}
	n.installCNI()
	n.writePKI()
	n.writeConfigs()
	n.boot()
	return n
}

func (n *Node) mkdir(rel string) string {
	p := filepath.Join(n.Dir, rel)
	if err := os.MkdirAll(p, 0o755); err != nil {
		n.t.Fatal(err)
	}
	return p
}

func (n *Node) write(rel, content string) string {
	p := filepath.Join(n.Dir, rel)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		n.t.Fatal(err)
	}
	return p
}

// installCNI puts the reference plugins in BinDir and the primary's conflist.
func (n *Node) installCNI() {
	src := testnet.Cached("NFTCNI_CNI_BIN", "cni-plugins-v1.10.0")
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		b, err := os.ReadFile(filepath.Join(src, p))
		if err != nil {
			n.t.Fatalf("reference CNI plugin %s: %v (make cni-plugins)", p, err)
		}
		if err := os.WriteFile(filepath.Join(n.BinDir, p), b, 0o755); err != nil {
			n.t.Fatal(err)
		}
	}
	n.WritePrimaryConflist()
}

// PrimaryConflist is what "the primary CNI" writes: bridge + portmap.
func (n *Node) PrimaryConflist() string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "nodenet",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}},
    {"type": "portmap", "capabilities": {"portMappings": true}, "backend": "nftables"}
  ]
}
`, Bridge, PodSubnet, filepath.Join(n.Dir, "ipam"))
}

// WritePrimaryConflist (re)writes the primary's conflist as a primary CNI's
// installer does on its start: its own content, any chained entry gone.
func (n *Node) WritePrimaryConflist() { n.WriteConflist(n.PrimaryConflist()) }

// WriteConflist writes doc as the primary's conflist (a primary that
// changed its configuration).
func (n *Node) WriteConflist(doc string) { n.write("cni/net.d/"+ConfFile, doc) }

func (n *Node) writePKI() {
	t := n.t
	caKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "nftcni-node-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(48 * time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := rsa.GenerateKey(rand.Reader, 2048)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kube-apiserver"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(48 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP(ServiceIP), net.ParseIP(NodeIP), net.ParseIP("127.0.0.1")},
		DNSNames:    []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	saKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	saPub, _ := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	pemOf := func(typ string, b []byte) string { return string(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b})) }
	n.write("pki/ca.crt", pemOf("CERTIFICATE", caDER))
	n.write("pki/ca.key", pemOf("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(caKey)))
	n.write("pki/apiserver.crt", pemOf("CERTIFICATE", der))
	n.write("pki/apiserver.key", pemOf("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(key)))
	n.write("pki/sa.key", pemOf("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey)))
	n.write("pki/sa.pub", pemOf("PUBLIC KEY", saPub))
	n.write("pki/tokens.csv", AdminToken+",admin,admin-uid,system:masters\n"+
		kubeletTok+",system:node:"+NodeName+",kubelet-uid,system:nodes\n")
	kubeconfig := func(token string) string {
		return fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: node\n  cluster:\n    server: https://%s:%d\n    certificate-authority: %s\n"+
			"users:\n- name: u\n  user:\n    token: %s\ncontexts:\n- name: c\n  context: {cluster: node, user: u}\ncurrent-context: c\n",
			NodeIP, apiPort, filepath.Join(n.Dir, "pki/ca.crt"), token)
	}
	n.write("admin.kubeconfig", kubeconfig(AdminToken))
	n.write("kubelet.kubeconfig", kubeconfig(kubeletTok))
	n.Config = &rest.Config{Host: fmt.Sprintf("https://%s:%d", NodeIP, apiPort), BearerToken: AdminToken,
		TLSClientConfig: rest.TLSClientConfig{CAData: []byte(pemOf("CERTIFICATE", caDER))}, QPS: 50, Burst: 100,
		Dial: n.DialContext}
	n.Client = kubernetes.NewForConfigOrDie(n.Config)
}

func (n *Node) writeConfigs() {
	d := n.Dir
	n.write("init.sh", fmt.Sprintf(`set -e
N=%[1]s
# sysfs of this netns, keeping the host's cgroup mounts (before make-rshared:
# after it, umount -R of the copy would propagate and strip /sys/fs/cgroup)
mount --rbind /sys/fs/cgroup $N/mnt-cg
mount -t sysfs sysfs /sys
mount --rbind $N/mnt-cg /sys/fs/cgroup
umount -R $N/mnt-cg
mount --make-rshared /
# /run is a tmpfs on a real node: a reboot starts it empty
mount -t tmpfs tmpfs $N/run
mount --bind $N/run /run
ln -sfn /dev/shm /run/shm; mkdir -p /run/lock
mount --bind $N/varlog /var/log
mkdir -p $N/varlib-up $N/varlib-work
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$N/varlib-up,workdir=$N/varlib-work /var/lib
# kubelet's setupKernelTunables writes global sysctls: private files
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  p=${kv%%%%=*}; f=$N/sysctl/${p//\//_}; echo ${kv#*=} > $f; mount --bind $f /proc/sys/$p
done
ip link set lo up
ip link add node0 type veth peer name node1
ip addr add %[2]s/24 dev node0
ip link set node1 up; ip link set node0 up
ip route add 10.0.0.0/24 dev node0
nft -f - <<'NFT'
table ip nodeproxy {
  chain pre { type nat hook prerouting priority dstnat; ip daddr %[3]s tcp dport 443 dnat to %[2]s:%[4]d; }
  chain out { type nat hook output priority -100; ip daddr %[3]s tcp dport 443 dnat to %[2]s:%[4]d; }
}
NFT
touch $N/init.ready
trap 'exit 0' TERM
while :; do sleep 3600 & wait $! || true; done
`, d, NodeIP, ServiceIP, apiPort))
	// Socket, state and runc's root on the node's /run, a tmpfs: a reboot
	// starts them empty, as on a real node.
	gen := "1"
	if n.Gen.V2 {
		gen = "2"
	}
	n.write("containerd/config.toml", containerdtest.Config(n.Gen, containerdtest.Paths{
		Root: filepath.Join(d, "containerd/root"+gen), State: "/run/containerd/state" + gen, Sock: containerdSock,
		RuncRoot: "/run/containerd/runc" + gen, BinDir: n.BinDir, ConfDir: n.ConfDir}))
	n.write("kubelet-config.yaml", fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: /%[2]s
containerRuntimeEndpoint: unix://%[3]s
makeIPTablesUtilChains: false
oomScoreAdj: 0
protectKernelDefaults: false
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
podLogsDir: %[1]s/podlogs
rotateCertificates: false
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
resolvConf: /etc/resolv.conf
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
`, d, n.cgroup, containerdSock))
}

// boot starts the node's init and every service, as a machine boots.
func (n *Node) boot() {
	t := n.t
	for _, h := range cgroupHierarchies() {
		if err := os.MkdirAll(filepath.Join(h, n.cgroup), 0o755); err != nil {
			t.Fatal(err)
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, _ := os.ReadFile(filepath.Join(h, f))
				_ = os.WriteFile(filepath.Join(h, n.cgroup, f), b, 0o644)
			}
		}
	}
	_ = os.Remove(filepath.Join(n.Dir, "init.ready"))
	log := n.openLog("init")
	n.init = exec.Command("unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private", "bash", filepath.Join(n.Dir, "init.sh"))
	n.init.Stdout, n.init.Stderr = log, log
	n.init.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := n.init.Start(); err != nil {
		t.Fatal(err)
	}
	log.Close()
	n.waitFor("the node's init", 10*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(n.Dir, "init.ready"))
		return err == nil
	})
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", n.init.Process.Pid, n.init.Process.Pid))
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("the node's init pid: %q", b)
	}
	n.pid = pid
	n.startServices()
}

func (n *Node) startServices() {
	t, d := n.t, n.Dir
	// containerd first, so its CNI config is loaded before kubelet asks.
	env := []string{"PATH=" + n.Gen.Dir + ":" + os.Getenv("PATH")}
	n.Service("containerd", env, filepath.Join(n.Gen.Dir, "containerd"), "--config", filepath.Join(d, "containerd/config.toml"))
	n.waitFor("containerd's socket", 30*time.Second, func() bool {
		_, err := n.Run(filepath.Join(n.Gen.Dir, "ctr"), "-a", containerdSock, "version")
		return err == nil
	})
	n.importImage("pause", mustPause(t))
	etcdURL := func(p int) string { return fmt.Sprintf("http://127.0.0.1:%d", p) }
	n.Service("etcd", nil, filepath.Join(n.K8sBin, "etcd"), "--data-dir", filepath.Join(d, "etcd"), "--name", "default",
		"--listen-client-urls", etcdURL(etcdPort), "--advertise-client-urls", etcdURL(etcdPort),
		"--listen-peer-urls", etcdURL(etcdPeerPrt), "--initial-advertise-peer-urls", etcdURL(etcdPeerPrt),
		"--initial-cluster", "default="+etcdURL(etcdPeerPrt), "--log-level", "warn")
	pki := func(f string) string { return filepath.Join(d, "pki", f) }
	n.Service("kube-apiserver", nil, filepath.Join(n.K8sBin, "kube-apiserver"),
		"--etcd-servers="+etcdURL(etcdPort), "--bind-address=0.0.0.0", "--advertise-address="+NodeIP,
		fmt.Sprintf("--secure-port=%d", apiPort), "--tls-cert-file="+pki("apiserver.crt"), "--tls-private-key-file="+pki("apiserver.key"),
		"--client-ca-file="+pki("ca.crt"), "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+pki("sa.pub"), "--service-account-signing-key-file="+pki("sa.key"),
		"--token-auth-file="+pki("tokens.csv"), "--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
		"--kubelet-preferred-address-types=InternalIP", "--endpoint-reconciler-type=none", "--v=1")
	n.waitFor("kube-apiserver /readyz", 90*time.Second, func() bool {
		r, err := n.Client.CoreV1().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		return err == nil && strings.HasPrefix(string(r), "ok")
	})
	admin := filepath.Join(d, "admin.kubeconfig")
	n.Service("kube-controller-manager", nil, filepath.Join(n.K8sBin, "kube-controller-manager"), "--kubeconfig="+admin,
		"--authentication-kubeconfig="+admin, "--authorization-kubeconfig="+admin,
		"--service-account-private-key-file="+pki("sa.key"), "--root-ca-file="+pki("ca.crt"),
		"--use-service-account-credentials=false", "--leader-elect=false", "--bind-address=127.0.0.1", "--controllers=*", "--v=1")
	n.Service("kube-scheduler", nil, filepath.Join(n.K8sBin, "kube-scheduler"), "--kubeconfig="+admin,
		"--authentication-kubeconfig="+admin, "--authorization-kubeconfig="+admin, "--leader-elect=false", "--bind-address=127.0.0.1", "--v=1")
	n.Service("kubelet", nil, filepath.Join(n.K8sBin, "kubelet"), "--config="+filepath.Join(d, "kubelet-config.yaml"),
		"--kubeconfig="+filepath.Join(d, "kubelet.kubeconfig"), "--root-dir="+filepath.Join(d, "kubelet"),
		"--cert-dir="+filepath.Join(d, "kubelet/pki"), "--hostname-override="+NodeName, "--node-ip="+NodeIP, "--v=1")
	n.waitFor("node Ready", 90*time.Second, func() bool {
		node, err := n.Client.CoreV1().Nodes().Get(context.Background(), NodeName, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	})
	n.waitFor("the default ServiceAccount", 60*time.Second, func() bool {
		_, err := n.Client.CoreV1().ServiceAccounts("default").Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil
	})
}

func mustPause(t testing.TB) []byte {
	b, err := containerdtest.PauseArchive()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Service starts a long-running process inside the node, logging to
// logs/NAME.log; it dies with the node.
func (n *Node) Service(name string, env []string, bin string, args ...string) {
	log := n.openLog(name)
	defer log.Close()
	cmd := n.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	n.services = append(n.services, name)
	if n.running == nil {
		n.running = map[string]*exec.Cmd{}
	}
	n.running[name] = cmd
}

// StopService kills the service name and its process inside the node (its
// session: nsenter and what it runs), e.g. a variant's own service before
// the next one runs.
func (n *Node) StopService(name string) {
	if cmd := n.running[name]; cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		delete(n.running, name)
	}
}

// openLog opens logs/NAME.log for appending: a reboot keeps what was
// logged before it.
func (n *Node) openLog(name string) *os.File {
	f, err := os.OpenFile(filepath.Join(n.Dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		n.t.Fatal(err)
	}
	return f
}

// Processes are the host PIDs of the node's processes named comm (as
// /proc/PID/comm has it), e.g. the agent inside its container.
func (n *Node) Processes(comm string) []int {
	seen := map[int]bool{}
	var out []int
	for _, p := range cgroupProcs(n.cgroup) {
		pid, err := strconv.Atoi(p)
		if err != nil || seen[pid] {
			continue
		}
		seen[pid] = true
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(b)) == comm {
			out = append(out, pid)
		}
	}
	return out
}

// Netns is the node's netns as /proc/PID/ns/net links read ("net:[N]").
func (n *Node) Netns() string {
	l, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", n.pid))
	return l
}

// Path is p inside the node's mount namespace, as the test opens it
// (through the node init's root): the node's /run is its own tmpfs.
func (n *Node) Path(p string) string { return fmt.Sprintf("/proc/%d/root%s", n.pid, p) }

// Command is bin run inside the node's namespaces, in the node's dir.
func (n *Node) Command(bin string, args ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"-t", strconv.Itoa(n.pid), "-m", "-n", "-p", "--wd=" + n.Dir, "--", bin}, args...)...)
}

// Run runs a command inside the node and returns its combined output.
func (n *Node) Run(bin string, args ...string) (string, error) {
	out, err := n.Command(bin, args...).CombinedOutput()
	return string(out), err
}

// importImage imports an OCI archive into containerd's k8s.io namespace.
func (n *Node) importImage(name string, archive []byte) {
	p := filepath.Join(n.Dir, name+".oci.tar")
	if err := os.WriteFile(p, archive, 0o644); err != nil {
		n.t.Fatal(err)
	}
	if out, err := n.Run(filepath.Join(n.Gen.Dir, "ctr"), "-a", containerdSock, "-n", "k8s.io", "images", "import", "--all-platforms", p); err != nil {
		n.t.Fatalf("ctr images import %s: %v\n%s", name, err, out)
	}
}

// Import imports an OCI archive file (make image's, or one a test built).
func (n *Node) Import(name string, archive []byte) { n.importImage(name, archive) }

// DialContext dials from inside the node's netns: the test's clients reach
// the API server and the pods as node processes do.
func (n *Node) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	netns, err := ns.GetNS(fmt.Sprintf("/proc/%d/ns/net", n.pid))
	if err != nil {
		return nil, err
	}
	defer netns.Close()
	var c net.Conn
	err = netns.Do(func(ns.NetNS) error {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// HTTP is a client whose connections start in the node's netns.
func (n *Node) HTTP() *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: n.DialContext, DisableKeepAlives: true}}
}

// Helm runs the real helm inside the node against its API server.
func (n *Node) Helm(args ...string) (string, error) {
	helm := testnet.Cached("NFTCNI_HELM", "helm-v3.22.0/helm")
	if strings.HasSuffix(os.Getenv("NFTCNI_HELM"), "/helm") {
		helm = os.Getenv("NFTCNI_HELM")
	}
	cmd := n.Command("env", append([]string{"KUBECONFIG=" + filepath.Join(n.Dir, "admin.kubeconfig"),
		"HELM_CACHE_HOME=" + filepath.Join(n.Dir, "helm/cache"), "HELM_CONFIG_HOME=" + filepath.Join(n.Dir, "helm/config"),
		"HELM_DATA_HOME=" + filepath.Join(n.Dir, "helm/data"), helm}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// Reboot kills every process of the node at once (its init), runs
// beforeServices with the node down (the disk as the reboot left it), then
// boots it again: a fresh /run, the same disk, every service restarted.
func (n *Node) Reboot(beforeServices func()) {
	n.kill()
	// A machine boots with no cgroup of its last boot: left, the kubelet's
	// cAdvisor would ask containerd about every dead container's cgroup
	// (seconds each) before it syncs a pod.
	n.removeCgroups()
	if beforeServices != nil {
		beforeServices()
	}
	n.services, n.running = nil, nil // dead with the node
	n.boot()
}

func (n *Node) kill() {
	if n.init == nil || n.init.Process == nil {
		return
	}
	_ = syscall.Kill(n.pid, syscall.SIGKILL)
	_ = n.init.Process.Kill()
	_, _ = n.init.Process.Wait()
	// Every process of the pid namespace is gone once its init is; wait
	// for the cgroups to empty (the kernel reaps asynchronously).
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if len(cgroupProcs(n.cgroup)) == 0 {
			break
		}
	}
	n.init = nil
}

func (n *Node) cleanup() {
	t := n.t
	if t.Failed() {
		for _, s := range append([]string{"init"}, n.services...) {
			b, _ := os.ReadFile(filepath.Join(n.Dir, "logs", s+".log"))
			if len(b) > 3000 {
				b = b[len(b)-3000:]
			}
			t.Logf("%s log tail:\n%s", s, b)
		}
	}
	n.kill()
	if left := cgroupProcs(n.cgroup); len(left) > 0 {
		t.Errorf("processes left in the node's cgroups: %v", left)
	}
	n.removeCgroups()
	if os.Getenv("NFTCNI_KEEP_NODE") == "" {
		_ = os.RemoveAll(n.Dir)
	} else {
		t.Logf("node dir kept: %s", n.Dir)
	}
}

// removeCgroups removes the node's cgroup tree, deepest first (its
// processes are gone).
func (n *Node) removeCgroups() {
	for _, h := range cgroupHierarchies() {
		var dirs []string
		_ = filepath.WalkDir(filepath.Join(h, n.cgroup), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = os.Remove(dirs[i])
		}
	}
}

// cgroupHierarchies lists the v1 hierarchies (and the unified one) that
// kubelet makes its cgroup root in.
func cgroupHierarchies() []string {
	var out []string
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	for _, e := range entries {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			out = append(out, p)
		}
	}
	return out
}

// cgroupProcs lists the pids under the node's cgroup root.
func cgroupProcs(name string) []string {
	var pids []string
	for _, h := range cgroupHierarchies() {
		_ = filepath.WalkDir(filepath.Join(h, name), func(p string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && d.Name() == "cgroup.procs" {
				b, _ := os.ReadFile(p)
				pids = append(pids, strings.Fields(string(b))...)
			}
			return nil
		})
	}
	return pids
}

func (n *Node) waitFor(what string, limit time.Duration, ok func() bool) {
	n.t.Helper()
	for deadline := time.Now().Add(limit); ; time.Sleep(100 * time.Millisecond) {
		if ok() {
			return
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("node: %s not within %v", what, limit)
		}
	}
}

// WaitFor polls ok every 100 ms until it holds, failing the test after limit.
func (n *Node) WaitFor(what string, limit time.Duration, ok func() bool) {
	n.t.Helper()
	n.waitFor(what, limit, ok)
}
