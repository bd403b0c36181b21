package plugin

import (
	"bytes"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"testing"

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
