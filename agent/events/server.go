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
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/agent/unixsock"
	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Handler is what the server needs from the rest of the agent.
type Handler interface {
	// Decide says what a pod gets (ADD and CHECK). It has no side effects.
	Decide(ctx context.Context, pod *wire.Pod) (*wire.Decision, error)
	// Prepare runs for an ADD the agent enrols, while the plugin programs
	// the rules (ambient: hand netns to ztunnel and wait for its ack). An
	// error fails the ADD, after Added has been told.
	Prepare(ctx context.Context, pod *wire.Pod, d *wire.Decision, netns *os.File) error
	// Added completes an ADD. For an enrolled pod it reports the plugin's
	// outcome: programErr nil means the rules are in place, Prepare
	// succeeded and the pod may be marked enrolled; it is called with an
	// error when either failed or the plugin went away. For ModeNone it is
	// called once the decision is sent: the pod is known (its netns with
	// it), not enrolled. An error return fails the ADD.
	Added(ctx context.Context, pod *wire.Pod, d *wire.Decision, netns *os.File, programErr error) error
	// Deleted is the pod's DEL: release whatever is held for it.
	Deleted(ctx context.Context, pod *wire.Pod) error
	// ZDSState says what ztunnel has of the pod with uid (inspect).
	ZDSState(uid string) string
	// GC releases what is held for attachments not in valid.
	GC(ctx context.Context, valid []wire.Attachment) error
	// Ready is nil when ADDs can be served (STATUS).
	Ready() error
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

// Server answers the plugin.
type Server struct {
	h       Handler
	log     *slog.Logger
	metrics *Metrics
	// Timeout bounds one connection, from accept to close.
	Timeout time.Duration
	// MaxConns bounds connections served at once; more wait in the backlog.
	MaxConns int

	wg sync.WaitGroup
}

// NewServer returns a server with production limits.
func NewServer(h Handler, log *slog.Logger, m *Metrics) *Server {
	if m == nil {
		m = NewMetrics(nil)
	}
	return &Server{h: h, log: log, metrics: m, Timeout: 10 * time.Second, MaxConns: 256}
}

// Listen binds the plugin socket at path, root-only, in a 0750 dir.
func Listen(path string) (*net.UnixListener, error) { return unixsock.Listen(path, 0o750) }

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
	if err := wire.RequireRoot(uc); err != nil {
		s.log.Warn("refused a connection on the plugin socket", "err", err)
		s.count("connect", "rejected")
		return
	}
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	c := wire.NewConn(uc)
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
		var d *wire.Decision
		if d, err = s.h.Decide(ctx, m.Pod); err == nil {
			reply = &wire.Message{Kind: wire.KindDecision, Decision: d}
		}
	case wire.KindDel:
		err = s.h.Deleted(ctx, m.Pod)
	case wire.KindStatus:
		err = s.h.Ready()
	case wire.KindGC:
		err = s.h.GC(ctx, m.Valid)
	case wire.KindInspect: // Decode made sure it names a pod UID
		reply = &wire.Message{Kind: wire.KindDone, ZDS: s.h.ZDSState(m.Pod.UID)}
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

// add runs the ADD conversation: decision (Prepare starting beside it for
// enrolled pods), then the plugin's outcome, then Added and the answer.
func (s *Server) add(ctx context.Context, c *wire.Conn, pod *wire.Pod, netns *os.File) {
	fail := func(err error) {
		s.count(wire.KindAdd, "failure")
		s.log.Warn("pod ADD failed", "pod", pod.Key(), "containerID", pod.ContainerID, "err", err)
		_ = c.Send(&wire.Message{Kind: wire.KindError, Error: err.Error()}, nil)
	}
	if netns == nil {
		fail(errors.New("add carries no netns descriptor"))
		return
	}
	d, err := s.h.Decide(ctx, pod)
	if err != nil {
		fail(err)
		return
	}
	// Prepare (ztunnel taking the netns) runs while the plugin programs
	// the rules: neither needs the other, and the pod's containers start
	// only after both, when the ADD returns.
	var prepared chan error
	if d.Mode != wire.ModeNone {
		prepared = make(chan error, 1)
		go func() { prepared <- s.h.Prepare(ctx, pod, d, netns) }()
	}
	if err := c.Send(&wire.Message{Kind: wire.KindDecision, Decision: d}, nil); err != nil {
		if d.Mode != wire.ModeNone {
			<-prepared
			_ = s.h.Added(ctx, pod, d, netns, fmt.Errorf("plugin went away before the decision: %w", err))
		}
		s.count(wire.KindAdd, "failure")
		return
	}
	if d.Mode == wire.ModeNone {
		if err := s.h.Added(ctx, pod, d, netns, nil); err != nil {
			s.log.Warn("could not record a pod outside the mesh", "pod", pod.Key(), "err", err)
		}
		s.count(wire.KindAdd, "success")
		return
	}
	m, fd, err := c.Recv()
	if fd != nil {
		fd.Close()
	}
	var programErr error
	switch {
	case err != nil:
		programErr = fmt.Errorf("plugin went away before reporting its outcome: %w", err)
	case m.Kind != wire.KindOutcome:
		programErr = fmt.Errorf("plugin sent %s, want outcome", m.Kind)
	case m.Error != "":
		programErr = fmt.Errorf("plugin could not program the %s ruleset: %w", d.Mode, errors.New(m.Error))
	}
	if err := <-prepared; err != nil && programErr == nil {
		programErr = err
	}
	if err := s.h.Added(ctx, pod, d, netns, programErr); err != nil {
		fail(err)
		return
	}
	if programErr != nil {
		fail(programErr)
		return
	}
	s.count(wire.KindAdd, "success")
	_ = c.Send(&wire.Message{Kind: wire.KindDone}, nil)
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

// WritePolicy replaces the policy snapshot in runDir atomically, so the
// plugin reads either the old or the new one, never a mix.
func WritePolicy(runDir string, p *wire.Policy) error {
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(runDir, 0o750); err != nil {
		return err
	}
	return conflist.WriteFile(filepath.Join(runDir, wire.PolicyName), append(b, '\n'), nil)
}
