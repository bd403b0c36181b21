//go:build !unit

package zds_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/prometheus/client_golang/prometheus"
)

const wait = 3 * time.Second

// serve runs a server; configure, if any, sets it up before it serves.
func serve(t *testing.T, configure ...func(*zds.Server)) (*zds.Server, string) {
	t.Helper()
	return serveLogging(t, io.Discard, configure...)
}

// serveLogging is serve with the server's log written to w.
func serveLogging(t *testing.T, w io.Writer, configure ...func(*zds.Server)) (*zds.Server, string) {
	t.Helper()
	return serveOn(t, w, nil, configure...)
}

// serveOn is serveLogging with the server's metrics registered in reg.
func serveOn(t *testing.T, w io.Writer, reg prometheus.Registerer, configure ...func(*zds.Server)) (*zds.Server, string) {
	t.Helper()
	testnet.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "ztunnel", "ztunnel.sock")
	l, err := zds.Listen(path, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := zds.NewServer(slog.New(slog.NewTextHandler(w, nil)), reg)
	for _, c := range configure {
		c(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.Serve(ctx, l); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s, path
}

// openNS opens the namespace's own descriptor for a test to hand over.
func openNS(t *testing.T, n *testnet.NS) *os.File {
	t.Helper()
	f, err := os.Open(n.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func waitConnected(t *testing.T, s *zds.Server, want bool) {
	t.Helper()
	for deadline := time.Now().Add(wait); s.Connected() != want; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("connected never became %v", want)
		}
	}
}

func TestAddWithoutZtunnelFailsClosed(t *testing.T) {
	s, _ := serve(t)
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	err := s.Add(context.Background(), "u1", zds.WorkloadInfo{Name: "p"}, f)
	if !errors.Is(err, zds.ErrNoZtunnel) {
		t.Fatalf("Add with no ztunnel: %v", err)
	}
	if len(s.Known()) != 0 {
		t.Error("a pod ztunnel never got was remembered")
	}
}

// Hello, empty snapshot, Add into the pod netns with listeners opened
// there, Del, and the socket's mode.
func TestAddAndDel(t *testing.T) {
	s, path := serve(t)
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v", st.Mode(), err)
	}
	z := ztunneltest.Connect(t, path)
	z.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)

	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	info := zds.WorkloadInfo{Name: "cart", Namespace: "shop", ServiceAccount: "default"}
	if err := s.Add(context.Background(), "uid-cart", info, f); err != nil {
		t.Fatal(err)
	}
	e := z.Wait(zds.KindAdd, "uid-cart", wait)
	if e.FDs != 1 || e.Info == nil || *e.Info != info {
		t.Errorf("ztunnel got %+v", e)
	}
	// The listener really is inside the pod netns: dial it from there.
	p := z.Pod("uid-cart")
	if _, err := pod.Dial(t, "tcp", "127.0.0.1:15001", testnet.DialOpts{}); err != nil {
		t.Fatalf("dial 15001 inside the pod: %v", err)
	}
	if _, err := testnet.Accept(t, p.Outbound, wait); err != nil {
		t.Errorf("ztunnel's 15001 in the pod netns: %v", err)
	}
	if st := s.State("uid-cart"); !strings.HasPrefix(st, "handed to ztunnel") {
		t.Errorf("state after Add: %s", st)
	}
	s.Del(context.Background(), "uid-cart")
	z.Wait(zds.KindDel, "uid-cart", wait)
	if z.Pod("uid-cart") != nil || len(s.Known()) != 0 {
		t.Error("pod still known after Del")
	}
	if st := s.State("uid-cart"); !strings.HasPrefix(st, "not held") {
		t.Errorf("state after Del: %s", st)
	}
}

// Every Add's wait for its connection and for ztunnel's ack is measured.
func TestAddIsTimed(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, path := serveOn(t, io.Discard, reg)
	z := ztunneltest.Connect(t, path)
	z.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	for i, name := range []string{"a", "b"} {
		f := openNS(t, testnet.NewNS(t, "nftzds"))
		if err := s.Add(context.Background(), "uid-"+name, zds.WorkloadInfo{Name: name, Namespace: "shop"}, f); err != nil {
			t.Fatal(err)
		}
		z.Wait(zds.KindAdd, "uid-"+name, wait)
		for _, h := range []string{"nftcni_ztunnel_add_queue_seconds", "nftcni_ztunnel_add_ack_seconds"} {
			if n := sampleCount(t, reg, h); n != uint64(i+1) {
				t.Errorf("%s: %d observations after %d Adds", h, n, i+1)
			}
		}
	}
}

func sampleCount(t *testing.T, g prometheus.Gatherer, name string) uint64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// StartAdd's AddWorkload reaches ztunnel, which opens its listeners in the
// pod's netns, before its caller waits for the ack: the caller's work
// overlaps ztunnel's. The pod is held only once the ack is in.
func TestStartAddSendsBeforeTheWait(t *testing.T) {
	s, path := serve(t)
	z := ztunneltest.Connect(t, path)
	z.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	pod := testnet.NewNS(t, "nftzds")
	ack := s.StartAdd(context.Background(), "uid-early", zds.WorkloadInfo{Name: "early"}, openNS(t, pod))
	z.Wait(zds.KindAdd, "uid-early", wait) // applied: its listeners are open
	if z.Pod("uid-early") == nil {
		t.Fatal("ztunnel has no listeners for the pod before the wait")
	}
	if err := ack(); err != nil {
		t.Fatal(err)
	}
	if err := ack(); err != nil { // once: a second call gives the same answer
		t.Fatal(err)
	}
	if !s.Holds("uid-early") {
		t.Error("pod not held after its ack")
	}
	// The connection is free again for the next request.
	if err := s.Add(context.Background(), "uid-next", zds.WorkloadInfo{Name: "next"}, openNS(t, pod)); err != nil {
		t.Fatal(err)
	}
}

// What inspect prints for pods the server holds with no ztunnel connected.
func TestStateWithoutZtunnel(t *testing.T) {
	s, _ := serve(t)
	s.Track("kept", zds.WorkloadInfo{Name: "k"}, nil)
	s.Track("withfd", zds.WorkloadInfo{Name: "w"}, openNS(t, testnet.NewNS(t, "nftzds")))
	t.Cleanup(func() { s.Del(context.Background(), "kept"); s.Del(context.Background(), "withfd") }) // closes the server's dup
	for uid, want := range map[string]string{"kept": "held without its netns", "withfd": "held with its netns; no ztunnel connected", "other": "not held"} {
		if st := s.State(uid); !strings.HasPrefix(st, want) {
			t.Errorf("State(%s) = %q, want %q…", uid, st, want)
		}
	}
}

// A reconnecting ztunnel gets every known pod: Add with a fd where the agent
// has one, Keep where it does not, then SnapshotSent; Add goes to the newest
// connection, Del to all.
func TestSnapshotAndNewestConnection(t *testing.T) {
	s, path := serve(t)
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	s.Track("uid-a", zds.WorkloadInfo{Name: "a"}, f)
	s.Track("uid-b", zds.WorkloadInfo{Name: "b"}, nil) // known from a restart, no netns
	old := ztunneltest.Connect(t, path)
	if e := old.Wait(zds.KindAdd, "uid-a", wait); e.FDs != 1 {
		t.Errorf("snapshot Add carried %d fds", e.FDs)
	}
	if e := old.Wait(zds.KindKeep, "uid-b", wait); e.FDs != 0 {
		t.Errorf("Keep carried %d fds", e.FDs)
	}
	old.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)

	newer := ztunneltest.Connect(t, path)
	newer.Wait(zds.KindAdd, "uid-a", wait)
	newer.Wait(zds.KindSnapshotSent, "", wait)
	for deadline := time.Now().Add(wait); ; time.Sleep(5 * time.Millisecond) {
		pod2 := testnet.NewNS(t, "nftzds")
		if err := s.Add(context.Background(), "uid-c", zds.WorkloadInfo{Name: "c"}, openNS(t, pod2)); err != nil {
			t.Fatal(err)
		}
		if newer.Pod("uid-c") != nil {
			break // the newest connection got it (it registered after its snapshot)
		}
		if time.Now().After(deadline) {
			t.Fatal("Add never reached the newest ztunnel")
		}
	}
	if old.Pod("uid-c") != nil {
		t.Error("Add went to the old connection")
	}
	s.Del(context.Background(), "uid-a")
	old.Wait(zds.KindDel, "uid-a", wait)
	newer.Wait(zds.KindDel, "uid-a", wait)
	known := s.Known()
	sort.Strings(known)
	if strings.Join(known, ",") != "uid-b,uid-c" {
		t.Errorf("known %v", known)
	}
}

// ztunnel refusing an Add is an error for that pod only; ztunnel going away
// is noticed and Add fails closed again.
func TestRefusalAndHangUp(t *testing.T) {
	s, path := serve(t)
	z := ztunneltest.Connect(t, path)
	z.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	z.Refuse("uid-x", "cannot enter netns")
	pod := testnet.NewNS(t, "nftzds")
	err := s.Add(context.Background(), "uid-x", zds.WorkloadInfo{}, openNS(t, pod))
	var refused *zds.AckError
	if !errors.As(err, &refused) || !strings.Contains(err.Error(), "cannot enter netns") {
		t.Fatalf("refused Add: %v", err)
	}
	if !s.Connected() {
		t.Fatal("a refusal dropped the connection")
	}
	z.Close()
	waitConnected(t, s, false)
	if err := s.Add(context.Background(), "uid-y", zds.WorkloadInfo{}, openNS(t, pod)); !errors.Is(err, zds.ErrNoZtunnel) {
		t.Errorf("Add after hang-up: %v", err)
	}
}

// A rolling update of ztunnel: two connected at once. Both get full
// snapshots, new pods go to the newest, Dels reach both, and 50 ADDs made
// while both are connected all succeed.
func TestRollingUpdateTwoZtunnels(t *testing.T) {
	s, path := serve(t)
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	s.Track("uid-old-pod", zds.WorkloadInfo{Name: "old-pod"}, f)
	old := ztunneltest.Connect(t, path)
	old.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	newer := ztunneltest.Connect(t, path)
	newer.Wait(zds.KindAdd, "uid-old-pod", wait) // its own full snapshot
	newer.Wait(zds.KindSnapshotSent, "", wait)
	// The newest registers right after its snapshot's last ack.
	for deadline := time.Now().Add(wait); ; time.Sleep(5 * time.Millisecond) {
		if err := s.Add(context.Background(), "uid-probe", zds.WorkloadInfo{Name: "probe"}, f); err != nil {
			t.Fatal(err)
		}
		if newer.Pod("uid-probe") != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Add never reached the newest ztunnel")
		}
	}
	errs := make(chan error, 50)
	for i := range 50 {
		go func() { errs <- s.Add(context.Background(), fmt.Sprintf("uid-%d", i), zds.WorkloadInfo{Name: "p"}, f) }()
	}
	for range 50 {
		if err := <-errs; err != nil {
			t.Errorf("ADD during the overlap: %v", err)
		}
	}
	for i := range 50 {
		uid := fmt.Sprintf("uid-%d", i)
		if newer.Pod(uid) == nil || old.Pod(uid) != nil {
			t.Fatalf("%s: newest has it %v, old has it %v; want only the newest", uid, newer.Pod(uid) != nil, old.Pod(uid) != nil)
		}
	}
	s.Del(context.Background(), "uid-old-pod")
	old.Wait(zds.KindDel, "uid-old-pod", wait)
	newer.Wait(zds.KindDel, "uid-old-pod", wait)
}

// dialHello is a raw ztunnel connection that has said hello, closed when
// the test ends.
func dialHello(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { uc.Close() })
	if _, err := uc.Write(zds.EncodeHello(zds.VersionV1)); err != nil {
		t.Fatal(err)
	}
	return uc
}

// hungZtunnel says hello, acks its snapshot, then stops reading with its
// socket open: ztunnel#1674's shape. It returns the connection.
func hungZtunnel(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	uc := dialHello(t, path)
	buf, oob := make([]byte, zds.MaxMessage), make([]byte, 1024)
	for {
		n, _, _, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil {
			t.Fatal(err)
		}
		r, err := zds.DecodeRequest(buf[:n])
		if err != nil {
			t.Fatal(err)
		}
		if _, err := uc.Write(zds.EncodeAck("")); err != nil {
			t.Fatal(err)
		}
		if r.Kind == zds.KindSnapshotSent {
			return uc
		}
	}
}

// A ztunnel that hangs delays no ADD or DEL by more than the ack deadline,
// including ADDs queued behind one it never acks; it is dropped, and the
// healthy ztunnel gets the pods from then on.
func TestHungZtunnelDelaysNoEventBeyondTheDeadline(t *testing.T) {
	s, path := serve(t, func(s *zds.Server) { s.AckTimeout = 300 * time.Millisecond })
	const slack = 250 * time.Millisecond
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	healthy := ztunneltest.Connect(t, path)
	healthy.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	s.Track("uid-a", zds.WorkloadInfo{Name: "a"}, f)
	hungZtunnel(t, path) // the newest now
	time.Sleep(50 * time.Millisecond)

	type result struct {
		took time.Duration
		err  error
	}
	results := make(chan result, 5)
	for i := range 5 { // one in flight, four waiting for their turn
		go func() {
			start := time.Now()
			err := s.Add(context.Background(), fmt.Sprintf("uid-q%d", i), zds.WorkloadInfo{Name: "q"}, f)
			results <- result{time.Since(start), err}
		}()
	}
	for range 5 {
		r := <-results
		// Each fails (the hung one never acks; the queued ones find it
		// dropped or still stuck), and none waits past the deadline.
		if r.took > s.AckTimeout+slack || r.err == nil {
			t.Errorf("an ADD to a hung ztunnel: %v after %v; want an error within the %v deadline", r.err, r.took, s.AckTimeout)
		}
	}
	// Dropped: the next ADD goes to the healthy one at once.
	start := time.Now()
	if err := s.Add(context.Background(), "uid-after", zds.WorkloadInfo{Name: "after"}, f); err != nil {
		t.Fatalf("ADD after the hung ztunnel was dropped: %v", err)
	}
	if took := time.Since(start); took > slack {
		t.Errorf("ADD after the drop took %v", took)
	}
	if healthy.Pod("uid-after") == nil {
		t.Error("the healthy ztunnel did not get the pod")
	}

	// A hung ztunnel next to a healthy one delays a Del by one deadline.
	hungZtunnel(t, path)
	time.Sleep(50 * time.Millisecond)
	start = time.Now()
	s.Del(context.Background(), "uid-a")
	if took := time.Since(start); took > s.AckTimeout+slack {
		t.Errorf("Del took %v with a hung ztunnel; the deadline is %v", took, s.AckTimeout)
	}
	healthy.Wait(zds.KindDel, "uid-a", wait)
}

// slowZtunnel acks every request after delay and records them in order.
type slowZtunnel struct {
	mu   sync.Mutex
	seen []string // "kind uid"
	done chan struct{}
}

func newSlowZtunnel(t *testing.T, path string, delay time.Duration) *slowZtunnel {
	t.Helper()
	uc := dialHello(t, path)
	z := &slowZtunnel{done: make(chan struct{})}
	go func() {
		buf, oob := make([]byte, zds.MaxMessage), make([]byte, 1024)
		for {
			n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			if msgs, _ := unix.ParseSocketControlMessage(oob[:oobn]); len(msgs) > 0 {
				if fds, _ := unix.ParseUnixRights(&msgs[0]); len(fds) > 0 {
					unix.Close(fds[0])
				}
			}
			r, err := zds.DecodeRequest(buf[:n])
			if err != nil {
				return
			}
			time.Sleep(delay)
			z.mu.Lock()
			z.seen = append(z.seen, fmt.Sprintf("%s %s", r.Kind, r.UID))
			z.mu.Unlock()
			if _, err := uc.Write(zds.EncodeAck("")); err != nil {
				return
			}
			if r.Kind == zds.KindSnapshotSent {
				close(z.done)
			}
		}
	}()
	return z
}

func (z *slowZtunnel) got() []string {
	z.mu.Lock()
	defer z.mu.Unlock()
	return append([]string(nil), z.seen...)
}

// A new ztunnel that takes long over its snapshot holds up no ADD (they go
// to the ready one meanwhile), and it registers holding exactly the
// server's pods: those added and deleted during its snapshot caught up.
func TestSlowSnapshotBlocksNoADDAndCatchesUp(t *testing.T) {
	s, path := serve(t)
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	for i := range 20 {
		s.Track(fmt.Sprintf("uid-s%02d", i), zds.WorkloadInfo{Name: "s"}, f)
	}
	ready := ztunneltest.Connect(t, path)
	ready.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)

	slow := newSlowZtunnel(t, path, 20*time.Millisecond) // its snapshot: about 0.4 s
	time.Sleep(50 * time.Millisecond)
	for i := range 5 {
		start := time.Now()
		if err := s.Add(context.Background(), fmt.Sprintf("uid-new%d", i), zds.WorkloadInfo{Name: "new"}, f); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > 100*time.Millisecond {
			t.Errorf("ADD during another ztunnel's snapshot took %v", took)
		}
	}
	s.Del(context.Background(), "uid-s19") // not sent to the slow one yet, most likely
	s.Del(context.Background(), "uid-s00") // sent to it already
	select {
	case <-slow.done:
	case <-time.After(5 * time.Second):
		t.Fatalf("no SnapshotSent; got %v", slow.got())
	}
	held := map[string]bool{}
	for _, e := range slow.got() {
		kind, uid, _ := strings.Cut(e, " ")
		switch kind {
		case zds.KindAdd.String(), zds.KindKeep.String():
			held[uid] = true
		case zds.KindDel.String():
			delete(held, uid)
		}
	}
	want := map[string]bool{}
	for _, uid := range s.Known() {
		want[uid] = true
	}
	if !maps.Equal(held, want) {
		t.Errorf("the new ztunnel registered holding %v, the server holds %v (it got %v)", held, want, slow.got())
	}
	if ready.Pod("uid-new0") == nil {
		t.Error("ADDs during the snapshot did not go to the ready ztunnel")
	}
	// Registered: the next ADD goes to it.
	if err := s.Add(context.Background(), "uid-last", zds.WorkloadInfo{Name: "last"}, f); err != nil {
		t.Fatal(err)
	}
	if g := slow.got(); g[len(g)-1] != zds.KindAdd.String()+" uid-last" {
		t.Errorf("the ADD after registration went elsewhere: %v", g[len(g)-3:])
	}
}

// A caller with a deadline (the agent answering the plugin) hears of a
// hung ztunnel before its own deadline, with ztunnel named: the ack wait
// ends a margin before the caller's deadline, not AckTimeout after the
// request. The Del of a pod goes the same way.
func TestAckWaitEndsBeforeTheCallersDeadline(t *testing.T) {
	s, path := serve(t) // AckTimeout as shipped, longer than the caller's time
	pod := testnet.NewNS(t, "nftzds")
	f := openNS(t, pod)
	healthy := ztunneltest.Connect(t, path)
	healthy.Wait(zds.KindSnapshotSent, "", wait)
	waitConnected(t, s, true)
	if err := s.Add(context.Background(), "uid-a", zds.WorkloadInfo{Name: "a"}, f); err != nil {
		t.Fatal(err)
	}
	hungZtunnel(t, path) // the newest now
	time.Sleep(50 * time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	err := s.Add(ctx, "uid-b", zds.WorkloadInfo{Name: "b"}, f)
	if ctx.Err() != nil {
		t.Errorf("the ack wait outlived the caller's deadline (AckTimeout %v)", s.AckTimeout)
	}
	if err == nil || !strings.Contains(err.Error(), "ztunnel did not ack AddWorkload uid-b") {
		t.Errorf("Add to a hung ztunnel: %v, want ztunnel named as not acking", err)
	}
	hungZtunnel(t, path)
	time.Sleep(50 * time.Millisecond)
	ctx, cancel = context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	s.Del(ctx, "uid-a")
	if ctx.Err() != nil {
		t.Errorf("Del outlived the caller's deadline (AckTimeout %v)", s.AckTimeout)
	}
	healthy.Wait(zds.KindDel, "uid-a", wait)
}

// What an idle ztunnel connection ends with is named: a hang-up as a
// hang-up, bytes ztunnel sent unasked (it only ever answers) as such.
func TestIdleConnectionEndNamed(t *testing.T) {
	for _, tc := range []struct {
		name string
		send []byte
		want string
	}{
		{"hang-up", nil, "ztunnel hung up"},
		{"garbage", []byte("\xde\xad\xbe\xef garbage"), "ztunnel sent 12 bytes unasked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log syncBuffer
			s, path := serveLogging(t, &log)
			uc := hungZtunnel(t, path) // hello and snapshot acked
			waitConnected(t, s, true)
			if tc.send != nil {
				if _, err := uc.Write(tc.send); err != nil {
					t.Fatal(err)
				}
			} else {
				uc.Close()
			}
			waitConnected(t, s, false)
			// The drop is logged after the connection is forgotten.
			for deadline := time.Now().Add(wait); !strings.Contains(log.String(), tc.want) && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
			if got := log.String(); !strings.Contains(got, tc.want) {
				t.Errorf("log says:\n%s\nwant %q", got, tc.want)
			}
		})
	}
}

// syncBuffer is a log sink the server writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
