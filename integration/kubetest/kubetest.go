// Package kubetest runs a real etcd and kube-apiserver for a test (the
// binaries `make k8s-bins` builds from the Go module proxy) and hands back
// a client config. Everything lives in the test's temp dir and stops at
// cleanup. Tests only.
package kubetest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/nftcni/nftcni/internal/testnet"
)

// Server is a running API server.
type Server struct {
	Config     *rest.Config
	Client     kubernetes.Interface
	Kubeconfig string // a kubeconfig file for processes under test
	Token      string // the bearer token of Kubeconfig (system:masters)
	// AgentKubeconfig authenticates as the chart's service account,
	// kube-system/nftcni, which can do only what RBAC objects the test
	// creates allow.
	AgentKubeconfig string
}

// AgentServiceAccount is who AgentKubeconfig authenticates as.
const AgentServiceAccount = "system:serviceaccount:kube-system:nftcni"

// Bins is the dir holding etcd and kube-apiserver.
func Bins(t testing.TB) string {
	t.Helper()
	dir := testnet.Cached("NFTCNI_K8S_BIN", "k8s-v1.37.2")
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("%s not found in %s: run `make k8s-bins` (make test does) or set NFTCNI_K8S_BIN", b, dir)
		}
	}
	return dir
}

func start(t testing.TB, name, bin string, args ...string) {
	t.Helper()
	log, err := os.Create(filepath.Join(t.TempDir(), name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("%s log tail:\n%s", name, b)
		}
		log.Close()
	})
}

// Start runs etcd and kube-apiserver (about 3 s) and waits for /readyz.
func Start(t testing.TB) *Server {
	t.Helper()
	bins := Bins(t)
	dir := t.TempDir()
	etcdClient, etcdPeer, apiPort := testnet.FreePort(t), testnet.FreePort(t), testnet.FreePort(t)
	start(t, "etcd", filepath.Join(bins, "etcd"), "--data-dir", filepath.Join(dir, "etcd"), "--name", "default",
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", etcdPeer), "--log-level", "warn")

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := x509.MarshalPKIXPublicKey(&key.PublicKey)
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	saKey := write("sa.key", pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	saPub := write("sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))
	const token = "nftcni-test-token"
	const agentToken = "nftcni-agent-token"
	tokens := write("tokens.csv", []byte(token+",admin,admin-uid,system:masters\n"+
		agentToken+","+AgentServiceAccount+`,agent-uid,"system:serviceaccounts,system:serviceaccounts:kube-system"`+"\n"))
	certDir := filepath.Join(dir, "certs")
	start(t, "kube-apiserver", filepath.Join(bins, "kube-apiserver"),
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdClient),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", apiPort),
		"--cert-dir="+certDir, "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--token-auth-file="+tokens, "--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
		"--disable-admission-plugins=ServiceAccount", "--endpoint-reconciler-type=none", "--v=1")

	host := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	ready := false
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(certDir, "apiserver.crt")); err != nil {
			continue
		}
		c := &http.Client{Timeout: time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
		req, _ := http.NewRequestWithContext(context.Background(), "GET", host+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		if resp, err := c.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				ready = true
				break
			}
		}
	}
	if !ready {
		t.Fatal("kube-apiserver never became ready")
	}
	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := &rest.Config{Host: host, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: ca}, QPS: 100, Burst: 200}
	kubeconfig := func(name, token string) string {
		kc := clientcmdapi.NewConfig()
		kc.Clusters["test"] = &clientcmdapi.Cluster{Server: host, CertificateAuthorityData: ca}
		kc.AuthInfos["test"] = &clientcmdapi.AuthInfo{Token: token}
		kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
		kc.CurrentContext = "test"
		p := filepath.Join(dir, name)
		if err := clientcmd.WriteToFile(*kc, p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return &Server{Config: cfg, Client: kubernetes.NewForConfigOrDie(cfg), Token: token,
		Kubeconfig: kubeconfig("kubeconfig", token), AgentKubeconfig: kubeconfig("agent-kubeconfig", agentToken)}
}
