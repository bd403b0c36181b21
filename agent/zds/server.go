package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/internal/sockfile"
	"github.com/nftcni/nftcni/internal/unixsock"
)

// DefaultSocket is where ztunnel looks for us (its INPOD_UDS).
const DefaultSocket = "/var/run/ztunnel/ztunnel.sock"

// ErrNoZtunnel is returned by Add when no ztunnel is connected: the pod's
// ADD fails and the runtime retries, as with Istio ("no ztunnel connection").
var ErrNoZtunnel = errors.New("no ztunnel connection")

// Timeouts of the protocol.
const (
	helloTimeout = 5 * time.Second // ztunnel must say hello within this
	ackTimeout   = 5 * time.Second // and answer every request within this
	// ackMargin is what a caller with a deadline (the agent answering the
	// plugin) keeps for itself after ztunnel's ack or its absence, so that
	// a hung ztunnel is reported as ztunnel, before the caller's own
	// deadline passes.
	ackMargin  = 500 * time.Millisecond
	aliveEvery = 2 * time.Second // how often an idle connection is checked for hang-up
)

// pod is a workload the agent has told (or will tell) ztunnel about.
type pod struct {
	info WorkloadInfo
	// netns is the enrolment's own descriptor, borrowed: the agent keeps
	// one per pod and closes it only after Del. nil: known without a netns
	// (snapshot sends Keep).
	netns *os.File
}

// Server is the agent's end of ZDS.
type Server struct {
	// AckTimeout bounds each request to a ztunnel, from the moment it is
	// asked for (waiting for the connection included) to its ack: a hung
	// ztunnel is dropped after it and delays no pod event longer. Set
	// before Serve; default 5 s.
	AckTimeout time.Duration

	log       *slog.Logger
	connected prometheus.Gauge
	// turnWait is how long an Add waited for its connection's turn (ZDS
	// has one request in flight per connection: the Adds of a burst queue
	// here); ackWait how long ztunnel took to ack it.
	turnWait, ackWait prometheus.Histogram

	// reg orders Adds against a new connection's registration: an Add
	// holds it (read) from picking a connection to remembering the pod, so
	// a connection registers only once every Add it might have missed has
	// reached its catch-up list.
	reg sync.RWMutex

	mu    sync.Mutex
	pods  map[string]*pod // by pod UID
	conns []*conn         // ready (snapshot acked), oldest first; Add goes to the last
	// pending are connections still receiving their snapshot, each with
	// the pods changed (tracked, added, deleted) since its snapshot began:
	// sent to it before it registers.
	pending map[*conn][]string
}

// NewServer returns a server; reg may be nil.
func NewServer(log *slog.Logger, reg prometheus.Registerer) *Server {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "ztunnel_connected", Help: "Whether a ztunnel is connected over ZDS (1) or not (0)."})
	buckets := prometheus.ExponentialBuckets(0.0005, 2, 16) // 0.5 ms .. 16 s
	turn := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "nftcni_ztunnel_add_queue_seconds", Buckets: buckets,
		Help: "How long a pod's AddWorkload waited for its ZDS connection (one request in flight per connection)."})
	ack := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "nftcni_ztunnel_add_ack_seconds", Buckets: buckets,
		Help: "How long ztunnel took to ack a pod's AddWorkload, from its sending."})
	if reg != nil {
		reg.MustRegister(g, turn, ack)
	}
	return &Server{AckTimeout: ackTimeout, log: log, connected: g, turnWait: turn, ackWait: ack, pods: map[string]*pod{}, pending: map[*conn][]string{}}
}

// Listen binds the ZDS socket, root-only (ztunnel runs as root), in a
// dir ztunnel's pod mounts too. A socket another live process serves there
// (istio-cni's agent while a rollout replaces it) is waited for up to
// wait, never taken (sockfile.InUseError).
func Listen(path string, wait time.Duration) (*net.UnixListener, error) {
	return sockfile.Listen(path, 0o755, wait)
}

// Serve accepts ztunnel connections until ctx ends.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer s.closeAll()
	for {
		uc, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			s.log.Warn("accept on the ZDS socket failed", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.handshake(ctx, uc)
		}()
	}
}

// Connected says whether any ztunnel is connected and has acked its
// whole snapshot, SnapshotSent included.
func (s *Server) Connected() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.ContainsFunc(s.conns, func(c *conn) bool { return c.synced.Load() })
}

// Accepting says whether a ztunnel is connected, or receiving its
// snapshot: one StartAdd waits for, within its deadline.
func (s *Server) Accepting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns) > 0 || len(s.pending) > 0
}

// handshake runs hello and the snapshot, then registers the connection as
// the newest and watches it for hang-up.
func (s *Server) handshake(ctx context.Context, uc *net.UnixConn) {
	if err := unixsock.RequireRoot(uc); err != nil {
		s.log.Warn("refused a ZDS connection", "err", err)
		uc.Close()
		return
	}
	c := newConn(uc)
	if err := hello(c, uc); err != nil {
		s.log.Warn("ztunnel did not say hello", "err", err)
		uc.Close()
		return
	}
	c.turn <- struct{}{}      // nothing else is sent on c before its snapshot
	have := map[string]bool{} // what c has been given
	if err := s.sendSnapshot(c, have); err != nil {
		s.mu.Lock()
		delete(s.pending, c)
		s.mu.Unlock()
		<-c.turn
		s.log.Warn("ZDS snapshot failed; waiting for ztunnel to reconnect", "err", err)
		uc.Close()
		return
	}
	err := c.request(&Request{Kind: KindSnapshotSent}, nil, time.Now().Add(s.AckTimeout))
	c.synced.Store(err == nil)
	<-c.turn
	if err != nil {
		s.drop(c, fmt.Errorf("snapshot end: %w", err))
		return
	}
	s.log.Info("ztunnel connected", "snapshot", len(have))
	s.watch(ctx, c)
}

// hello reads ztunnel's hello, within helloTimeout.
func hello(c *conn, uc *net.UnixConn) error {
	_ = uc.SetReadDeadline(time.Now().Add(helloTimeout))
	b, _, err := c.recv()
	if err != nil {
		return err
	}
	v, err := DecodeHello(b)
	if err == nil && v != VersionV1 {
		err = fmt.Errorf("unsupported ZDS version %d", v)
	}
	return err
}

// sendSnapshot sends c every pod the server holds, then registers c as
// the newest connection. The snapshot is sent without holding the server:
// Adds and Dels go on meanwhile (to the ready connections), and what they
// change is caught up before c registers. On error c is still pending.
func (s *Server) sendSnapshot(c *conn, have map[string]bool) error {
	s.mu.Lock()
	uids := make([]string, 0, len(s.pods))
	for uid := range s.pods {
		uids = append(uids, uid)
	}
	s.pending[c] = nil
	s.mu.Unlock()
	sort.Strings(uids)
	if err := s.sendPods(c, uids, have); err != nil {
		return err
	}
	for caught := 0; caught < 4; caught++ { // catch up while Adds go on elsewhere
		s.mu.Lock()
		changed := s.pending[c]
		s.pending[c] = nil
		s.mu.Unlock()
		if err := s.sendPods(c, changed, have); err != nil {
			return err
		}
		if len(changed) == 0 {
			break
		}
	}
	// Register: once the in-flight Adds are done (no new one starts while
	// the registration lock is held), what they and any Del changed is
	// sent, until nothing is left, and c becomes the newest in the same
	// critical section that finds nothing left.
	s.reg.Lock()
	defer s.reg.Unlock()
	for {
		s.mu.Lock()
		changed := s.pending[c]
		if len(changed) == 0 {
			delete(s.pending, c)
			s.conns = append(s.conns, c)
			s.connected.Set(1)
			s.mu.Unlock()
			return nil
		}
		s.pending[c] = nil
		s.mu.Unlock()
		if err := s.sendPods(c, changed, have); err != nil {
			return err
		}
	}
}

// sendPods sends c what the server holds now of each uid: Add with a dup
// of its netns (the pod's own descriptor may be closed by a Del meanwhile),
// Keep for a pod known without one, Del for one c was given that is gone.
// A refusal is logged; a broken connection is the error. The caller has
// c's turn.
func (s *Server) sendPods(c *conn, uids []string, have map[string]bool) error {
	for _, uid := range uids {
		s.mu.Lock()
		p := s.pods[uid]
		var r *Request
		var f *os.File
		switch {
		case p == nil && have[uid]:
			r = &Request{Kind: KindDel, UID: uid}
		case p == nil:
		case p.netns != nil:
			info := p.info
			r = &Request{Kind: KindAdd, UID: uid, Info: &info}
			fd, err := unix.FcntlInt(p.netns.Fd(), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				s.mu.Unlock()
				return fmt.Errorf("keeping pod %s's netns for the snapshot: %w", uid, err)
			}
			f = os.NewFile(uintptr(fd), "netns")
		default:
			r = &Request{Kind: KindKeep, UID: uid}
		}
		s.mu.Unlock()
		if r == nil {
			continue
		}
		err := c.request(r, f, time.Now().Add(s.AckTimeout))
		if f != nil {
			f.Close()
		}
		var refused *AckError
		switch {
		case errors.As(err, &refused):
			s.log.Warn("ztunnel refused a pod in the snapshot", "uid", uid, "kind", r.Kind, "err", err)
		case err != nil:
			return err
		}
		have[uid] = r.Kind != KindDel
	}
	return nil
}

// watch checks an idle connection for hang-up and drops it when it goes.
func (s *Server) watch(ctx context.Context, c *conn) {
	t := time.NewTicker(aliveEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		var ended error
		select {
		case c.turn <- struct{}{}: // idle: poll it
			ended = c.idleEnd()
			<-c.turn
		default: // a request is in flight and has its own deadline
		}
		if ended != nil {
			s.drop(c, ended)
			return
		}
		s.mu.Lock()
		gone := !containsConn(s.conns, c)
		s.mu.Unlock()
		if gone {
			return
		}
	}
}

func containsConn(cs []*conn, c *conn) bool {
	for _, x := range cs {
		if x == c {
			return true
		}
	}
	return false
}

// drop forgets a connection that failed.
func (s *Server) drop(c *conn, why error) {
	s.mu.Lock()
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			break
		}
	}
	if len(s.conns) == 0 {
		s.connected.Set(0)
	}
	s.mu.Unlock()
	c.uc.Close()
	s.log.Warn("ztunnel connection closed", "reason", why)
}

func (s *Server) closeAll() {
	s.mu.Lock()
	cs := s.conns
	s.conns = nil
	s.connected.Set(0)
	s.mu.Unlock()
	for _, c := range cs {
		c.uc.Close()
	}
}

// Add hands a pod's netns to the newest ztunnel and waits for its ack; the
// pod is remembered for later snapshots, netns with it: the caller keeps
// netns open until it calls Del. With no ztunnel connected it returns
// ErrNoZtunnel and remembers nothing.
func (s *Server) Add(ctx context.Context, uid string, info WorkloadInfo, netns *os.File) error {
	return s.StartAdd(ctx, uid, info, netns)()
}

// StartAdd is Add in two halves: it sends the AddWorkload and returns the
// wait for its ack, which the caller must call, once (the connection is
// held until then). ztunnel opens its listeners in the pod's netns before
// it acks; the caller's own work overlaps that, with no goroutine to wake.
func (s *Server) StartAdd(ctx context.Context, uid string, info WorkloadInfo, netns *os.File) (wait func() error) {
	start := time.Now()
	deadline := s.ackDeadline(ctx)
	s.reg.RLock()
	s.mu.Lock()
	for len(s.conns) == 0 {
		// A ztunnel still receiving its first snapshot (right after an
		// agent or ztunnel start) is waited for, within the deadline.
		if len(s.pending) == 0 || time.Now().After(deadline) {
			s.mu.Unlock()
			s.reg.RUnlock()
			return func() error { return ErrNoZtunnel }
		}
		s.mu.Unlock()
		s.reg.RUnlock()
		time.Sleep(5 * time.Millisecond)
		s.reg.RLock()
		s.mu.Lock()
	}
	c := s.conns[len(s.conns)-1]
	s.mu.Unlock()
	done := func(err error) error {
		defer s.reg.RUnlock()
		if err != nil {
			var refused *AckError
			if !errors.As(err, &refused) {
				s.drop(c, err)
			}
			return noAck(KindAdd, uid, deadline, start, err)
		}
		s.Track(uid, info, netns)
		return nil
	}
	r := &Request{Kind: KindAdd, UID: uid, Info: &info}
	queued := time.Now()
	if err := c.take(time.Until(deadline), r.Kind); err != nil {
		err = done(err)
		return func() error { return err }
	}
	sent := time.Now()
	s.turnWait.Observe(sent.Sub(queued).Seconds())
	if err := c.send(r, netns, deadline); err != nil {
		c.release()
		err = done(err)
		return func() error { return err }
	}
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			err = c.awaitAck(r)
			if err == nil {
				s.ackWait.Observe(time.Since(sent).Seconds())
			}
			c.release()
			err = done(err)
		})
		return err
	}
}

// ackDeadline is when a request made under ctx stops waiting for its ack:
// AckTimeout from now, or ackMargin before ctx's deadline if that is
// sooner.
func (s *Server) ackDeadline(ctx context.Context) time.Time {
	d := time.Now().Add(s.AckTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Add(-ackMargin).Before(d) {
		d = cd.Add(-ackMargin)
	}
	return d
}

// noAck names a missed ack as ztunnel's.
func noAck(kind Kind, uid string, deadline, start time.Time, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("ztunnel did not ack %s %s within %v (hung or overloaded): %w", kind, uid, deadline.Sub(start).Round(time.Millisecond), err)
	}
	return fmt.Errorf("ztunnel %s %s: %w", kind, uid, err)
}

// Track remembers a pod without telling ztunnel now (agent restart: pods
// found enrolled), or points it at another descriptor of the same pod (a
// re-created sandbox); netns is borrowed as in Add and may be nil, and the
// next snapshot then sends Keep.
func (s *Server) Track(uid string, info WorkloadInfo, netns *os.File) {
	s.mu.Lock()
	s.pods[uid] = &pod{info: info, netns: netns}
	s.changedLocked(uid)
	s.mu.Unlock()
}

// changedLocked puts uid on the catch-up list of every connection still
// receiving its snapshot.
func (s *Server) changedLocked(uid string) {
	for c, l := range s.pending {
		s.pending[c] = append(l, uid)
	}
}

// Holds says whether the server remembers the pod.
func (s *Server) Holds(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pods[uid] != nil
}

// Del tells every connected ztunnel to drop the pod and forgets it; once
// it returns, the pod's descriptor is no longer used. A pod the server
// does not hold is not sent: ztunnel only has what the agent gave it on
// this connection, so a Del could only name something it never had.
func (s *Server) Del(ctx context.Context, uid string) {
	s.mu.Lock()
	_, held := s.pods[uid]
	delete(s.pods, uid)
	if held {
		s.changedLocked(uid)
	}
	cs := append([]*conn(nil), s.conns...)
	s.mu.Unlock()
	if !held {
		return
	}
	// To every connection at once: a hung one costs the deadline once,
	// not once per connection.
	start, deadline := time.Now(), s.ackDeadline(ctx)
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.requestWithin(&Request{Kind: KindDel, UID: uid}, nil, time.Until(deadline)); err != nil {
				var refused *AckError
				if !errors.As(err, &refused) {
					s.drop(c, err)
				}
				s.log.Warn("ztunnel DelWorkload failed", "uid", uid, "err", noAck(KindDel, uid, deadline, start, err))
			}
		}()
	}
	wg.Wait()
}

// Known lists the UIDs the server remembers, sorted.
func (s *Server) Known() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.pods))
	for uid := range s.pods {
		out = append(out, uid)
	}
	sort.Strings(out)
	return out
}

// State describes what ztunnel has of a pod, for operators (inspect).
func (s *Server) State(uid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, conns := s.pods[uid], len(s.conns)
	switch {
	case p == nil:
		return "not held for ztunnel (not enrolled in ambient, or removed)"
	case p.netns == nil:
		return fmt.Sprintf("held without its netns: sent as KeepWorkload in snapshots (%d ztunnel connected)", conns)
	case conns == 0:
		return "held with its netns; no ztunnel connected: it gets the pod in its snapshot when it connects"
	}
	return fmt.Sprintf("handed to ztunnel with its netns (acked; %d ztunnel connected)", conns)
}

// AckError is ztunnel refusing a request.
type AckError struct{ Msg string }

func (e *AckError) Error() string { return "ztunnel refused: " + e.Msg }

// conn is one ztunnel connection; requests are in lockstep with acks.
type conn struct {
	// turn is held (a value in it) by the one request in flight; a channel
	// rather than a mutex so that waiting for it has a deadline.
	turn chan struct{}
	uc   *net.UnixConn
	// synced: ztunnel acked the whole snapshot, SnapshotSent included.
	synced atomic.Bool
}

func newConn(uc *net.UnixConn) *conn { return &conn{turn: make(chan struct{}, 1), uc: uc} }

// errStuck: the connection is busy with a request ztunnel has not acked.
var errStuck = errors.New("ztunnel has not acked the request before it")

// requestWithin sends r once the connection is free and waits for its ack,
// all within d.
func (c *conn) requestWithin(r *Request, fd *os.File, d time.Duration) error {
	deadline := time.Now().Add(d)
	if err := c.take(d, r.Kind); err != nil {
		return err
	}
	defer c.release()
	return c.request(r, fd, deadline)
}

// take waits up to d for the connection's turn; release gives it back.
func (c *conn) take(d time.Duration, kind Kind) error {
	select {
	case c.turn <- struct{}{}:
		return nil
	default:
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case c.turn <- struct{}{}:
		return nil
	case <-t.C:
		return fmt.Errorf("sending %s within %v: %w", kind, d, errStuck)
	}
}

func (c *conn) release() { <-c.turn }

// request sends r (with fd on Add) and waits for its ack until deadline.
// The caller has the connection's turn.
func (c *conn) request(r *Request, fd *os.File, deadline time.Time) error {
	if err := c.send(r, fd, deadline); err != nil {
		return err
	}
	return c.awaitAck(r)
}

// send writes r (with fd on Add); the deadline holds until awaitAck.
func (c *conn) send(r *Request, fd *os.File, deadline time.Time) error {
	b, err := EncodeRequest(r)
	if err != nil {
		return err
	}
	var oob []byte
	if fd != nil {
		oob = unix.UnixRights(int(fd.Fd()))
	}
	_ = c.uc.SetDeadline(deadline)
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		_ = c.uc.SetDeadline(time.Time{})
		return fmt.Errorf("sending %s: %w", r.Kind, err)
	}
	return nil
}

// awaitAck reads the ack of r, sent by send.
func (c *conn) awaitAck(r *Request) error {
	defer c.uc.SetDeadline(time.Time{})
	resp, fds, err := c.recv()
	for _, f := range fds {
		unix.Close(f)
	}
	if err != nil {
		return fmt.Errorf("waiting for the ack of %s: %w", r.Kind, err)
	}
	msg, ok, err := DecodeAck(resp)
	switch {
	case err != nil:
		return err
	case !ok:
		return fmt.Errorf("answer to %s is not an ack", r.Kind)
	case msg != "":
		return &AckError{Msg: msg}
	}
	return nil
}

// recv reads one message of at most MaxMessage bytes.
func (c *conn) recv() ([]byte, []int, error) {
	buf := make([]byte, MaxMessage)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
	fds, _ := unixsock.Rights(oob[:oobn]) // ztunnel sends none; any are closed
	if err != nil {
		return nil, fds, err
	}
	if n == 0 {
		return nil, fds, errors.New("ztunnel closed the connection")
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return nil, fds, fmt.Errorf("message over the %d-byte ZDS limit", MaxMessage)
	}
	return buf[:n], fds, nil
}

// idleEnd polls an idle connection without blocking: nil while it stays
// idle, else what ended it — a hang-up, or a message ztunnel sent unasked
// (it only ever answers), which is named as such with its first bytes.
func (c *conn) idleEnd() error {
	rc, err := c.uc.SyscallConn()
	if err != nil {
		return err
	}
	var ended error
	cerr := rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
		n, err := unix.Poll(p, 0)
		for errors.Is(err, unix.EINTR) { // the Go runtime's preemption signals interrupt poll
			n, err = unix.Poll(p, 0)
		}
		switch {
		case err != nil:
			ended = fmt.Errorf("polling the connection: %w", err)
			return
		case n == 0 || p[0].Revents == 0:
			return
		}
		// Queued data comes before a hang-up: peek at it (MSG_TRUNC: the
		// real length of a longer message).
		buf := make([]byte, 16)
		m, _, err := unix.Recvfrom(int(fd), buf, unix.MSG_PEEK|unix.MSG_DONTWAIT|unix.MSG_TRUNC)
		switch {
		case m > 0:
			ended = fmt.Errorf("ztunnel sent %d bytes unasked (it only answers requests; garbage, or a protocol this agent does not speak): % x", m, buf[:min(m, len(buf))])
		case err != nil && !errors.Is(err, unix.EAGAIN):
			ended = fmt.Errorf("ztunnel connection failed: %w", err)
		default:
			ended = errors.New("ztunnel hung up")
		}
	})
	if cerr != nil {
		return cerr
	}
	return ended
}
