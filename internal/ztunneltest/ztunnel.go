// Package ztunneltest is a stand-in for ztunnel in tests: it speaks ZDS
// from ztunnel's side (connect, hello, ack every request) and, for each
// pod it receives, enters the pod's netns through the received fd and opens
// listeners on 15001, 15006 and 15008 there with IP_TRANSPARENT and
// ztunnel's mark, as ztunnel does. A test proves capture end to end by
// dialling from the pod and seeing the connection land on these listeners.
//
// It encodes and decodes with Istio's own generated ZDS types
// (istio.io/istio/pkg/zdsapi, at the version go.mod pins), never with
// nftcni's codec, so that a mistake made the same way in both cannot pass.
package ztunneltest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/istio"
)

// maxMessage is ztunnel's limit for one ZDS message (src/inpod/protocol.rs).
const maxMessage = 1024

// Event is one request ztunnel received.
type Event struct {
	Kind zds.Kind
	UID  string
	Info *zds.WorkloadInfo
	FDs  int
}

// Pod is a workload ztunnel proxies for.
type Pod struct {
	UID                      string
	Info                     zds.WorkloadInfo
	Outbound, Inbound, HBONE net.Listener
	netns                    *os.File
}

func (p *Pod) close() {
	for _, l := range []net.Listener{p.Outbound, p.Inbound, p.HBONE} {
		if l != nil {
			l.Close()
		}
	}
	p.netns.Close()
}

// Ztunnel is one connection to the agent.
type Ztunnel struct {
	t      testing.TB
	uc     *net.UnixConn
	events chan Event
	done   chan struct{}

	mu     sync.Mutex
	pods   map[string]*Pod
	refuse map[string]string        // uid -> error to ack Add with
	stall  map[string]time.Duration // uid -> how long to hold Add's ack
	slow   time.Duration            // every ack waits this long
	seen   []Event                  // every request, in order
	// bare: ack Adds without opening listeners (the test listens itself).
	bare bool
}

// Connect dials the agent's ZDS socket (retrying for a while, as ztunnel
// does) and says hello; the connection closes at test cleanup.
func Connect(t testing.TB, path string) *Ztunnel {
	t.Helper()
	z, err := Dial(path, 5*time.Second)
	if err != nil {
		t.Fatalf("test ztunnel: %v", err)
	}
	z.t = t
	t.Cleanup(z.Close)
	return z
}

// ConnectBare is Connect for a ztunnel that takes each pod's netns and
// acks, but opens no listeners in it: the test's own listeners on 15001,
// 15006 and 15008 stand in for them.
func ConnectBare(t testing.TB, path string) *Ztunnel {
	t.Helper()
	z, err := dial(path, 5*time.Second, true)
	if err != nil {
		t.Fatalf("test ztunnel: %v", err)
	}
	z.t = t
	t.Cleanup(z.Close)
	return z
}

// Dial is Connect without a test: for the demo's ztunnel stub. Events
// are delivered on Events().
func Dial(path string, retry time.Duration) (*Ztunnel, error) { return dial(path, retry, false) }

func dial(path string, retry time.Duration, bare bool) (*Ztunnel, error) {
	var uc *net.UnixConn
	var err error
	for deadline := time.Now().Add(retry); ; time.Sleep(10 * time.Millisecond) {
		uc, err = net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", path, err)
	}
	z := &Ztunnel{uc: uc, events: make(chan Event, 1024), done: make(chan struct{}),
		pods: map[string]*Pod{}, refuse: map[string]string{}, stall: map[string]time.Duration{}, bare: bare}
	hello, err := proto.Marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	if err != nil {
		uc.Close()
		return nil, err
	}
	if _, err := uc.Write(hello); err != nil {
		uc.Close()
		return nil, err
	}
	go z.loop()
	return z, nil
}

// Events delivers every request as it is handled (the demo's log).
func (z *Ztunnel) Events() <-chan Event { return z.events }

// Done is closed when the agent hangs up.
func (z *Ztunnel) Done() <-chan struct{} { return z.done }

// Close hangs up and closes every pod's listeners.
func (z *Ztunnel) Close() {
	_ = z.uc.Close()
	<-z.done
	z.mu.Lock()
	defer z.mu.Unlock()
	for uid, p := range z.pods {
		p.close()
		delete(z.pods, uid)
	}
}

// Refuse makes the next Add of uid fail with msg.
func (z *Ztunnel) Refuse(uid, msg string) {
	z.mu.Lock()
	z.refuse[uid] = msg
	z.mu.Unlock()
}

// Stall makes ztunnel hold the ack of uid's next Add for d, as a hung or
// overloaded ztunnel does (it reads nothing else meanwhile).
func (z *Ztunnel) Stall(uid string, d time.Duration) {
	z.mu.Lock()
	z.stall[uid] = d
	z.mu.Unlock()
}

// SlowAcks makes ztunnel wait d before each ack from now on, as a loaded
// ztunnel does.
func (z *Ztunnel) SlowAcks(d time.Duration) {
	z.mu.Lock()
	z.slow = d
	z.mu.Unlock()
}

// Garbage sends the agent bytes it never asked for, which are no ZDS
// message ztunnel would send.
func (z *Ztunnel) Garbage() error {
	_, err := z.uc.Write([]byte("\x00\xffnot a WorkloadResponse"))
	return err
}

// HoldsNetns says whether ztunnel holds uid with the netns behind fd (a
// pod's re-created sandbox has the same UID and another netns).
func (z *Ztunnel) HoldsNetns(uid string, fd int) bool {
	z.mu.Lock()
	p := z.pods[uid]
	z.mu.Unlock()
	if p == nil {
		return false
	}
	var a, b unix.Stat_t
	if unix.Fstat(int(p.netns.Fd()), &a) != nil || unix.Fstat(fd, &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// Pod returns the workload for uid, or nil.
func (z *Ztunnel) Pod(uid string) *Pod {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.pods[uid]
}

// Seen lists every request received so far, in order.
func (z *Ztunnel) Seen() []Event {
	z.mu.Lock()
	defer z.mu.Unlock()
	return append([]Event(nil), z.seen...)
}

// UIDs lists the workloads ztunnel holds.
func (z *Ztunnel) UIDs() []string {
	z.mu.Lock()
	defer z.mu.Unlock()
	var out []string
	for uid := range z.pods {
		out = append(out, uid)
	}
	return out
}

// Wait returns the next event of kind for uid ("" = any), failing the
// test after timeout. Other events are dropped.
func (z *Ztunnel) Wait(kind zds.Kind, uid string, timeout time.Duration) Event {
	z.t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case e := <-z.events:
			if e.Kind == kind && (uid == "" || e.UID == uid) {
				return e
			}
		case <-deadline:
			z.t.Fatalf("test ztunnel: no %s for %q within %v", kind, uid, timeout)
			return Event{}
		}
	}
}

func (z *Ztunnel) loop() {
	defer close(z.done)
	for {
		buf := make([]byte, maxMessage)
		oob := make([]byte, unix.CmsgSpace(4*4))
		n, oobn, _, _, err := z.uc.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return
		}
		var fds []int
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for i := range msgs {
				if f, err := unix.ParseUnixRights(&msgs[i]); err == nil {
					fds = append(fds, f...)
				}
			}
		}
		msg := z.handle(buf[:n], fds)
		if r, err := decode(buf[:n]); err == nil && r.Kind == zds.KindAdd {
			z.mu.Lock()
			d := z.stall[r.UID]
			delete(z.stall, r.UID)
			z.mu.Unlock()
			time.Sleep(d)
		}
		z.mu.Lock()
		slow := z.slow
		z.mu.Unlock()
		time.Sleep(slow)
		ack, err := proto.Marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: msg}}})
		if err != nil {
			return
		}
		if _, err := z.uc.Write(ack); err != nil {
			return
		}
	}
}

// request is a WorkloadRequest as Istio's generated types decode it.
type request struct {
	Kind zds.Kind
	UID  string
	Info *zds.WorkloadInfo
}

func decode(b []byte) (*request, error) {
	var m zdsapi.WorkloadRequest
	if err := proto.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	switch p := m.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		r := &request{Kind: zds.KindAdd, UID: p.Add.GetUid()}
		if wi := p.Add.GetWorkloadInfo(); wi != nil {
			r.Info = &zds.WorkloadInfo{Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}
		}
		return r, nil
	case *zdsapi.WorkloadRequest_Keep:
		return &request{Kind: zds.KindKeep, UID: p.Keep.GetUid()}, nil
	case *zdsapi.WorkloadRequest_Del:
		return &request{Kind: zds.KindDel, UID: p.Del.GetUid()}, nil
	case *zdsapi.WorkloadRequest_SnapshotSent:
		return &request{Kind: zds.KindSnapshotSent}, nil
	}
	return nil, fmt.Errorf("a WorkloadRequest with no payload ztunnel knows (%d bytes)", len(b))
}

// handle applies one request and returns the ack's error text.
func (z *Ztunnel) handle(b []byte, fds []int) string {
	r, err := decode(b)
	if err != nil {
		closeFDs(fds)
		return err.Error()
	}
	// The event goes out once the request is applied, so a reader sees the
	// pod's listeners in place.
	defer func() {
		e := Event{Kind: r.Kind, UID: r.UID, Info: r.Info, FDs: len(fds)}
		z.mu.Lock()
		z.seen = append(z.seen, e)
		z.mu.Unlock()
		select {
		case z.events <- e:
		default: // nobody is reading: drop, never block the protocol
		}
	}()
	if (r.Kind == zds.KindAdd || r.Kind == zds.KindDel || r.Kind == zds.KindKeep) && r.UID == "" {
		closeFDs(fds)
		return "workload uid is required" // as ztunnel refuses it
	}
	if r.Kind != zds.KindAdd {
		closeFDs(fds)
		if len(fds) > 0 {
			return fmt.Sprintf("%s must not carry a descriptor", r.Kind)
		}
		if r.Kind == zds.KindDel {
			z.mu.Lock()
			if p := z.pods[r.UID]; p != nil {
				p.close()
				delete(z.pods, r.UID)
			}
			z.mu.Unlock()
		}
		return ""
	}
	if len(fds) != 1 {
		closeFDs(fds)
		return fmt.Sprintf("AddWorkload needs exactly one descriptor, got %d", len(fds))
	}
	z.mu.Lock()
	msg, refused := z.refuse[r.UID]
	delete(z.refuse, r.UID)
	z.mu.Unlock()
	netns := os.NewFile(uintptr(fds[0]), "netns-"+r.UID)
	if refused {
		netns.Close()
		return msg
	}
	p := &Pod{UID: r.UID, netns: netns}
	if r.Info != nil {
		p.Info = *r.Info
	}
	if !z.bare {
		if err := p.listen(); err != nil {
			p.close()
			return err.Error()
		}
	}
	z.mu.Lock()
	if old := z.pods[r.UID]; old != nil {
		old.close()
	}
	z.pods[r.UID] = p
	z.mu.Unlock()
	return ""
}

func closeFDs(fds []int) {
	for _, f := range fds {
		unix.Close(f)
	}
}

// listen opens ztunnel's three listeners inside the pod's netns as
// ztunnel does: on the thread handling the request, between a setns into
// the pod's netns and one back, with no thread or goroutine of its own.
func (p *Pod) listen() error {
	runtime.LockOSThread()
	host, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(host)
	if err := unix.Setns(int(p.netns.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering the pod's netns: %w", err)
	}
	err = p.listenHere()
	if rerr := unix.Setns(host, unix.CLONE_NEWNET); rerr != nil {
		// The thread stays locked to this goroutine, whose only new
		// sockets are made here, after a switch into a pod's netns.
		return errors.Join(err, fmt.Errorf("leaving the pod's netns: %w", rerr))
	}
	runtime.UnlockOSThread()
	return err
}

// listenHere opens the listeners in the calling thread's netns.
func (p *Pod) listenHere() error {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			for _, o := range [][3]int{
				{unix.SOL_IP, unix.IP_TRANSPARENT, 1},
				{unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1},
				{unix.SOL_SOCKET, unix.SO_MARK, int(istio.ZtunnelMark)},
				{unix.SOL_SOCKET, unix.SO_REUSEPORT, 1},
			} {
				if e := unix.SetsockoptInt(int(fd), o[0], o[1], o[2]); e != nil && serr == nil && o[1] != unix.IPV6_TRANSPARENT {
					serr = e
				}
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	var err error
	if p.Outbound, err = lc.Listen(context.Background(), "tcp", "[::]:15001"); err != nil {
		return err
	}
	if p.Inbound, err = lc.Listen(context.Background(), "tcp", "[::]:15006"); err != nil {
		return err
	}
	p.HBONE, err = lc.Listen(context.Background(), "tcp", "[::]:15008")
	return err
}
