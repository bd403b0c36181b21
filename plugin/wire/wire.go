// Package wire is the protocol between the nftcni plugin and the agent: the
// messages, their encoding, and the policy snapshot the plugin reads when
// the agent is down. Both binaries import it; it imports nothing of either.
//
// Transport: a unix SOCK_SEQPACKET socket, so each message is one datagram
// with its boundaries kept and a netns fd rides along in SCM_RIGHTS. A
// message is one JSON object of at most MaxMessage bytes (codec.go).
//
// One pod ADD is one connection and, for an enrolled pod, four messages
// (five after a failure):
//
//	plugin -> agent   add      (pod identity, IPs, runtime annotations, netns fd)
//	agent  -> plugin  decision (none / ambient / sidecar, and the ruleset
//	                            encoded for the kernel: a Batch, with the
//	                            netlink sockets to write it on)
//	agent  -> plugin  done     (the agent's part in place: ztunnel, host
//	                            probe set, record) or error
//	plugin -> agent   outcome  (batch programmed, or why not; the call's logs)
//	agent  -> plugin  done     (only after a failure: the enrolment is undone)
//
// A pod outside the mesh ends after the decision. While the plugin
// programs, the agent does its own part of the enrolment and answers done
// without waiting for the outcome, which the plugin sends last, once it
// has read done: the two cross, so neither side waits for the other to
// wake up. A failure on either side makes the agent undo the enrolment,
// and the plugin waits for that (Verdict.ConfirmsUndo): the success path
// has no fifth message.
//
// DEL, CHECK (with the netns fd), STATUS, GC and INSPECT are one request
// and one reply each. Log records the plugin has left once its
// conversation is over go in a one-way log message the agent does not
// answer.
package wire

import (
	"encoding/json"
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
	// Retry: error, the refusal is for now (an enrolment while no
	// ztunnel is connected, as after a reboot): the plugin may ask again
	// within its wait for the agent. A plugin that does not know it fails
	// the ADD, as before.
	Retry bool `json:"retry,omitempty"`
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

// DefaultAgentWait is how long the plugin's ADD of a pod that must wait
// for the agent (one to enrol, a sidecar pod, no policy snapshot) waits
// for it when the entry says nothing (agent_wait_seconds): after a reboot
// or an upgrade the agent is back within seconds, and a pod whose ADD
// waits for it starts then, where a failed ADD starts at the kubelet's
// next retry of the sandbox (10 s later, each time). MaxAgentWait keeps
// it well inside the kubelet's runtime request timeout (2 min), which
// covers the whole sandbox.
const (
	DefaultAgentWait = 30 * time.Second
	MaxAgentWait     = 90 * time.Second
)

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
	// ConfirmsUndo: after a failure on either side (its error in place of
	// done, or an outcome with an error), the agent sends done once it has
	// undone the enrolment, rules included; the plugin waits for it, so
	// that its error holds when the runtime gets it. An older agent does
	// not send it, and its plugin does not wait.
	ConfirmsUndo bool `json:"confirms_undo,omitempty"`
}
