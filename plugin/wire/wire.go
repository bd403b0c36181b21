// Package wire is the protocol between the nftcni plugin and the agent: the
// messages, their encoding, and the policy snapshot the plugin reads when
// the agent is down. Both binaries import it; it imports nothing of either.
//
// Transport: a unix SOCK_SEQPACKET socket, so each message is one datagram
// with its boundaries kept and a netns fd rides along in SCM_RIGHTS. A
// message is one JSON object of at most MaxMessage bytes.
//
// One pod ADD is one connection and, for an enrolled pod, four messages:
//
//	plugin -> agent   add      (pod identity, IPs, runtime annotations, netns fd)
//	agent  -> plugin  decision (none / ambient / sidecar, and the ruleset
//	                            encoded for the kernel: a Batch, with the
//	                            netlink sockets to write it on)
//	agent  -> plugin  done     (the agent's part in place: ztunnel, host
//	                            probe set, record) or error
//	plugin -> agent   outcome  (batch programmed, or why not; the call's logs)
//
// A pod outside the mesh ends after the decision. While the plugin
// programs, the agent does its own part of the enrolment and answers done
// without waiting for the outcome, which the plugin sends last, once it
// has read done: the two cross, so neither side waits for the other to
// wake up. A failure on either side makes the agent undo the enrolment.
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
	// takes it, for the plugin to write into the pod's netns as it is. It
	// travels as raw bytes after the JSON object, not inside it (Encode).
	Batch *nlsend.Batch `json:"-"`
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
	// Deadline: add and del, when the plugin stops waiting (Unix
	// nanoseconds). The agent answers before it, so that an error names
	// the slowest party rather than the plugin's own timeout.
	Deadline int64 `json:"deadline,omitempty"`
}

// PluginTimeout bounds the plugin's whole conversation with the agent.
// Timeouts nest so that every error names the slowest party: ztunnel's
// ack (package zds) ends before the agent's answer is due, which is
// before the plugin's deadline, which is well inside the runtime's
// (kubelet's runtime-request-timeout, 2 min; containerd sets none).
const PluginTimeout = 5 * time.Second

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
	// IPs are the sandbox interface's addresses in CIDR notation, as the
	// primary's result gives them: text, so that the plugin, which links
	// this package, does not link net/netip (its init costs every exec
	// about 6 page faults). The agent parses them.
	IPs []string `json:"ips,omitempty"`
	// Netns is CNI_NETNS: the agent keeps it to find the netns again after
	// its own restart (it uses the descriptor, not the path, otherwise).
	Netns string `json:"netns,omitempty"`
	// No annotations: the agent decides from its own pod store, and a pod
	// may carry 256 KiB of them, four times a message's limit.
}

// Key names the pod as Kubernetes does.
func (p *Pod) Key() string { return p.Namespace + "/" + p.Name }

// Verdict is the agent's decision as the plugin gets it: the mode and why.
// What the ruleset is made of stays in the agent; the plugin gets it
// encoded (Message.Batch).
type Verdict struct {
	Mode Mode `json:"mode"`
	// Reason is a short human explanation, logged by both sides.
	Reason string `json:"reason,omitempty"`
	// Programmed: the agent wrote the ruleset itself, through the pod's
	// netns it holds, because its batch is too large for one message (a
	// sidecar with thousands of ranges); the plugin has nothing to program.
	Programmed bool `json:"programmed,omitempty"`
}

// envelope is a Message as it goes on the wire: a batch is named in the
// JSON by the lengths of its parts, and its bytes follow the object.
type envelope struct {
	*Message
	Batch *batchLen `json:"batch,omitempty"`
}

// batchLen gives the length of each part of a batch in a message's tail,
// which holds them in this order.
type batchLen struct {
	Tables  int `json:"tables"`
	Replace int `json:"replace,omitempty"`
	Routes  int `json:"routes,omitempty"`
}

// tailMark ends the JSON object of a message that carries a tail. JSON
// text never holds a raw NUL, so the first one is where the tail begins.
const tailMark = 0

// Encode marshals m, refusing what the peer would refuse. A batch goes
// after the object, a NUL between them: 10 KiB of rules would take 14 as
// base64 text, and the plugin, a fresh process, would pay the page faults
// of decoding it.
func Encode(m *Message) ([]byte, error) {
	env := envelope{Message: m}
	if m.Batch != nil {
		env.Batch = &batchLen{Tables: len(m.Batch.Tables), Replace: len(m.Batch.Replace), Routes: len(m.Batch.Routes)}
	}
	b, err := json.Marshal(&env)
	if err != nil {
		return nil, err
	}
	if m.Batch != nil {
		b = append(b, tailMark)
		b = append(append(append(b, m.Batch.Tables...), m.Batch.Replace...), m.Batch.Routes...)
	}
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("%s message of %d bytes exceeds the %d-byte limit", m.Kind, len(b), MaxMessage)
	}
	return b, nil
}

// splitTail cuts a message's tail into the batch its lengths name: the
// parts must fill it exactly.
func splitTail(l *batchLen, tail []byte, hasTail bool) (*nlsend.Batch, error) {
	switch {
	case l == nil && !hasTail:
		return nil, nil
	case l == nil:
		return nil, errors.New("decoding message: data after the object names no batch")
	case !hasTail:
		return nil, errors.New("decoding message: the batch it names is missing")
	case !within(l.Tables, len(tail)) || !within(l.Replace, len(tail)) || !within(l.Routes, len(tail)) || l.Tables+l.Replace+l.Routes != len(tail):
		return nil, fmt.Errorf("decoding message: batch lengths %d+%d+%d do not fill its %d bytes", l.Tables, l.Replace, l.Routes, len(tail))
	}
	b := &nlsend.Batch{Tables: tail[:l.Tables:l.Tables]}
	if rest := tail[l.Tables:]; l.Replace > 0 {
		b.Replace = rest[:l.Replace:l.Replace]
	}
	if l.Routes > 0 {
		b.Routes = tail[len(tail)-l.Routes:]
	}
	return b, nil
}

func within(n, max int) bool { return n >= 0 && n <= max }

// Decode parses one message and checks that the fields its kind needs are
// there, so handlers never see a half-formed message.
func Decode(b []byte) (*Message, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("message of %d bytes exceeds the %d-byte limit", len(b), MaxMessage)
	}
	obj, tail, hasTail := bytes.Cut(b, []byte{tailMark})
	if len(bytes.TrimSpace(obj)) == 0 {
		return nil, errors.New("decoding message: no JSON object") // not the decoder's io.EOF: the peer did not close
	}
	d := json.NewDecoder(bytes.NewReader(obj))
	m := &Message{}
	env := envelope{Message: m}
	if err := d.Decode(&env); err != nil {
		return nil, fmt.Errorf("decoding message: %w", err)
	}
	if len(bytes.TrimSpace(obj[d.InputOffset():])) > 0 {
		return nil, errors.New("decoding message: trailing data after the object")
	}
	var err error
	if m.Batch, err = splitTail(env.Batch, tail, hasTail); err != nil {
		return nil, err
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
