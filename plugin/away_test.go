package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// The plugin with its agent away (no socket): the policy snapshot decides,
// DEL removes the rules itself and leaves a mark for the agent. The kernel
// is a fake that records what it was asked; the netns is a plain file.

type fakeKernel struct{ calls []string }

func (k *fakeKernel) Program(netns int, b *nlsend.Batch, socks []int) error {
	k.calls = append(k.calls, "program")
	return nil
}

func (k *fakeKernel) Remove(netns int, r *nlsend.Removal) error {
	k.calls = append(k.calls, "remove "+string(bytes.Join(r.Tables, []byte(","))))
	return nil
}

type away struct {
	t      *testing.T
	run    string
	netns  string
	kernel *fakeKernel
	p      *Plugin
}

func newAway(t *testing.T, pol *wire.Policy) *away {
	t.Helper()
	a := &away{t: t, run: t.TempDir(), kernel: &fakeKernel{}}
	a.netns = filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(a.netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(a.run, wire.RecordsDir), 0o700); err != nil {
		t.Fatal(err)
	}
	if pol != nil {
		b, _ := json.Marshal(pol)
		if err := os.WriteFile(filepath.Join(a.run, wire.PolicyName), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	a.p = &Plugin{DialTimeout: 100 * time.Millisecond, Timeout: time.Second, Kernel: a.kernel}
	return a
}

func (a *away) args(cmd, pod string) *Args {
	ns, name, _ := strings.Cut(pod, "/")
	stdin := `{"cniVersion":"1.0.0","name":"n","type":"nftcni","cni_agent_run_dir":"` + a.run + `","prevResult":` + prev + `}`
	return &Args{Command: cmd, ContainerID: "c1", Netns: a.netns, IfName: "eth0", StdinData: []byte(stdin),
		Args: "K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=u1"}
}

var cleanup = &nlsend.Removal{Tables: [][]byte{[]byte("cleanup-batch")}}

func TestDelWithTheAgentAwayRemovesTheRules(t *testing.T) {
	a := newAway(t, &wire.Policy{EnrolledNamespaces: []string{"mesh"}, Cleanup: cleanup})
	if err := a.p.Del(a.args("DEL", "mesh/p")); err != nil {
		t.Fatalf("DEL with the agent away: %v", err)
	}
	if want := []string{"remove cleanup-batch"}; !reflect.DeepEqual(a.kernel.calls, want) {
		t.Errorf("kernel calls %v, want %v", a.kernel.calls, want)
	}
	mark := wire.TombstonePath(a.run, wire.Attachment{ContainerID: "c1", IfName: "eth0"})
	if _, err := os.Stat(mark); err != nil {
		t.Errorf("no mark for the agent: %v", err)
	}

	// No snapshot: no agent ever ran, so nothing of ours is there.
	b := newAway(t, nil)
	if err := b.p.Del(b.args("DEL", "mesh/p")); err != nil || len(b.kernel.calls) != 0 {
		t.Errorf("DEL without a snapshot: %v, kernel calls %v", err, b.kernel.calls)
	}
	// A netns already gone: DEL still succeeds.
	c := newAway(t, &wire.Policy{Cleanup: cleanup})
	os.Remove(c.netns)
	if err := c.p.Del(c.args("DEL", "mesh/p")); err != nil || len(c.kernel.calls) != 0 {
		t.Errorf("DEL of a gone netns: %v, kernel calls %v", err, c.kernel.calls)
	}
}

func TestAddWithTheAgentAwayFollowsTheSnapshot(t *testing.T) {
	a := newAway(t, &wire.Policy{EnrolledNamespaces: []string{"mesh"}, Pods: map[string]wire.Mode{"mesh/out": wire.ModeNone}})
	var out bytes.Buffer
	err := a.p.Add(a.args("ADD", "mesh/p"), &out)
	var cerr *Error
	if !errors.As(err, &cerr) || cerr.Code != ErrTryAgainLater || !strings.Contains(err.Error(), "must be enrolled") {
		t.Errorf("ADD of a pod the snapshot enrols, agent away: %v, want try-again-later", err)
	}
	out.Reset()
	if err := a.p.Add(a.args("ADD", "mesh/out"), &out); err != nil || out.String() != prev+"\n" {
		t.Errorf("ADD of a pod the snapshot leaves out: %v, result %q", err, out.String())
	}
	out.Reset()
	if err := a.p.Add(a.args("ADD", "plain/p"), &out); err != nil || out.String() != prev+"\n" {
		t.Errorf("ADD in a namespace the snapshot does not enrol: %v, result %q", err, out.String())
	}
	if len(a.kernel.calls) != 0 {
		t.Errorf("the kernel was asked %v with the agent away", a.kernel.calls)
	}

	// No snapshot at all: nothing says which pods are meshed; refused.
	b := newAway(t, nil)
	if err := b.p.Add(b.args("ADD", "plain/p"), &out); !errors.As(err, &cerr) || cerr.Code != ErrTryAgainLater {
		t.Errorf("ADD without a snapshot or an agent: %v, want try-again-later", err)
	}
}

// A pod that must wait for the agent waits in its ADD, up to AgentWait:
// an agent back within it (after a reboot, an upgrade) starts the pod at
// once, rather than at the runtime's next retry.
func TestAddWaitsForTheAgent(t *testing.T) {
	a := newAway(t, &wire.Policy{EnrolledNamespaces: []string{"mesh"}})
	a.p.AgentWait = 5 * time.Second
	const back = 600 * time.Millisecond
	time.AfterFunc(back, func() { answeringAgent(t, a.run) })
	var out bytes.Buffer
	start := time.Now()
	if err := a.p.Add(a.args("ADD", "mesh/p"), &out); err != nil || out.String() != prev+"\n" {
		t.Fatalf("ADD with the agent back after %v: %v, result %q", back, err, out.String())
	}
	if took := time.Since(start); took < back || took > back+time.Second {
		t.Errorf("the ADD took %v with the agent back after %v", took, back)
	}

	// An agent that does not come back: the ADD fails as before, after
	// AgentWait, and says how long it waited.
	b := newAway(t, &wire.Policy{EnrolledNamespaces: []string{"mesh"}})
	b.p.AgentWait = time.Second
	start = time.Now()
	err := b.p.Add(b.args("ADD", "mesh/p"), &out)
	var cerr *Error
	if !errors.As(err, &cerr) || cerr.Code != ErrTryAgainLater || !strings.Contains(cerr.Details, "waited") {
		t.Errorf("ADD with no agent: %v, want try-again-later saying it waited", err)
	}
	if took := time.Since(start); took < 700*time.Millisecond || took > 2*time.Second {
		t.Errorf("the ADD gave up after %v, AgentWait 1 s", took)
	}

	// The entry's agent_wait_seconds overrides the plugin's wait.
	c := newAway(t, &wire.Policy{EnrolledNamespaces: []string{"mesh"}})
	c.p.AgentWait = 5 * time.Second
	args := c.args("ADD", "mesh/p")
	args.StdinData = bytes.Replace(args.StdinData, []byte(`"type":"nftcni",`), []byte(`"type":"nftcni","agent_wait_seconds":0.5,`), 1)
	start = time.Now()
	if err := c.p.Add(args, &out); err == nil || time.Since(start) > 2*time.Second {
		t.Errorf("ADD with agent_wait_seconds 0.5 and no agent: %v after %v", err, time.Since(start))
	}

	// A pod the snapshot lets through does not wait.
	start = time.Now()
	out.Reset()
	if err := b.p.Add(b.args("ADD", "plain/p"), &out); err != nil || time.Since(start) > 500*time.Millisecond {
		t.Errorf("ADD outside the mesh with no agent: %v after %v", err, time.Since(start))
	}
}

// An agent that refuses an ADD for now (no ztunnel connected yet:
// wire.Message.Retry) is asked again within the ADD's wait for the agent,
// ztunnelPoll apart, and the pod starts once it answers; past the wait the
// ADD fails with try-again-later, saying how long it asked. A refusal
// that is not for now, or a wait of 0, fails at once. Mutation: an
// askAgain that never asks again fails the first case.
func TestAddAsksAgainWhileNoZtunnel(t *testing.T) {
	pol := &wire.Policy{EnrolledNamespaces: []string{"mesh"}}
	notYet := &wire.Message{Kind: wire.KindError, Error: "pod mesh/p: no ztunnel connection (for now)", Retry: true}
	none := &wire.Message{Kind: wire.KindDecision, Decision: &wire.Verdict{Mode: wire.ModeNone, Reason: "test"}}
	var out bytes.Buffer
	for _, tc := range []struct {
		name     string
		wait     time.Duration
		entry    string // added to the conflist entry
		refusals int    // answered with the refusal, then none
		retry    bool   // the refusal is for now
		asks     int
		ok       bool
		min, max time.Duration
	}{
		{name: "ztunnel back", wait: 5 * time.Second, refusals: 3, retry: true, asks: 4, ok: true, min: 3 * ztunnelPoll, max: 3*ztunnelPoll + time.Second},
		{name: "ztunnel never back", wait: 1200 * time.Millisecond, refusals: 100, retry: true, asks: 3, min: 2 * ztunnelPoll, max: 2 * time.Second},
		{name: "not for now", wait: 5 * time.Second, refusals: 100, asks: 1, max: 300 * time.Millisecond},
		{name: "agent_wait_seconds 0", wait: 5 * time.Second, entry: `"agent_wait_seconds":0,`, refusals: 100, retry: true, asks: 1, max: 300 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAway(t, pol)
			a.p.AgentWait = tc.wait
			var asks atomic.Int32
			servingAgent(t, a.run, func() *wire.Message {
				if int(asks.Add(1)) <= tc.refusals {
					m := *notYet
					m.Retry = tc.retry
					return &m
				}
				return none
			})
			args := a.args("ADD", "mesh/p")
			args.StdinData = bytes.Replace(args.StdinData, []byte(`"type":"nftcni",`), []byte(`"type":"nftcni",`+tc.entry), 1)
			start := time.Now()
			err := a.p.Add(args, &out)
			took := time.Since(start)
			var cerr *Error
			switch {
			case tc.ok && err != nil:
				t.Errorf("ADD: %v, want the pod started once the agent answers", err)
			case !tc.ok && tc.retry && tc.entry == "" && (!errors.As(err, &cerr) || cerr.Code != ErrTryAgainLater || !strings.Contains(cerr.Details, "asked")):
				t.Errorf("ADD: %v, want try-again-later saying how long it asked", err)
			case !tc.ok && err == nil:
				t.Error("ADD succeeded, want the refusal")
			}
			if got := int(asks.Load()); got != tc.asks {
				t.Errorf("the agent was asked %d times, want %d", got, tc.asks)
			}
			if took < tc.min || took > tc.max {
				t.Errorf("the ADD took %v, want %v to %v", took, tc.min, tc.max)
			}
		})
	}
}

// answeringAgent serves the agent's socket, deciding every ADD "not
// enrolled" (what the agent answers a pod it leaves out).
func answeringAgent(t *testing.T, runDir string) {
	servingAgent(t, runDir, func() *wire.Message {
		return &wire.Message{Kind: wire.KindDecision, Decision: &wire.Verdict{Mode: wire.ModeNone, Reason: "test"}}
	})
}

// servingAgent serves the agent's socket, answering each conversation's
// first message with answer().
func servingAgent(t *testing.T, runDir string, answer func() *wire.Message) {
	conversingAgent(t, runDir, func(c *wire.Conn, _ <-chan struct{}) { _ = c.Send(answer(), nil) })
}

// A failed enrolment's error waits for the agent's undo: with
// ConfirmsUndo the plugin returns once the agent says the enrolment is
// undone (its rules included), so that "removed again" holds when the
// runtime reads it; an older agent, which never says so, costs nothing
// extra; one that confirms nothing by the deadline is named. Mutation: a
// plugin that returns once its outcome is sent fails "confirming agent".
func TestFailedAddWaitsForTheUndo(t *testing.T) {
	const undo = 200 * time.Millisecond
	for _, tc := range []struct {
		name     string
		confirms bool // the decision says ConfirmsUndo
		send     bool // the agent sends done after its undo
		min, max time.Duration
		want     string
	}{
		{name: "confirming agent", confirms: true, send: true, min: undo, max: undo + 300*time.Millisecond, want: "(removed again)"},
		{name: "older agent", max: undo / 2, want: "(removed again)"},
		{name: "confirmation never comes", confirms: true, min: 900 * time.Millisecond, max: 1500 * time.Millisecond, want: "did not confirm their removal"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAway(t, nil)
			conversingAgent(t, a.run, func(c *wire.Conn, stop <-chan struct{}) {
				d := &wire.Message{Kind: wire.KindDecision, Decision: &wire.Verdict{Mode: wire.ModeAmbient, ConfirmsUndo: tc.confirms},
					Batch: &nlsend.Batch{Tables: []byte{1}}}
				if c.Send(d, nil) != nil || c.Send(&wire.Message{Kind: wire.KindError, Error: "ztunnel refused"}, nil) != nil {
					return
				}
				if m, f, err := c.Recv(); err != nil || m.Kind != wire.KindOutcome {
					t.Errorf("the agent got %v, %v, want the outcome", m, err)
					return
				} else if f != nil {
					f.Close()
				}
				time.Sleep(undo)
				if tc.send {
					_ = c.Send(&wire.Message{Kind: wire.KindDone}, nil)
				}
				<-stop // holds the connection, as the agent draining logs does
			})
			start := time.Now()
			err := a.p.Add(a.args("ADD", "mesh/p"), io.Discard)
			took := time.Since(start)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "ztunnel refused") {
				t.Errorf("ADD: %v, want the agent's error with %q", err, tc.want)
			}
			if took < tc.min || took > tc.max {
				t.Errorf("the ADD returned after %v, want %v to %v", took, tc.min, tc.max)
			}
			if !reflect.DeepEqual(a.kernel.calls, []string{"program"}) {
				t.Errorf("kernel calls %v, want the program alone (the undo is the agent's)", a.kernel.calls)
			}
		})
	}
}

// conversingAgent serves the agent's socket, one conversation at a time:
// the first message is read, and talk has the rest, until stop closes at
// the test's end. It may start after the test's own goroutine (an agent
// coming back): an error is t.Error.
func conversingAgent(t *testing.T, runDir string, talk func(c *wire.Conn, stop <-chan struct{})) {
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: filepath.Join(runDir, wire.SocketName), Net: "unixpacket"})
	if err != nil {
		t.Error(err)
		return
	}
	done, stop := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(stop); l.Close(); <-done })
	go func() {
		defer close(done)
		for {
			uc, err := l.AcceptUnix()
			if err != nil {
				return
			}
			c, err := wire.NewConn(uc)
			if err != nil {
				uc.Close()
				return
			}
			if _, f, err := c.Recv(); err == nil {
				if f != nil {
					f.Close()
				}
				talk(c, stop)
			}
			c.Close()
		}
	}()
}
