package plugin

import (
	"bytes"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/plugin/wire"
)

// silentAgent accepts connections on the agent's socket and never answers:
// an agent that is up but stuck.
func silentAgent(t *testing.T, runDir string) {
	t.Helper()
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: filepath.Join(runDir, wire.SocketName), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
}

// An agent that answers late is treated like one that is down: the pod's
// fate comes from the policy snapshot, within the plugin's timeout.
func TestLateAgent(t *testing.T) {
	testnet.RequireRoot(t)
	run := t.TempDir()
	silentAgent(t, run)
	pol, _ := json.Marshal(&wire.Policy{EnrolledNamespaces: []string{"mesh"}})
	if err := os.WriteFile(filepath.Join(run, wire.PolicyName), pol, 0o644); err != nil {
		t.Fatal(err)
	}
	pod := testnet.NewNS(t, "nftpod")
	p := &Plugin{DialTimeout: time.Second, Timeout: 200 * time.Millisecond}
	add := func(ns string) (string, error, time.Duration) {
		stdin := `{"cniVersion":"1.0.0","name":"n","type":"nftcni","cni_agent_run_dir":"` + run + `","prevResult":` + prev + `}`
		args := &Args{Command: "ADD", ContainerID: "c1", Netns: pod.Path, IfName: "eth0", StdinData: []byte(stdin),
			Args: "K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=p"}
		var out bytes.Buffer
		start := time.Now()
		err := p.Add(args, &out)
		return out.String(), err, time.Since(start)
	}
	_, err, took := add("mesh")
	if err == nil || !strings.Contains(err.Error(), "must be enrolled") || !strings.Contains(err.Error(), "timeout") {
		t.Errorf("enrolled-namespace pod with a stuck agent: %v", err)
	}
	if took > 2*time.Second {
		t.Errorf("ADD took %v with a 200ms agent timeout", took)
	}
	out, err, _ := add("plain")
	if err != nil || !strings.Contains(out, `"10.88.0.5/24"`) {
		t.Errorf("plain pod with a stuck agent: %v, result %s", err, out)
	}
}

// The agent's own pod, host-network pods and non-Kubernetes calls pass
// through without any agent at all.
func TestPassThrough(t *testing.T) {
	// No agent, and a snapshot that would fail every one of these pods
	// closed: only a pass-through lets them start.
	run := t.TempDir()
	pol, _ := json.Marshal(&wire.Policy{EnrolledNamespaces: []string{"", "mesh", "kube-system", "nftcni-system"}})
	if err := os.WriteFile(filepath.Join(run, wire.PolicyName), pol, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, args, netns string
	}{
		{"no k8s args", "", "/proc/self/ns/net"},
		{"agent pod", "K8S_POD_NAMESPACE=nftcni-system;K8S_POD_NAME=nftcni-node-abcde", "/nonexistent"},
		{"excluded namespace", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns", "/nonexistent"},
		{"host network", "K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=p", "/proc/self/ns/net"},
	} {
		stdin := `{"cniVersion":"1.0.0","name":"n","type":"nftcni","cni_agent_run_dir":"` + run +
			`","pod_namespace":"nftcni-system","exclude_namespaces":["kube-system"],"prevResult":` + prev + `}`
		args := &Args{Command: "ADD", ContainerID: "c1", Netns: tc.netns, IfName: "eth0", StdinData: []byte(stdin), Args: tc.args}
		var out bytes.Buffer
		err := New().Add(args, &out)
		res := out.String()
		if err != nil || res != prev+"\n" {
			t.Errorf("%s: %v, result %s", tc.name, err, res)
		}
	}
}
