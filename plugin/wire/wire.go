// Package wire is the protocol between the nftcni plugin and the agent: the
// messages, their encoding, and the policy snapshot the plugin reads when
// the agent is down. Both binaries import it; it imports nothing of either.
//
// Transport: a unix SOCK_SEQPACKET socket, so each message is one datagram
// with its boundaries kept and a netns fd rides along in SCM_RIGHTS. A
// message is one JSON object of at most MaxMessage bytes.
//
// One pod ADD is one connection and, for an enrolled pod, two round trips:
//
//	plugin -> agent   add      (pod identity, IPs, runtime annotations, netns fd)
//	agent  -> plugin  decision (none / ambient / sidecar, and the ruleset
//	                            encoded for the kernel: a Batch)
//	plugin -> agent   outcome  (batch programmed, or why not; the call's logs)
//	agent  -> plugin  done     (pod enrolled) or error (enrolment undone)
//
// A pod outside the mesh ends after the decision. While the plugin
// programs, the agent does its own part of the enrolment (ztunnel, host
// probe set, record) and undoes it if the outcome is a failure.
//
// DEL, CHECK (with the netns fd), STATUS, GC and INSPECT are one request
// and one reply each. Log records the plugin has left once its
// conversation is over go in a one-way log message the agent does not
// answer.
package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// File names under the agent's run dir (cni_agent_run_dir).
const (
	SocketName = "plugin.sock" // the agent's event socket, mode 0600
	PolicyName = "policy.json" // the snapshot the plugin falls back on
	LogName    = "plugin.log"  // where the plugin logs when the agent is down
)

// MaxMessage bounds one message; anything longer is refused, not truncated.
const MaxMessage = 64 << 10

// Kind says what a message is.
type Kind string

const (
	KindAdd      Kind = "add"
	KindDecision Kind = "decision"
	KindOutcome  Kind = "outcome"
	KindDone     Kind = "done"
	KindDel      Kind = "del"
	KindCheck    Kind = "check"
	KindStatus   Kind = "status"
	KindGC       Kind = "gc"
	KindLog      Kind = "log"
	KindError    Kind = "error"
	// KindInspect asks the agent about a pod (Pod.UID, or Pod.Namespace and
	// Pod.Name for a pod the inspector has no record of) for an operator's
	// inspect command; the answer is done with Inspect set.
	KindInspect Kind = "inspect"
)

// Mode is the agent's decision for a pod.
type Mode string

const (
	ModeNone    Mode = "none"
	ModeAmbient Mode = "ambient"
	ModeSidecar Mode = "sidecar"
)

// Message is the single envelope of the protocol; Kind says which fields
// are meaningful.
type Message struct {
	Kind Kind `json:"kind"`
	// Pod: add, del, check.
	Pod *Pod `json:"pod,omitempty"`
	// Decision: decision.
	Decision *Verdict `json:"decision,omitempty"`
	// Batch: decision, for an enrolled pod: its ruleset as the kernel
	// takes it, for the plugin to write into the pod's netns as it is.
	Batch *nlsend.Batch `json:"batch,omitempty"`
	// Error: outcome (empty = rules in place) and error.
	Error string `json:"error,omitempty"`
	// Valid: gc, the attachments the runtime still has.
	Valid []Attachment `json:"valid,omitempty"`
	// Logs: outcome, del and log, one JSON object per record.
	Logs []json.RawMessage `json:"logs,omitempty"`
	// Timings: outcome, where the plugin's time went, for the agent's log.
	Timings *Timings `json:"timings,omitempty"`
	// Inspect: the answer to inspect.
	Inspect *Inspect `json:"inspect,omitempty"`
}

// Timings are milliseconds from the plugin's start.
type Timings struct {
	Decided    float64 `json:"decided_ms"`    // the agent's decision arrived
	Programmed float64 `json:"programmed_ms"` // the batch was in the kernel
}

// Inspect is what the running agent knows of a pod beyond its record.
type Inspect struct {
	// ZDS says what ztunnel has of the pod.
	ZDS string `json:"zds"`
	// Verified is when the agent last found the pod's ruleset intact
	// (zero: not yet); Drift is what it found wrong last, if anything.
	Verified time.Time `json:"verified,omitzero"`
	Drift    string    `json:"drift,omitempty"`
	// Repairs counts the times the agent put the ruleset back.
	Repairs int `json:"repairs,omitempty"`
	// Pod and Enrolment answer an inspect by namespace and name: the pod
	// as the agent tracks it without a record (a pod found through /proc
	// whose istio-cni rules it left in place, say) and its mode with why.
	Pod       *Pod   `json:"pod,omitempty"`
	Enrolment string `json:"enrolment,omitempty"`
}

// Attachment is what CNI identifies a pod's network attachment by.
type Attachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// Pod is the identity the plugin knows from CNI_ARGS and prevResult.
type Pod struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
	Attachment
	IPs []netip.Prefix `json:"ips,omitempty"`
	// Netns is CNI_NETNS: the agent keeps it to find the netns again after
	// its own restart (it uses the descriptor, not the path, otherwise).
	Netns string `json:"netns,omitempty"`
	// Annotations came from the runtime (io.kubernetes.cri.pod-annotations);
	// nil when it passed none.
	Annotations map[string]string `json:"annotations,omitempty"`
}

// Key names the pod as Kubernetes does.
func (p *Pod) Key() string { return p.Namespace + "/" + p.Name }

// HasIPv6 says whether any of the pod's addresses is IPv6.
func HasIPv6(ips []netip.Prefix) bool {
	for _, p := range ips {
		if p.Addr().Is6() && !p.Addr().Is4In6() {
			return true
		}
	}
	return false
}

// Verdict is the agent's decision as the plugin gets it: the mode and why.
// What the ruleset is made of stays in the agent; the plugin gets it
// encoded (Message.Batch).
type Verdict struct {
	Mode Mode `json:"mode"`
	// Reason is a short human explanation, logged by both sides.
	Reason string `json:"reason,omitempty"`
}

// Encode marshals m, refusing what the peer would refuse.
func Encode(m *Message) ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("%s message of %d bytes exceeds the %d-byte limit", m.Kind, len(b), MaxMessage)
	}
	return b, nil
}

// Decode parses one message and checks that the fields its kind needs are
// there, so handlers never see a half-formed message.
func Decode(b []byte) (*Message, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("message of %d bytes exceeds the %d-byte limit", len(b), MaxMessage)
	}
	d := json.NewDecoder(bytes.NewReader(b))
	m := &Message{}
	if err := d.Decode(m); err != nil {
		return nil, fmt.Errorf("decoding message: %w", err)
	}
	if len(bytes.TrimSpace(b[d.InputOffset():])) > 0 {
		return nil, errors.New("decoding message: trailing data after the object")
	}
	switch m.Kind {
	case KindAdd, KindDel, KindCheck:
		if m.Pod == nil {
			return nil, fmt.Errorf("%s message without a pod", m.Kind)
		}
		if m.Pod.Namespace == "" || m.Pod.Name == "" || m.Pod.ContainerID == "" {
			return nil, fmt.Errorf("%s message: pod needs namespace, name and containerID", m.Kind)
		}
	case KindDecision:
		if m.Decision == nil {
			return nil, errors.New("decision message without a decision")
		}
		switch m.Decision.Mode {
		case ModeNone:
		case ModeAmbient, ModeSidecar:
			if m.Batch == nil || len(m.Batch.Tables) == 0 {
				return nil, fmt.Errorf("decision message: %s without a batch to program", m.Decision.Mode)
			}
		default:
			return nil, fmt.Errorf("decision message: unknown mode %q", m.Decision.Mode)
		}
	case KindInspect:
		if m.Pod == nil || (m.Pod.UID == "" && (m.Pod.Namespace == "" || m.Pod.Name == "")) {
			return nil, errors.New("inspect message: needs a pod UID, or its namespace and name")
		}
	case KindOutcome, KindDone, KindStatus, KindGC, KindLog, KindError:
	default:
		return nil, fmt.Errorf("unknown message kind %q", m.Kind)
	}
	return m, nil
}
