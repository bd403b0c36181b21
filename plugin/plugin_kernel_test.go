//go:build !unit

package plugin

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/plugin/wire"
)

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
	p := &Plugin{DialTimeout: time.Second, Timeout: 200 * time.Millisecond, Kernel: netlinkKernel{}}
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
