// Package events is the agent's side of the plugin protocol (package
// plugin/wire): a root-only unix socket in the run dir that answers the
// plugin's ADD, DEL, CHECK, STATUS and GC, and takes its log records.
//
// Decisions and enrolment bookkeeping come through Handler, so the
// Kubernetes-backed agent, a static pod source and tests plug in the same
// way. The server owns every descriptor it receives and closes it when the
// request ends; a handler that keeps a netns must dup it.
package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/internal/sockfile"
	"github.com/nftcni/nftcni/internal/unixsock"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Handler is what the server needs from the rest of the agent.
type Handler interface {
	// Add runs a pod's ADD. It decides and, for a pod it enrols, drives the
	// enrolment: plugin.Decide once with the decision and the batch the
	// plugin is to program, plugin.Ready once the agent's own part is in
	// place (or failed), then plugin.Outcome. An error before Decide is the
	// answer to the add; one after Ready is the agent's to act on (the
	// plugin has its answer), and Add returns it once the enrolment is
	// undone: the server then tells a plugin that sent its outcome, which
	// waits for that (wire.Verdict.ConfirmsUndo).
	Add(ctx context.Context, pod *wire.Pod, netns *os.File, plugin Plugin) error
	// Del is the pod's DEL: remove the pod's rules through netns (nil
	// when the netns is gone) and release whatever is held for it. An
	// error leaves the removal to the plugin.
	Del(ctx context.Context, pod *wire.Pod, netns *os.File) error
	// Check verifies the ruleset in the netns behind netns against what
	// the pod should have (CHECK).
	Check(ctx context.Context, pod *wire.Pod, netns *os.File) error
	// Inspect says what the agent knows of the pod with pod.UID or, when
	// that is empty, of the pod named pod.Namespace/pod.Name.
	Inspect(pod *wire.Pod) *wire.Inspect
	// GC releases what is held for attachments not in valid.
	GC(ctx context.Context, valid []wire.Attachment) error
	// Ready is nil when ADDs can be served (STATUS).
	Ready() error
}

// Plugin is the plugin's end of an ADD, as Handler.Add sees it.
type Plugin interface {
	// Decide sends the decision and, for an enrolled pod, the batch the
	// plugin is to program.
	Decide(v *wire.Verdict, b *nft.Batch) error
	// Ready gives the plugin its last answer for an enrolled pod: done
	// when the agent's part of the enrolment (ztunnel, probe set, record)
	// is in place, else the error. It does not wait for the outcome: the
	// plugin reads it once its rules are in, then sends its outcome last.
	Ready(err error)
	// Outcome waits for the plugin's outcome of an enrolled pod's
	// decision: nil once the rules are in place, with where the plugin's
	// time went.
	Outcome() (*wire.Timings, error)
}

// Metrics counts plugin requests.
type Metrics struct {
	Requests *prometheus.CounterVec
}

// NewMetrics registers the server's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "istio_cni_plugin_requests_total",
		Help: "Requests from the CNI plugin, by type and result.",
	}, []string{"type", "result"})}
	if reg != nil {
		reg.MustRegister(m.Requests)
	}
	return m
}

// answerMargin is what the agent leaves of the plugin's deadline for its
// answer to arrive and the plugin to act on it (remove the rules of a
// failed ADD).
const answerMargin = 500 * time.Millisecond

// Server answers the plugin.
type Server struct {
	h       Handler
	log     *slog.Logger
	metrics *Metrics
	// Timeout bounds one connection, from accept to close; the plugin's
	// deadline, less answerMargin, bounds the work of its message.
	Timeout time.Duration
	// MaxConns bounds connections served at once; more wait in the backlog.
	MaxConns int
	// CheckPeer vets each connection's credentials: root only
	// (unixsock.RequireRoot), unless a test serves its own uid.
	CheckPeer func(syscall.Conn) error

	wg sync.WaitGroup
}

// NewServer returns a server with production limits.
func NewServer(h Handler, log *slog.Logger, m *Metrics) *Server {
	if m == nil {
		m = NewMetrics(nil)
	}
	return &Server{h: h, log: log, metrics: m, Timeout: 10 * time.Second, MaxConns: 256, CheckPeer: unixsock.RequireRoot}
}

// Listen binds the plugin socket at path, root-only, in a 0750 dir. The
// run dir's lock keeps any other agent off it, so a socket there is an
// earlier agent's; one still served is refused at once all the same.
func Listen(path string) (*net.UnixListener, error) { return sockfile.Listen(path, 0o750, 0) }

// Serve accepts connections until ctx ends, then closes l and waits for
// the connections in flight.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	sem := make(chan struct{}, max(s.MaxConns, 1))
	defer s.wg.Wait()
	for {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		uc, err := l.AcceptUnix()
		if err != nil {
			<-sem
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			s.log.Warn("accept on the plugin socket failed", "err", err)
			time.Sleep(10 * time.Millisecond) // e.g. EMFILE: do not spin
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-sem }()
			s.serveConn(ctx, uc)
		}()
	}
}

func (s *Server) count(kind wire.Kind, result string) {
	s.metrics.Requests.WithLabelValues(string(kind), result).Inc()
}

func (s *Server) serveConn(ctx context.Context, uc *net.UnixConn) {
	defer uc.Close()
	if err := s.CheckPeer(uc); err != nil {
		s.log.Warn("refused a connection on the plugin socket", "err", err)
		s.count("connect", "rejected")
		return
	}
	c, err := wire.NewConn(uc)
	if err != nil {
		s.log.Warn("could not serve a connection on the plugin socket", "err", err)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	_ = c.SetDeadline(time.Now().Add(s.Timeout))
	m, fd, err := c.Recv()
	if fd != nil {
		defer fd.Close()
	}
	if err != nil {
		if !errors.Is(err, io.EOF) {
			s.log.Warn("bad message from a plugin", "err", err)
			s.count("invalid", "failure")
			_ = c.Send(&wire.Message{Kind: wire.KindError, Error: err.Error()}, nil)
		}
		return
	}
	if m.Deadline != 0 {
		// Answer before the plugin stops waiting: whatever the agent waits
		// on (ztunnel's ack) gives up first and is named in the answer.
		var cancelPlugin context.CancelFunc
		ctx, cancelPlugin = context.WithDeadline(ctx, time.Unix(0, m.Deadline).Add(-answerMargin))
		defer cancelPlugin()
	}
	var reply *wire.Message
	switch m.Kind {
	case wire.KindAdd:
		s.add(ctx, c, m.Pod, fd)
		s.drainLogs(ctx, c)
		return
	case wire.KindLog:
		s.pluginLogs(ctx, m.Logs)
		s.drainLogs(ctx, c)
		return
	case wire.KindCheck:
		if fd == nil {
			err = errors.New("check carries no netns descriptor")
		} else {
			err = s.h.Check(ctx, m.Pod, fd)
		}
	case wire.KindDel:
		s.pluginLogs(ctx, m.Logs)
		err = s.h.Del(ctx, m.Pod, fd)
	case wire.KindStatus:
		err = s.h.Ready()
	case wire.KindGC:
		err = s.h.GC(ctx, m.Valid)
	case wire.KindInspect: // Decode made sure it names a pod
		reply = &wire.Message{Kind: wire.KindDone, Inspect: s.h.Inspect(m.Pod)}
	default:
		err = fmt.Errorf("a conversation cannot start with %s", m.Kind)
	}
	s.count(m.Kind, result(err))
	switch {
	case err != nil:
		if m.Kind != wire.KindStatus {
			s.log.Warn("plugin request failed", "type", m.Kind, "pod", podKey(m.Pod), "err", err)
		}
		reply = &wire.Message{Kind: wire.KindError, Error: err.Error()}
	case reply == nil:
		reply = &wire.Message{Kind: wire.KindDone}
	}
	if err := c.Send(reply, nil); err != nil {
		s.log.Debug("could not answer the plugin", "type", m.Kind, "err", err)
		return
	}
	s.drainLogs(ctx, c)
}

func result(err error) string {
	if err != nil {
		return "failure"
	}
	return "success"
}

func podKey(p *wire.Pod) string {
	if p == nil {
		return ""
	}
	return p.Key()
}

// addConv is the plugin's end of one ADD.
type addConv struct {
	s       *Server
	ctx     context.Context
	c       *wire.Conn
	netns   *os.File // the pod's, from the add
	decided bool
	mode    wire.Mode
	ready   bool // the plugin has its answer (done or error)
	outcome bool // the agent has the plugin's outcome: its rules are the undo's to remove
}

// Decide sends the decision. A batch to program goes with a netlink socket
// per protocol it needs, made here in the pod's netns: the plugin is a
// fresh process for every pod, and entering a netns costs a fresh Go
// process a thread of its own and the first use of everything on the way,
// where this process has them warm. A plugin given none makes its own.
// They are made on this goroutine's thread (DialHere): handing the work to
// another goroutine woke a second thread of an agent idle until the add.
func (a *addConv) Decide(v *wire.Verdict, b *nft.Batch) error {
	if a.decided {
		return errors.New("the ADD was decided already")
	}
	a.decided, a.mode = true, v.Mode
	if v.Mode != wire.ModeNone {
		c := *v
		c.ConfirmsUndo = true // add() sends done after a failed enrolment's undo
		v = &c
	}
	m := &wire.Message{Kind: wire.KindDecision, Decision: v}
	var socks []int
	if v.Mode != wire.ModeNone && b != nil {
		m.Batch = &b.Batch
		var err error
		if socks, err = nlsend.DialHere(int(a.netns.Fd()), nlsend.Protos(&b.Batch)...); err != nil {
			a.s.log.Debug("could not make the pod's netlink sockets; the plugin makes its own", "err", err)
		}
		defer nlsend.CloseAll(socks)
	}
	if err := a.c.SendWith(m, socks); err != nil {
		return fmt.Errorf("plugin went away before the decision: %w", err)
	}
	return nil
}

// Ready sends done, or the error.
func (a *addConv) Ready(err error) {
	if a.ready {
		return
	}
	a.ready = true
	m := &wire.Message{Kind: wire.KindDone}
	if err != nil {
		m = &wire.Message{Kind: wire.KindError, Error: err.Error()}
	}
	if serr := a.c.Send(m, nil); serr != nil {
		a.s.log.Debug("could not give the plugin its answer", "err", serr) // its outcome, or its absence, says the rest
	}
}

// Outcome waits for the outcome, whose logs join the agent's.
func (a *addConv) Outcome() (*wire.Timings, error) {
	if !a.decided || a.mode == wire.ModeNone {
		return nil, errors.New("no enrolment decided")
	}
	out, fd, err := a.c.Recv()
	if fd != nil {
		fd.Close()
	}
	switch {
	case err != nil:
		return nil, fmt.Errorf("plugin went away before reporting its outcome: %w", err)
	case out.Kind != wire.KindOutcome:
		return nil, fmt.Errorf("plugin sent %s, want outcome", out.Kind)
	}
	a.outcome = true
	a.s.pluginLogs(a.ctx, out.Logs)
	if out.Error != "" {
		return out.Timings, fmt.Errorf("plugin could not program the %s ruleset: %w", a.mode, errors.New(out.Error))
	}
	return out.Timings, nil
}

// ErrTryAgain marks a handler's ADD error that is for now (the pod is to
// be enrolled while no ztunnel is connected, as after a reboot): its
// refusal tells the plugin to ask again within its wait for the agent,
// before anything is programmed.
var ErrTryAgain = errors.New("for now")

// add runs the ADD conversation through the handler and makes sure the
// plugin has its last answer: the decision for a pod outside the mesh;
// done or error (Ready) for an enrolled one; an error in place of a
// decision when there is none.
func (s *Server) add(ctx context.Context, c *wire.Conn, pod *wire.Pod, netns *os.File) {
	conv := &addConv{s: s, ctx: ctx, c: c, netns: netns}
	err := errors.New("add carries no netns descriptor")
	if netns != nil {
		err = s.h.Add(ctx, pod, netns, conv)
	}
	if err == nil && (!conv.decided || conv.mode != wire.ModeNone && !conv.ready) {
		err = errors.New("the agent left the ADD unanswered") // a handler bug; never leave the plugin waiting
	}
	retry := !conv.decided && errors.Is(err, ErrTryAgain)
	if retry {
		// The plugin asks again: counted apart from failures.
		s.count(wire.KindAdd, "retry")
		s.log.Debug("pod ADD to ask again", "pod", pod.Key(), "containerID", pod.ContainerID, "err", err)
		_ = c.Send(&wire.Message{Kind: wire.KindError, Error: err.Error(), Retry: true}, nil)
		return
	}
	s.count(wire.KindAdd, result(err))
	if err == nil {
		return
	}
	s.log.Warn("pod ADD failed", "pod", pod.Key(), "containerID", pod.ContainerID, "err", err)
	switch {
	case !conv.decided:
		_ = c.Send(&wire.Message{Kind: wire.KindError, Error: err.Error()}, nil)
	case conv.outcome:
		// The handler undid the enrolment before it returned, the rules
		// the plugin reported included: the plugin, which had a failure,
		// waits for this before it returns its error.
		_ = c.Send(&wire.Message{Kind: wire.KindDone}, nil)
	case conv.mode != wire.ModeNone:
		conv.Ready(err)
	}
}

// drainLogs reads what the plugin sends after the conversation: its log
// records, until it closes. Anything else ends the connection.
func (s *Server) drainLogs(ctx context.Context, c *wire.Conn) {
	for {
		m, fd, err := c.Recv()
		if fd != nil {
			fd.Close()
		}
		if err != nil || m.Kind != wire.KindLog {
			return
		}
		s.pluginLogs(ctx, m.Logs)
	}
}

// maxLogAttrs bounds what one forwarded record may add to our log.
const maxLogAttrs = 32

// pluginLogs re-emits the plugin's JSON records in the agent's log at their
// own level, marked source=plugin.
func (s *Server) pluginLogs(ctx context.Context, recs []json.RawMessage) {
	for _, raw := range recs {
		var rec map[string]any
		if err := json.Unmarshal(raw, &rec); err != nil {
			continue
		}
		var lvl slog.Level
		if l, ok := rec["level"].(string); !ok || lvl.UnmarshalText([]byte(l)) != nil {
			lvl = slog.LevelInfo
		}
		msg, _ := rec["msg"].(string)
		attrs := []any{"source", "plugin"}
		for _, k := range slices.Sorted(maps.Keys(rec)) {
			v := rec[k]
			if k == "level" || k == "msg" || k == "time" {
				continue
			}
			if len(attrs) >= 2*maxLogAttrs {
				break
			}
			attrs = append(attrs, k, v)
		}
		s.log.Log(ctx, lvl, msg, attrs...)
	}
}

// WritePolicy replaces the policy snapshot at path atomically, so the
// plugin reads either the old or the new one, never a mix. It is stamped
// with this boot's ID, so that a plugin reading it after a reboot knows
// it for an earlier boot's.
func WritePolicy(path string, p *wire.Policy) error {
	p.BootID = wire.BootID()
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, append(b, '\n'), nil)
}
