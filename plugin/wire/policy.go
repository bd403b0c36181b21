package wire

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// Policy is the snapshot of enrolment policy the agent keeps in
// <run dir>/policy.json, written atomically whenever it changes. The plugin
// reads it only when the agent cannot be reached, to tell a pod that must
// not start un-captured (fail ADD, the runtime retries) from one the agent
// would leave alone (let it through).
//
// The plugin cannot evaluate pod label selectors (the runtime does not pass
// labels), so the agent pre-computes what it can: namespaces whose labels
// enrol their pods, and a decision per pod it already knows is bound to
// this node (the scheduler binds pods before the runtime creates them).
type Policy struct {
	Generated time.Time `json:"generated"`
	// BootID is the kernel's boot ID when the agent wrote it: a snapshot
	// of an earlier boot is still read (it lets pods outside the mesh start
	// before the agent is back), and said to be stale.
	BootID string `json:"bootID,omitempty"`
	// ExcludeNamespaces are never enrolled.
	ExcludeNamespaces []string `json:"excludeNamespaces"`
	// EnrolledNamespaces enrol their pods unless a pod opts out.
	EnrolledNamespaces []string `json:"enrolledNamespaces"`
	// Pods maps "namespace/name" to the agent's decision for it.
	Pods map[string]Mode `json:"pods,omitempty"`
	// Selectors is the enablement selector list, for people reading the file.
	Selectors json.RawMessage `json:"selectors,omitempty"`
	// Cleanup removes whatever pod ruleset of ours a netns holds, either
	// kind: the plugin's DEL sends it as it is, so the plugin never links
	// the encoders (package nlsend).
	Cleanup *nlsend.Removal `json:"cleanup,omitempty"`
}

// Fallback is what the plugin does for pod key in namespace ns when the
// agent is unreachable: true means the pod would be enrolled (fail the ADD).
func (p *Policy) Fallback(ns, key string) (enrol bool, why string) {
	if m, ok := p.Pods[key]; ok {
		return m != ModeNone, fmt.Sprintf("the agent's last decision for %s was %s", key, m)
	}
	if slices.Contains(p.ExcludeNamespaces, ns) {
		return false, fmt.Sprintf("namespace %s is excluded", ns)
	}
	if slices.Contains(p.EnrolledNamespaces, ns) {
		return true, fmt.Sprintf("namespace %s is enrolled", ns)
	}
	return false, fmt.Sprintf("namespace %s is not enrolled", ns)
}

// bootIDPath is where the kernel says which boot this is.
var bootIDPath = "/proc/sys/kernel/random/boot_id"

// BootID is this boot's ID ("" when the kernel does not say).
func BootID() string {
	b, err := os.ReadFile(bootIDPath)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Stale says whether the snapshot was written before this boot.
func (p *Policy) Stale() bool { return p.BootID != "" && p.BootID != BootID() }

// maxPolicy bounds a snapshot: a few hundred pods take tens of KiB.
const maxPolicy = 4 << 20

// ReadPolicy reads a snapshot; anything over maxPolicy is refused as not
// ours rather than read into a short-lived plugin.
func ReadPolicy(path string) (*Policy, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxPolicy+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxPolicy {
		return nil, fmt.Errorf("policy snapshot %s is over %d bytes", path, maxPolicy)
	}
	p := &Policy{}
	if err := json.Unmarshal(b, p); err != nil {
		return nil, fmt.Errorf("policy snapshot %s: %w", path, err)
	}
	return p, nil
}
