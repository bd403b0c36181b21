package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/unixsock"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// A test binary run with NFTCNI_TEST_DIAL=<socket> dials it and reports:
// the non-root client of TestNonRootPeerRefused.
func TestMain(m *testing.M) {
	if path := os.Getenv("NFTCNI_TEST_DIAL"); path != "" {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
		if err != nil {
			fmt.Println("dial:", err)
			os.Exit(0)
		}
		c, err := wire.NewConn(uc)
		if err != nil {
			fmt.Println("conn:", err)
			os.Exit(1)
		}
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if err := c.Send(&wire.Message{Kind: wire.KindStatus}, nil); err != nil {
			fmt.Println("send:", err)
			os.Exit(0)
		}
		m, _, err := c.Recv()
		fmt.Printf("reply: %v %v\n", m, err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// fake is a Handler that records what reached it.
type fake struct {
	mu        sync.Mutex
	decision  *wire.Verdict
	decideErr error
	// outcomes are what plugin.Outcome returned, one per enrolled ADD.
	outcomes []error
	// agentErr fails the agent's own part of the enrolment (ztunnel
	// refused the pod): the plugin's answer after its decision.
	agentErr error
	deleted  []string
	gc       [][]wire.Attachment
	// delDeadline is the deadline of the last Del's context.
	delDeadline time.Time
	// addsOver counts Adds returned: an enrolment's undo is over.
	addsOver atomic.Int32
}

var testBatch = &nft.Batch{Batch: nlsend.Batch{Tables: []byte("batch")}}

func (f *fake) Add(_ context.Context, _ *wire.Pod, _ *os.File, plugin Plugin) error {
	defer f.addsOver.Add(1)
	if f.decideErr != nil {
		return f.decideErr
	}
	err := plugin.Decide(f.decision, testBatch)
	if f.decision.Mode == wire.ModeNone {
		return nil
	}
	if err == nil {
		plugin.Ready(f.agentErr)
		_, err = plugin.Outcome()
	}
	f.mu.Lock()
	f.outcomes = append(f.outcomes, err)
	f.mu.Unlock()
	return errors.Join(err, f.agentErr)
}
func (f *fake) Del(ctx context.Context, p *wire.Pod, _ *os.File) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, p.Key())
	f.delDeadline, _ = ctx.Deadline()
	return nil
}
func (f *fake) Check(context.Context, *wire.Pod, *os.File) error { return nil }
func (f *fake) GC(_ context.Context, v []wire.Attachment) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gc = append(f.gc, v)
	return nil
}
func (f *fake) Ready() error { return nil }

// seenOutcomes is what the handler saw of the plugin's outcomes so far.
func (f *fake) seenOutcomes() []error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]error(nil), f.outcomes...)
}

func (f *fake) Inspect(p *wire.Pod) *wire.Inspect { return &wire.Inspect{ZDS: "zds state of " + p.UID} }

type harness struct {
	path    string
	srv     *Server
	metrics *Metrics
	log     *strings.Builder
	logMu   *sync.Mutex
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func serve(t *testing.T, h Handler, dir string) *harness {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	hs := &harness{path: filepath.Join(dir, "run", wire.SocketName), log: &strings.Builder{}, logMu: &sync.Mutex{}}
	l, err := Listen(hs.path)
	if err != nil {
		t.Fatal(err)
	}
	hs.metrics = NewMetrics(nil)
	hs.srv = NewServer(h, slog.New(slog.NewTextHandler(lockedWriter{hs.logMu, hs.log}, nil)), hs.metrics)
	hs.srv.Timeout = 500 * time.Millisecond
	if uid := os.Geteuid(); uid != 0 {
		// Unprivileged: serve our own uid; the refusal of another uid is
		// tested as root (TestNonRootPeerRefused).
		hs.srv.CheckPeer = func(uc syscall.Conn) error { return unixsock.RequireUID(uc, uint32(uid)) }
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = hs.srv.Serve(ctx, l); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return hs
}

func (hs *harness) dial(t *testing.T) (*wire.Conn, *net.UnixConn) {
	t.Helper()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: hs.path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { uc.Close() })
	c, err := wire.NewConn(uc)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	return c, uc
}

func fdCount(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func pod() *wire.Pod {
	return &wire.Pod{Namespace: "ns", Name: "p", Attachment: wire.Attachment{ContainerID: "c1", IfName: "eth0"}}
}

func TestSocketIsRootOnly(t *testing.T) {
	hs := serve(t, &fake{}, "")
	st, err := os.Stat(hs.path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 || st.Mode().Type() != os.ModeSocket {
		t.Errorf("socket mode %v, want 0600 socket", st.Mode())
	}
}

func TestListenRefusesToReplaceNonSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "plugin.sock")
	if err := os.WriteFile(path, []byte("not a socket"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(path); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("Listen over a regular file: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "not a socket" {
		t.Error("the file was replaced")
	}
}

// Hostile or broken clients get a clean error or a closed connection; the
// server keeps serving and keeps no descriptor.
func TestBadClients(t *testing.T) {
	f := &fake{decision: &wire.Verdict{Mode: wire.ModeAmbient}}
	hs := serve(t, f, "")
	before := fdCount(t)
	netns, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer netns.Close()

	raw := func(t *testing.T, b []byte, fds ...int) (*wire.Message, error) {
		c, uc := hs.dial(t)
		var oob []byte
		if len(fds) > 0 {
			oob = unix.UnixRights(fds...)
		}
		if _, _, err := uc.WriteMsgUnix(b, oob, nil); err != nil {
			return nil, err
		}
		m, _, err := c.Recv()
		return m, err
	}
	cases := []struct {
		name string
		b    []byte
		fds  []int
		want string
	}{
		{"garbage", []byte("\x00\x01not json"), nil, "decoding message"},
		{"unknown kind", []byte(`{"kind":"reboot"}`), nil, "unknown message kind"},
		{"add without pod", []byte(`{"kind":"add"}`), nil, "without a pod"},
		{"add without netns", mustEncode(t, &wire.Message{Kind: wire.KindAdd, Pod: pod()}), nil, "no netns descriptor"},
		{"too large", make([]byte, wire.MaxMessage+100), nil, "size limit"},
		{"three descriptors", mustEncode(t, &wire.Message{Kind: wire.KindStatus}), []int{int(netns.Fd()), int(netns.Fd()), int(netns.Fd())}, "more than one descriptor"},
		{"outcome first", []byte(`{"kind":"outcome"}`), nil, "cannot start with outcome"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := raw(t, tc.b, tc.fds...)
			if err != nil {
				t.Fatalf("no answer: %v", err)
			}
			if m.Kind != wire.KindError || !strings.Contains(m.Error, tc.want) {
				t.Errorf("answer %+v, want an error containing %q", m, tc.want)
			}
		})
	}
	// A client that connects and says nothing is dropped at the deadline.
	_, uc := hs.dial(t)
	buf := make([]byte, 16)
	_ = uc.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := uc.Read(buf); !errors.Is(err, io.EOF) && n != 0 {
		t.Errorf("silent client: read %d, %v; want the server to close", n, err)
	}
	// A plugin that dies between decision and outcome is reported to the
	// handler as a failure, so nothing is marked enrolled.
	c, _ := hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindAdd, Pod: pod()}, netns); err != nil {
		t.Fatal(err)
	}
	m, sock, err := c.Recv() // with the pod's netlink socket
	if err != nil || m.Kind != wire.KindDecision {
		t.Fatalf("decision: %v %v", m, err)
	}
	if sock != nil {
		sock.Close()
	}
	c.Close()
	waitUntil(t, func() bool { f.mu.Lock(); defer f.mu.Unlock(); return len(f.outcomes) == 1 })
	if f.seenOutcomes()[0] == nil {
		t.Error("a plugin that went away was reported as enrolled")
	}
	// Still serving, and every descriptor it received is closed.
	c, _ = hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindStatus}, nil); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDone {
		t.Fatalf("status after the bad clients: %v %v", m, err)
	}
	waitUntil(t, func() bool { return fdCount(t) <= before+3 }) // +netns, +2 open test conns
	if got := fdCount(t); got > before+3 {
		t.Errorf("descriptors: %d before, %d after", before, got)
	}
}

func mustEncode(t *testing.T, m *wire.Message) []byte {
	b, err := wire.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in time")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The full ADD conversation: two round trips, the batch with the decision,
// the plugin's log records riding its outcome and re-emitted in the
// agent's log at their level.
func TestAddConversationAndLogs(t *testing.T) {
	f := &fake{decision: &wire.Verdict{Mode: wire.ModeAmbient}}
	hs := serve(t, f, "")
	netns, _ := os.Open("/proc/self/ns/net")
	defer netns.Close()
	c, uc := hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindAdd, Pod: pod()}, netns); err != nil {
		t.Fatal(err)
	}
	m, sock, err := c.Recv()
	if err != nil || m.Kind != wire.KindDecision || m.Decision.Mode != wire.ModeAmbient || string(m.Batch.Tables) != "batch" || !m.Decision.ConfirmsUndo {
		t.Fatalf("decision: %+v %v, want ambient with its batch, confirming an undo", m, err)
	}
	// The batch's netlink socket, made in the pod's netns (entering one
	// takes root; without it the plugin makes its own).
	if os.Geteuid() == 0 {
		if sock == nil {
			t.Fatal("the decision came without the pod's netlink socket")
		}
		if err := nlsend.CheckSockets(int(netns.Fd()), []int{int(sock.Fd())}, nlsend.Protos(m.Batch)); err != nil {
			t.Errorf("the socket handed over: %v", err)
		}
	}
	if sock != nil {
		sock.Close()
	}
	// The agent's done does not wait for the outcome: the two cross, so
	// a plugin whose rules took longer than ztunnel's ack finds its
	// answer waiting once it has sent its outcome.
	if m, _, err = c.Recv(); err != nil || m.Kind != wire.KindDone {
		t.Fatalf("done before the outcome: %+v %v", m, err)
	}
	rec, _ := json.Marshal(map[string]any{"level": "WARN", "msg": "from the plugin", "pod": "ns/p"})
	out := &wire.Message{Kind: wire.KindOutcome, Logs: []json.RawMessage{rec, json.RawMessage(`["not a record"]`)}}
	if err := c.Send(out, nil); err != nil {
		t.Fatal(err)
	}
	// Success has no fifth message: only a failure's undo is confirmed.
	_ = uc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if m, _, err := c.Recv(); err == nil {
		t.Errorf("a message after a successful outcome: %+v", m)
	}
	c.Close()
	waitUntil(t, func() bool {
		hs.logMu.Lock()
		defer hs.logMu.Unlock()
		return strings.Contains(hs.log.String(), `level=WARN msg="from the plugin" source=plugin pod=ns/p`)
	})
	waitUntil(t, func() bool { return len(f.seenOutcomes()) == 1 })
	if got := f.seenOutcomes(); got[0] != nil {
		t.Errorf("handler saw %v, want one successful outcome", got)
	}
	if got := testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("add", "success")); got != 1 {
		t.Errorf("add success counted %v", got)
	}
}

// A pod outside the mesh gets its decision and nothing after it.
func TestAddOutsideTheMeshEndsWithTheDecision(t *testing.T) {
	f := &fake{decision: &wire.Verdict{Mode: wire.ModeNone, Reason: "no selector"}}
	hs := serve(t, f, "")
	netns, _ := os.Open("/proc/self/ns/net")
	defer netns.Close()
	c, uc := hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindAdd, Pod: pod()}, netns); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDecision || m.Batch != nil {
		t.Fatalf("decision: %+v %v", m, err)
	}
	_ = uc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if m, _, err := c.Recv(); err == nil {
		t.Errorf("a second answer after a none decision: %+v", m)
	}
}

// A failure of the agent's own part (ztunnel refused the pod) is the
// plugin's answer after its outcome, and the handler still gets the
// outcome (to undo the rules the plugin programmed). Once the handler has
// returned, its undo over, the plugin gets done, which its error waits
// for (wire.Verdict.ConfirmsUndo).
func TestAgentsFailureFailsTheAdd(t *testing.T) {
	f := &fake{decision: &wire.Verdict{Mode: wire.ModeAmbient},
		agentErr: errors.New("ztunnel refused: cannot enter netns")}
	hs := serve(t, f, "")
	netns, _ := os.Open("/proc/self/ns/net")
	defer netns.Close()
	c, _ := hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindAdd, Pod: pod()}, netns); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDecision {
		t.Fatalf("decision: %+v %v", m, err)
	}
	if err := c.Send(&wire.Message{Kind: wire.KindOutcome}, nil); err != nil {
		t.Fatal(err)
	}
	m, _, err := c.Recv()
	if err != nil || m.Kind != wire.KindError || !strings.Contains(m.Error, "cannot enter netns") {
		t.Fatalf("answer: %+v %v, want the handler's error", m, err)
	}
	waitUntil(t, func() bool { return testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("add", "failure")) == 1 })
	if got := f.seenOutcomes(); len(got) != 1 {
		t.Errorf("handler saw %d outcomes, want the one the plugin sent", len(got))
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDone {
		t.Fatalf("after the outcome: %+v %v, want done, the undo over", m, err)
	}
	if f.addsOver.Load() != 1 {
		t.Error("done came before the handler's Add returned")
	}
}

// A refusal for now (the handler's error wraps ErrTryAgain, nothing
// decided) reaches the plugin marked to ask again, and is counted as
// result "retry", not as a failed ADD. Any other refusal is neither.
func TestRefusalForNowTellsThePluginToAskAgain(t *testing.T) {
	for _, tc := range []struct {
		err   error
		retry bool
	}{
		{fmt.Errorf("pod ns/p: no ztunnel connection (%w)", ErrTryAgain), true},
		{errors.New("pod ns/p is not in the agent's cache"), false},
	} {
		hs := serve(t, &fake{decideErr: tc.err}, "")
		netns, _ := os.Open("/proc/self/ns/net")
		defer netns.Close()
		c, _ := hs.dial(t)
		if err := c.Send(&wire.Message{Kind: wire.KindAdd, Pod: pod()}, netns); err != nil {
			t.Fatal(err)
		}
		m, _, err := c.Recv()
		if err != nil || m.Kind != wire.KindError || m.Error != tc.err.Error() || m.Retry != tc.retry {
			t.Errorf("answer to %v: %+v %v, want the error with retry %v", tc.err, m, err, tc.retry)
		}
		if !tc.retry {
			waitUntil(t, func() bool { return testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("add", "failure")) == 1 })
		} else {
			waitUntil(t, func() bool { return testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("add", "retry")) == 1 })
			if got := testutil.ToFloat64(hs.metrics.Requests.WithLabelValues("add", "failure")); got != 0 {
				t.Errorf("a refusal for now counted as %v failed ADDs", got)
			}
		}
	}
}

func TestInspectAnswersWhatTheAgentKnows(t *testing.T) {
	hs := serve(t, &fake{}, "")
	c, _ := hs.dial(t)
	if err := c.Send(&wire.Message{Kind: wire.KindInspect, Pod: &wire.Pod{UID: "uid-1"}}, nil); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDone || m.Inspect == nil || m.Inspect.ZDS != "zds state of uid-1" {
		t.Fatalf("inspect: %+v %v", m, err)
	}
}

// The agent's work for a message ends before the plugin stops waiting:
// the handler's context expires a margin before the plugin's deadline,
// however long the server would give the connection.
func TestHandlerAnswersBeforeThePluginsDeadline(t *testing.T) {
	f := &fake{}
	hs := serve(t, f, "")
	hs.srv.Timeout = time.Minute
	c, _ := hs.dial(t)
	plugin := time.Now().Add(2 * time.Second)
	if err := c.Send(&wire.Message{Kind: wire.KindDel, Pod: pod(), Deadline: plugin.UnixNano()}, nil); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.Recv(); err != nil || m.Kind != wire.KindDone {
		t.Fatalf("answer: %+v %v", m, err)
	}
	f.mu.Lock()
	got := f.delDeadline
	f.mu.Unlock()
	if got.IsZero() || !got.Before(plugin) || got.Before(plugin.Add(-time.Second)) {
		t.Errorf("the handler's deadline is %v, the plugin's %v: want it shortly before", got, plugin)
	}
}
