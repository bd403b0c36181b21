package integration

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/plugin/wire"
)

// TestPolicySnapshotOutlivesAReboot: with a state dir, the policy snapshot
// the plugin falls back on is on persistent storage. After a reboot (the
// run dir, a tmpfs, emptied; the agent not back yet) the snapshot of the
// earlier boot still lets a pod outside the mesh start, and still refuses
// a pod the mesh would enrol (it never enrols one). Without a state dir
// the snapshot goes with the run dir and every pod outside the excluded
// namespaces waits for the agent.
func TestPolicySnapshotOutlivesAReboot(t *testing.T) {
	for _, persistent := range []bool{true, false} {
		name := map[bool]string{true: "state-dir", false: "run-dir"}[persistent]
		t.Run(name, func(t *testing.T) {
			subnet := map[bool]int{true: 65, false: 66}[persistent]
			n := newCNINode(t, subnet)
			if persistent {
				n.state = t.TempDir()
			}
			n.startAgent()
			snapshot := filepath.Join(n.run, wire.PolicyName)
			if persistent {
				snapshot = filepath.Join(n.state, wire.PolicyName)
			}
			pol, err := wire.ReadPolicy(snapshot)
			if err != nil || pol.BootID != wire.BootID() || pol.Stale() {
				t.Fatalf("the agent's snapshot at %s: %+v %v, want this boot's", snapshot, pol, err)
			}
			full := n.list("bridge", "1.0.0", true, false)
			// The reboot: the agent gone, the run dir's tmpfs empty again,
			// the snapshot (if it survived) an earlier boot's.
			n.stopAgent()
			if err := os.RemoveAll(n.run); err != nil {
				t.Fatal(err)
			}
			if persistent {
				pol.BootID = "00000000-0000-0000-0000-earlier-boot"
				b, _ := json.Marshal(pol)
				if err := os.WriteFile(snapshot, b, 0o644); err != nil {
					t.Fatal(err)
				}
			}

			plain := testnet.NewNS(t, "nftpod")
			n.pod(plainNS, "web", nil)
			_, err = n.add(full, runtimeConf(plain, plainNS, "web", nil))
			switch {
			case persistent && err != nil:
				t.Errorf("a pod outside the mesh waited for the agent after the reboot: %v", err)
			case !persistent && (err == nil || !strings.Contains(err.Error(), "no policy snapshot")):
				t.Errorf("without a state dir, ADD of a pod outside the mesh after the reboot: %v, want it to wait (no snapshot)", err)
			}
			if persistent && !strings.Contains(readPluginLog(t, n), "policy snapshot of an earlier boot") {
				t.Errorf("the plugin did not say its snapshot is an earlier boot's:\n%s", readPluginLog(t, n))
			}
			meshed := testnet.NewNS(t, "nftpod")
			n.pod(meshNS, "app", nil)
			if _, err := n.add(full, runtimeConf(meshed, meshNS, "app", nil)); err == nil {
				t.Error("a pod the mesh enrols started with the agent down")
			}
			if hasTable(t, meshed) || hasTable(t, plain) {
				t.Error("a ruleset was made without the agent")
			}
		})
	}
}

// readPluginLog is the plugin's own log file (it writes there while the
// agent cannot be reached).
func readPluginLog(t *testing.T, n *cniNode) string {
	t.Helper()
	b, _ := os.ReadFile(filepath.Join(n.run, "plugin.log"))
	return string(b)
}
