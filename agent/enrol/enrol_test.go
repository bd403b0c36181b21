package enrol

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/google/nftables"
	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/agent/procscan"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// These tests drive the state machine with fakes for everything it talks
// to (rules, ztunnel, probe set, annotator, plugin) and a real records dir;
// the "netns" is a plain file, so they need no root. Real netns, real
// nf_tables and real traffic are the integration tests' job.

// trail is the ordered list of calls every fake appends to.
type trail struct {
	mu    sync.Mutex
	calls []string
}

func (l *trail) add(format string, args ...any) {
	l.mu.Lock()
	l.calls = append(l.calls, fmt.Sprintf(format, args...))
	l.mu.Unlock()
}

func (l *trail) has(call string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Contains(l.calls, call)
}

func (l *trail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.calls, "; ")
}

func (l *trail) reset() {
	l.mu.Lock()
	l.calls = nil
	l.mu.Unlock()
}

// fakeRules is nft's Fake, with each call on the trail.
type fakeRules struct {
	*nft.Fake
	l         *trail
	removeErr error // Remove fails with it, when set
}

func (r *fakeRules) Program(fd int, b *nft.Batch) error {
	r.l.add("rules.Program")
	return r.Fake.Program(fd, b)
}
func (r *fakeRules) Remove(fd int) error {
	r.l.add("rules.Remove")
	if r.removeErr != nil {
		return r.removeErr
	}
	return r.Fake.Remove(fd)
}

// istioNat is istio-cni's iptables backend's state as a survey finds it.
func istioNat() *nft.IstioState {
	return &nft.IstioState{Tables: []nft.TableRef{{Family: nftables.TableFamilyIPv4, Name: "nat"}}}
}

func (r *fakeRules) TakeOver(fd int, b *nft.Batch) ([]string, error) {
	r.l.add("rules.TakeOver")
	return r.Fake.TakeOver(fd, b)
}
func (r *fakeRules) Check(fd int, rs *nft.Ruleset, gen uint32) (uint32, error) {
	r.l.add("rules.Check")
	return r.Fake.Check(fd, rs, gen)
}

type fakeZtunnel struct {
	l      *trail
	addErr error
	away   atomic.Bool // no ztunnel connected: Accepting is false
	mu     sync.Mutex
	held   map[string]bool
}

func (z *fakeZtunnel) Accepting() bool { return !z.away.Load() }

func (z *fakeZtunnel) StartAdd(ctx context.Context, uid string, info zds.WorkloadInfo, netns *os.File) func() error {
	z.l.add("zt.Add %s", uid)
	return func() error { // the ack
		z.l.add("zt.ack %s", uid)
		if z.addErr != nil {
			return z.addErr
		}
		z.mu.Lock()
		z.held[uid] = true
		z.mu.Unlock()
		return nil
	}
}
func (z *fakeZtunnel) Track(uid string, info zds.WorkloadInfo, netns *os.File) {
	z.l.add("zt.Track %s", uid)
	z.mu.Lock()
	z.held[uid] = true
	z.mu.Unlock()
}
func (z *fakeZtunnel) Del(_ context.Context, uid string) {
	z.l.add("zt.Del %s", uid)
	z.mu.Lock()
	delete(z.held, uid)
	z.mu.Unlock()
}
func (z *fakeZtunnel) Holds(uid string) bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.held[uid]
}
func (z *fakeZtunnel) State(uid string) string { return "" }

type fakeProbes struct {
	l      *trail
	addErr error
	mu     sync.Mutex
	held   map[string]bool // by UID
}

func (p *fakeProbes) Add(uid string, ips []netip.Addr) error {
	p.l.add("probes.Add %s %v", uid, ips)
	if p.addErr == nil {
		p.mu.Lock()
		p.held[uid] = true
		p.mu.Unlock()
	}
	return p.addErr
}
func (p *fakeProbes) Remove(uid string, ips []netip.Addr) error {
	p.l.add("probes.Remove %s %v", uid, ips)
	p.mu.Lock()
	delete(p.held, uid)
	p.mu.Unlock()
	return nil
}

func (p *fakeProbes) holds(uid string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[uid]
}

type fakeAnnotator struct {
	l     *trail
	store *podsource.Store
	fails int           // the next calls that fail (the API server unreachable)
	delay time.Duration // each call's round trip
}

func (a *fakeAnnotator) SetRedirection(ctx context.Context, namespace, name, state string) error {
	time.Sleep(a.delay)
	if a.fails > 0 {
		a.fails--
		a.l.add("annotate %s/%s=%q failed", namespace, name, state)
		return errors.New("apiserver: connection refused")
	}
	a.l.add("annotate %s/%s=%q", namespace, name, state)
	if kp := a.store.Pod(namespace, name); kp != nil { // as the informer would see it
		kp = kp.DeepCopy()
		if state == "" {
			delete(kp.Annotations, istio.AnnRedirection)
		} else {
			if kp.Annotations == nil {
				kp.Annotations = map[string]string{}
			}
			kp.Annotations[istio.AnnRedirection] = state
		}
		a.store.PutPod(kp)
	}
	return nil
}

// fakePlugin is the plugin's end of an ADD: it writes the decision's
// batch into the pod's netns (the rig's nft Fake), as the plugin does,
// unless its outcome is a failure.
type fakePlugin struct {
	l          *trail
	decided    *wire.Verdict
	batch      *nft.Batch
	outcomeErr error
	rules      *nft.Fake
	netns      *os.File
}

func (p *fakePlugin) Decide(d *wire.Verdict, b *nft.Batch) error {
	p.l.add("plugin.Decide %s", d.Mode)
	p.decided, p.batch = d, b
	return nil
}
func (p *fakePlugin) Ready(err error) {
	if err != nil {
		p.l.add("plugin.Ready error")
		return
	}
	p.l.add("plugin.Ready done")
}
func (p *fakePlugin) Outcome() (*wire.Timings, error) {
	p.l.add("plugin.Outcome")
	if p.outcomeErr == nil && p.batch != nil {
		if err := p.rules.Program(int(p.netns.Fd()), p.batch); err != nil {
			return nil, err
		}
	}
	return &wire.Timings{}, p.outcomeErr
}

// fakeFinder finds pods' netns through "/proc": a file per pod UID.
type fakeFinder struct {
	l     *trail
	netns map[string]*os.File
	fail  map[string]error // by UID: the scan itself fails
}

func (f *fakeFinder) Find(uid string, ips []netip.Addr) (*os.File, error) {
	f.l.add("find %s", uid)
	if err := f.fail[uid]; err != nil {
		return nil, err
	}
	n, ok := f.netns[uid]
	if !ok {
		return nil, fmt.Errorf("%w (uid %s)", procscan.ErrNotFound, uid) // as procscan says it
	}
	return os.Open(n.Name()) // the Enroller owns what Find returns
}

type rig struct {
	t         *testing.T
	annotator *fakeAnnotator
	l         *trail
	store     *podsource.Store
	rules     *fakeRules
	zt        *fakeZtunnel
	runDir    string
	records   *records.Dir
	e         *Enroller
	netns     map[string]*os.File // by pod name: the file standing in for its netns
	finder    *fakeFinder
	probes    *fakeProbes
}

func newRig(t *testing.T) *rig {
	t.Helper()
	l := &trail{}
	r := &rig{t: t, l: l, store: podsource.NewStore(), rules: &fakeRules{Fake: nft.NewFake(), l: l},
		zt: &fakeZtunnel{l: l, held: map[string]bool{}}, runDir: t.TempDir(), netns: map[string]*os.File{},
		finder: &fakeFinder{l: l, netns: map[string]*os.File{}}, probes: &fakeProbes{l: l, held: map[string]bool{}}}
	var err error
	if r.records, err = records.Open(r.runDir); err != nil {
		t.Fatal(err)
	}
	r.e = r.enroller()
	t.Cleanup(func() { r.e.Close() })
	return r
}

// enroller is a new agent on the rig's state (a restart when called again).
func (r *rig) enroller() *Enroller {
	pol, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		r.t.Fatal(err)
	}
	r.annotator = &fakeAnnotator{l: r.l, store: r.store}
	return New(Options{Policy: pol, Store: r.store, Rules: r.rules, Ztunnel: r.zt, Probes: r.probes,
		Records: r.records, Annotator: r.annotator, Finder: r.finder, LookupRetries: -1})
}

func (r *rig) namespace(name string, ambient bool) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if ambient {
		ns.Labels[istio.LabelDataplaneMode] = istio.DataplaneAmbient
	}
	r.store.PutNamespace(ns)
}

func (r *rig) pod(ns, name, uid, ip string) *corev1.Pod {
	kp := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid)},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip}}
	r.store.PutPod(kp)
	return kp
}

// sandbox is a pod's ADD arguments, with a plain file standing in for the
// netns (the fakes never enter it).
func (r *rig) sandbox(ns, name, uid, ip string) (*wire.Pod, *os.File) {
	path := filepath.Join(r.t.TempDir(), "netns")
	f, err := os.Create(path)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { f.Close() })
	r.netns[name] = f
	return &wire.Pod{Namespace: ns, Name: name, UID: uid, Netns: path, IPs: []string{ip + "/32"},
		Attachment: wire.Attachment{ContainerID: "c-" + name, IfName: "eth0"}}, f
}

func (r *rig) add(wp *wire.Pod, netns *os.File, pl *fakePlugin) error {
	pl.rules, pl.netns = r.rules.Fake, netns
	return r.e.Add(context.Background(), wp, netns, pl)
}

// addA runs the ADD of the tests' usual pod, mesh/a (uid-a, 10.0.0.5),
// put in the store and given a sandbox first; pl nil: a plugin whose
// outcome succeeds.
func (r *rig) addA(pl *fakePlugin) error {
	r.pod("mesh", "a", "uid-a", "10.0.0.5")
	wp, ns := r.sandbox("mesh", "a", "uid-a", "10.0.0.5")
	if pl == nil {
		pl = &fakePlugin{l: r.l}
	}
	return r.add(wp, ns, pl)
}

// dump is what pod name's netns holds, as nft would list it.
func (r *rig) dump(name string) string { return r.rules.Dump(int(r.netns[name].Fd())) }

// ambientRules is the ruleset the default policy gives an ambient pod
// with an IPv4 address, as nft would list it.
func (r *rig) ambientRules() string {
	r.t.Helper()
	b, err := nft.Encode(capture.Ambient(capture.AmbientSpec{DNSCapture: true, IPv6: false}))
	if err != nil {
		r.t.Fatal(err)
	}
	f := nft.NewFake()
	tmp, err := os.CreateTemp(r.t.TempDir(), "netns")
	if err != nil {
		r.t.Fatal(err)
	}
	defer tmp.Close()
	if err := f.Program(int(tmp.Fd()), b); err != nil {
		r.t.Fatal(err)
	}
	return f.Dump(int(tmp.Fd()))
}

func (r *rig) members() []string {
	var out []string
	for _, m := range r.e.Members() {
		out = append(out, fmt.Sprintf("%s %s %s", m.Pod.Key(), m.Mode, m.UID))
	}
	return out
}

func (r *rig) expect(calls ...string) {
	r.t.Helper()
	for _, c := range calls {
		if !r.l.has(c) {
			r.t.Errorf("missing call %q; calls: %s", c, r.l)
		}
	}
}

func (r *rig) expectNot(calls ...string) {
	r.t.Helper()
	for _, c := range calls {
		if r.l.has(c) {
			r.t.Errorf("unexpected call %q; calls: %s", c, r.l)
		}
	}
}

func (r *rig) recorded() map[string]wire.Mode {
	recs, bad, err := records.Read(r.runDir)
	if err != nil || len(bad) > 0 {
		r.t.Fatalf("reading records: %v %v", err, bad)
	}
	out := map[string]wire.Mode{}
	for _, rec := range recs {
		out[rec.Pod.Key()] = rec.Decision.Mode
	}
	return out
}

func TestAddEnrolsAmbientPodInOrder(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	pl := &fakePlugin{l: r.l}
	if err := r.addA(pl); err != nil {
		t.Fatal(err)
	}
	if pl.decided.Mode != wire.ModeAmbient || pl.batch == nil {
		t.Fatalf("plugin got %+v, batch %v; want ambient with a batch", pl.decided, pl.batch)
	}
	r.expect("plugin.Decide ambient", "plugin.Ready done", "plugin.Outcome", "zt.Add uid-a", "probes.Add uid-a [10.0.0.5]", `annotate mesh/a="enabled"`)
	r.expectNot("rules.Program") // the plugin programs at ADD, not the agent
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns after ADD:\n%s\nwant:\n%s", got, want)
	}
	// The plugin hears that the agent's part is done once ztunnel and the
	// probe set are, and before its outcome is read; the annotation comes
	// after every step.
	at := func(call string) int { return slices.Index(r.l.calls, call) }
	ready := at("plugin.Ready done")
	if ready < at("zt.Add uid-a") || ready < at("probes.Add uid-a [10.0.0.5]") || ready > at("plugin.Outcome") ||
		r.l.calls[len(r.l.calls)-1] != `annotate mesh/a="enabled"` {
		t.Errorf("order: %s", r.l)
	}
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) {
		t.Errorf("members %v", got)
	}
	if got := r.recorded(); got["mesh/a"] != wire.ModeAmbient {
		t.Errorf("records %v", got)
	}
}

// The "pod enrolled" line tells what the ADD waited on the agent for
// (ready_ms) apart from the annotation's PATCH, which it does not wait
// for (in done_ms only).
func TestEnrolledLogSplitsTheWaitFromTheAnnotation(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	var out strings.Builder
	r.e.log = slog.New(slog.NewTextHandler(&out, nil))
	const patch = 200 * time.Millisecond
	r.annotator.delay = patch
	if err := r.addA(&fakePlugin{l: r.l}); err != nil {
		t.Fatal(err)
	}
	field := func(name string) float64 {
		_, v, ok := strings.Cut(out.String(), " "+name+"=")
		f, err := strconv.ParseFloat(strings.Fields(v + " ")[0], 64)
		if !ok || err != nil {
			t.Fatalf("no %s in the log: %s", name, out.String())
		}
		return f
	}
	if ready, done := field("ready_ms"), field("done_ms"); ready >= float64(patch.Milliseconds()) || done < float64(patch.Milliseconds()) || ready > done {
		t.Errorf("ready_ms=%v done_ms=%v with a %v PATCH: want ready_ms without it, done_ms with it", ready, done, patch)
	}
}

// A pod to enrol while no ztunnel is connected (as after a reboot, before
// ztunnel's pod is back) is refused for now, before anything is decided to
// the plugin or programmed: the error tells the plugin to ask again
// (events.ErrTryAgain) and names the cause. Once ztunnel is back the same
// ADD enrols it. A pod outside the mesh does not wait for ztunnel.
func TestAddAsksAgainWhileNoZtunnel(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.zt.away.Store(true)
	err := r.addA(&fakePlugin{l: r.l})
	if !errors.Is(err, events.ErrTryAgain) || !errors.Is(err, zds.ErrNoZtunnel) {
		t.Fatalf("ADD with no ztunnel: %v, want ErrTryAgain and ErrNoZtunnel", err)
	}
	r.expectNot("plugin.Decide ambient", "zt.Add uid-a", "probes.Add uid-a [10.0.0.5]", "rules.Program")
	if got := r.members(); len(got) != 0 {
		t.Errorf("members after the refusal: %v", got)
	}
	r.zt.away.Store(false)
	if err := r.addA(&fakePlugin{l: r.l}); err != nil {
		t.Fatalf("ADD once ztunnel is back: %v", err)
	}
	r.expect("plugin.Decide ambient", "zt.Add uid-a", `annotate mesh/a="enabled"`)

	o := newRig(t)
	o.namespace("plain", false)
	o.zt.away.Store(true)
	pl := &fakePlugin{l: o.l}
	o.pod("plain", "b", "uid-b", "10.0.0.6")
	wp, ns := o.sandbox("plain", "b", "uid-b", "10.0.0.6")
	if err := o.add(wp, ns, pl); err != nil || pl.decided.Mode != wire.ModeNone {
		t.Errorf("ADD outside the mesh with no ztunnel: %v, decided %+v", err, pl.decided)
	}
}

func TestFailedStepUndoesTheEnrolment(t *testing.T) {
	for _, tc := range []struct {
		name    string
		setup   func(*rig, *fakePlugin)
		undo    []string
		notUndo []string
	}{
		{"plugin could not program", func(r *rig, p *fakePlugin) { p.outcomeErr = errors.New("netlink: EPERM") },
			[]string{"plugin.Ready done", "zt.Del uid-a", "probes.Remove uid-a [10.0.0.5]", "rules.Remove"}, nil},
		{"ztunnel refused", func(r *rig, p *fakePlugin) { r.zt.addErr = errors.New("ztunnel: nack") },
			[]string{"plugin.Ready error", "plugin.Outcome", "probes.Remove uid-a [10.0.0.5]", "rules.Remove"}, []string{"zt.Del uid-a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.namespace("mesh", true)
			pl := &fakePlugin{l: r.l}
			tc.setup(r, pl)
			if err := r.addA(pl); err == nil {
				t.Fatal("ADD succeeded")
			}
			r.expect(tc.undo...)
			r.expectNot(tc.notUndo...)
			r.expectNot(`annotate mesh/a="enabled"`)
			if got := r.members(); len(got) != 0 {
				t.Errorf("members after a failed ADD: %v", got)
			}
			if r.zt.Holds("uid-a") {
				t.Error("ztunnel still holds the pod")
			}
			if got := r.recorded(); got["mesh/a"] == wire.ModeAmbient {
				t.Errorf("recorded as enrolled after a failed ADD: %v", got)
			}
		})
	}
}

// The annotation reports a capture, it does not make one: when the API
// server cannot be reached the pod stays captured (the plugin has told the
// runtime so), and the annotation is written at the next verification
// pass.
func TestAnnotationFailureKeepsTheCapture(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.annotator.fails = 1
	if err := r.addA(nil); err != nil {
		t.Fatalf("ADD failed for want of an annotation: %v", err)
	}
	r.expect(`annotate mesh/a="enabled" failed`, "plugin.Ready done")
	r.expectNot("zt.Del uid-a", "rules.Remove", "probes.Remove uid-a [10.0.0.5]")
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) || !r.zt.Holds("uid-a") || r.dump("a") != r.ambientRules() {
		t.Fatalf("after the failed annotation: members %v, ztunnel holds %v, rules:\n%s", got, r.zt.Holds("uid-a"), r.dump("a"))
	}
	r.e.VerifyPass(context.Background(), 1)
	r.expect(`annotate mesh/a="enabled"`)
	if kp := r.store.Pod("mesh", "a"); kp.Annotations[istio.AnnRedirection] != RedirectionEnabled {
		t.Errorf("annotation after the verification pass: %v", kp.Annotations)
	}
}

func TestPodWithoutUIDIsNeverSentToZtunnel(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.pod("mesh", "a", "", "10.0.0.5")
	wp, ns := r.sandbox("mesh", "a", "", "10.0.0.5")
	err := r.add(wp, ns, &fakePlugin{l: r.l})
	if err == nil || !strings.Contains(err.Error(), "no UID") {
		t.Fatalf("ADD of a pod without UID: %v", err)
	}
	for _, c := range r.l.calls {
		if strings.HasPrefix(c, "zt.") || strings.HasPrefix(c, "plugin.Decide ambient") {
			t.Errorf("pod without UID reached %q", c)
		}
	}
}

func TestDelOfUnknownPodSendsNoDel(t *testing.T) {
	r := newRig(t)
	wp, _ := r.sandbox("mesh", "ghost", "", "10.0.0.9")
	if err := r.e.Del(context.Background(), wp, nil); err != nil {
		t.Fatal(err)
	}
	wp.UID = "uid-ghost"
	if err := r.e.Del(context.Background(), wp, nil); err != nil {
		t.Fatal(err)
	}
	r.expectNot("zt.Del ", "zt.Del mesh/ghost", "zt.Del uid-ghost") // ztunnel never held it
	// One ztunnel holds without a tracked attachment (adopted, no record):
	// the DEL lets it go, by its real UID.
	r.zt.held["uid-ghost"] = true
	if err := r.e.Del(context.Background(), wp, nil); err != nil {
		t.Fatal(err)
	}
	r.expect("zt.Del uid-ghost")
}

// The agent removes a pod's rules at DEL through the descriptor the
// plugin hands over, tracked pod or not; with no descriptor (netns gone)
// there is nothing to remove.
func TestDelRemovesTheRulesThroughTheHandedNetns(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	if r.dump("a") == "" {
		t.Fatal("the ADD left no rules to remove")
	}
	wp, _ := r.sandbox("mesh", "a", "uid-a", "10.0.0.5")
	wp.Netns = ""
	if err := r.e.Del(context.Background(), wp, r.netns["a"]); err != nil {
		t.Fatal(err)
	}
	if got := r.dump("a"); got != "" {
		t.Errorf("rules left after DEL:\n%s", got)
	}
	r.expect("zt.Del uid-a")
	if len(r.e.Members()) != 0 {
		t.Errorf("the agent still tracks %v", r.e.Members())
	}

	// A pod the agent never saw (a restart lost it): its rules still go.
	ghost, ns := r.sandbox("mesh", "ghost", "uid-ghost", "10.0.0.9")
	b, err := nft.Encode(capture.Ambient(capture.AmbientSpec{DNSCapture: true}))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.rules.Fake.Program(int(ns.Fd()), b); err != nil {
		t.Fatal(err)
	}
	if err := r.e.Del(context.Background(), ghost, ns); err != nil {
		t.Fatal(err)
	}
	if got := r.dump("ghost"); got != "" {
		t.Errorf("rules of an untracked pod left after DEL:\n%s", got)
	}
}

// A removal that fails at DEL is the DEL's error (the plugin then removes
// the rules itself), and the pod is released all the same.
func TestDelReleasesThePodWhenTheRemovalFails(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.rules.removeErr = errors.New("netlink says no")
	wp, _ := r.sandbox("mesh", "a", "uid-a", "10.0.0.5")
	err := r.e.Del(context.Background(), wp, r.netns["a"])
	if err == nil || !strings.Contains(err.Error(), "netlink says no") {
		t.Fatalf("DEL whose removal fails: %v", err)
	}
	r.expect("zt.Del uid-a")
	if len(r.e.Members()) != 0 {
		t.Errorf("the agent still tracks %v", r.e.Members())
	}
}

func TestPodGoneFromSourceIsReleased(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.l.reset()
	r.store.DeletePod("mesh", "a")
	if err := r.e.ReconcileAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The rules go too: a pod whose ztunnel is gone but whose rules stay
	// is black-holed.
	r.expect("rules.Remove", "zt.Del uid-a", "probes.Remove uid-a [10.0.0.5]")
	if got := r.dump("a"); got != "" {
		t.Errorf("rules left in the released pod's netns:\n%s", got)
	}
	if got := r.members(); len(got) != 0 {
		t.Errorf("members %v", got)
	}
	if got := r.recorded(); len(got) != 0 {
		t.Errorf("records left %v", got)
	}
}

func TestLateEnrolmentAndUnenrolment(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", false)
	pl := &fakePlugin{l: r.l}
	if err := r.addA(pl); err != nil {
		t.Fatal(err)
	}
	if pl.decided.Mode != wire.ModeNone {
		t.Fatalf("decision %s in a plain namespace", pl.decided.Mode)
	}
	r.expectNot("plugin.Outcome", "zt.Add uid-a")
	if got := r.recorded(); got["mesh/a"] != wire.ModeNone {
		t.Fatalf("a known pod is recorded, not enrolled: %v", got)
	}

	r.namespace("mesh", true)
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	r.expect("rules.Program", "zt.Add uid-a", `annotate mesh/a="enabled"`) // the agent programs, with the netns it kept
	// A running pod's traffic is redirected only once ztunnel listens.
	if ack, prog := slices.Index(r.l.calls, "zt.ack uid-a"), slices.Index(r.l.calls, "rules.Program"); ack < 0 || prog < ack {
		t.Errorf("rules programmed before ztunnel's ack: %s", r.l)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns after late enrolment:\n%s\nwant:\n%s", got, want)
	}
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) {
		t.Fatalf("members %v", got)
	}

	r.l.reset()
	r.namespace("mesh", false)
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	r.expect("rules.Remove", "zt.Del uid-a", `annotate mesh/a=""`)
	if got := r.dump("a"); got != "" {
		t.Errorf("rules left after unenrolment:\n%s", got)
	}
	if got := r.members(); len(got) != 0 {
		t.Errorf("members %v", got)
	}
	in := r.e.Inspect(&wire.Pod{UID: "uid-a"})
	if in.Drift != "" || in.Repairs != 0 {
		t.Errorf("inspect of an unenrolled pod: %+v", in)
	}
}

func TestLateEnrolmentFailureLeavesPodAsItWas(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", false)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.namespace("mesh", true)
	r.rules.ProgramErr = errors.New("netlink: ENOBUFS")
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err == nil {
		t.Fatal("late enrolment succeeded with rules that failed")
	}
	r.expect("zt.Del uid-a", "rules.Remove")
	r.expectNot(`annotate mesh/a="enabled"`)
	if r.zt.Holds("uid-a") || len(r.members()) != 0 || r.dump("a") != "" {
		t.Errorf("half-enrolled: ztunnel %v, members %v, rules %q", r.zt.Holds("uid-a"), r.members(), r.dump("a"))
	}
	// Once the rules can be programmed, the next reconcile enrols it.
	r.rules.ProgramErr = nil
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	if got := r.members(); len(got) != 1 || r.dump("a") != r.ambientRules() {
		t.Errorf("members %v, rules %q", got, r.dump("a"))
	}
}

func TestRestartRestoresWithoutTouchingRules(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.e.Close()
	r.l.reset()
	r.e = r.enroller()
	n, err := r.e.Restore(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n.Restored != 1 {
		t.Fatalf("restored %+v", n)
	}
	// ztunnel gets it in its first snapshot; the rules the previous agent
	// programmed are left alone (the verifier checks them next).
	r.expect("zt.Track uid-a")
	r.expectNot("zt.Add uid-a", "rules.Program", "rules.Remove")
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) {
		t.Errorf("members %v", got)
	}
	checked, repaired := r.e.VerifyPass(context.Background(), 1)
	if checked != 1 || repaired != 0 {
		t.Errorf("verify pass: checked %d repaired %d", checked, repaired)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns after the restart:\n%s\nwant:\n%s", got, want)
	}

	// Rules lost while no agent ran (someone deleted the table) are put
	// back by the new agent's first pass.
	r.e.Close()
	r.rules.Tamper(int(r.netns["a"].Fd()), nil)
	r.e = r.enroller()
	if _, err := r.e.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if checked, repaired := r.e.VerifyPass(context.Background(), 1); checked != 1 || repaired != 1 {
		t.Errorf("verify pass after a restart over a deleted table: checked %d repaired %d", checked, repaired)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns after the restart's repair:\n%s\nwant:\n%s", got, want)
	}
}

func TestVerifyRepairsDrift(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.l.reset()
	// A check that could not look is not drift: nothing is rewritten.
	r.rules.CheckErr = errors.New("netlink: EINTR")
	if checked, repaired := r.e.VerifyPass(context.Background(), 1); checked != 0 || repaired != 0 {
		t.Fatalf("verify pass that could not look: checked %d repaired %d", checked, repaired)
	}
	r.expectNot("rules.Program")
	r.rules.CheckErr = nil
	// Someone flushes a chain of the pod's table: the next pass puts the
	// whole ruleset back and says which rule was missing.
	r.rules.Tamper(int(r.netns["a"].Fd()), func(rs *nft.Ruleset) { rs.Tables[0].Chains[0].Rules = nil })
	checked, repaired := r.e.VerifyPass(context.Background(), 1)
	if checked != 1 || repaired != 1 {
		t.Fatalf("verify pass: checked %d repaired %d", checked, repaired)
	}
	r.expect("rules.Check", "rules.Program")
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns after the repair:\n%s\nwant:\n%s", got, want)
	}
	in := r.e.Inspect(&wire.Pod{UID: "uid-a"})
	if in.Repairs != 1 || !strings.Contains(in.Drift, "line ") {
		t.Errorf("inspect after a repair: %+v", in)
	}
	// The next pass finds it intact.
	if checked, repaired := r.e.VerifyPass(context.Background(), 1); checked != 1 || repaired != 0 {
		t.Errorf("verify pass after the repair: checked %d repaired %d", checked, repaired)
	}
}

// running is a pod that started before this agent saw it (no ADD, no
// record): its netns is found through /proc.
func (r *rig) running(ns, name, uid, ip string, annotations map[string]string) *corev1.Pod {
	kp := r.pod(ns, name, uid, ip)
	kp.Annotations = annotations
	r.store.PutPod(kp)
	_, f := r.sandbox(ns, name, uid, ip)
	r.finder.netns[uid] = f
	return kp
}

// Pods a previous agent (or Istio's) enrolled, whose records are gone:
// an annotated ambient pod is adopted through /proc with its ruleset put
// in place; an annotated pod no longer selected loses its rules and its
// annotation; one whose netns cannot be found stays in ztunnel's snapshot.
func TestAdoptionThroughProc(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.namespace("plain", false)
	enabled := map[string]string{istio.AnnRedirection: "enabled"}
	r.running("mesh", "a", "uid-a", "10.0.0.5", enabled)
	r.running("plain", "b", "uid-b", "10.0.0.6", enabled)
	r.pod("mesh", "c", "uid-c", "10.0.0.7").Annotations = enabled // no netns anywhere
	// b still holds a ruleset from before.
	b, err := nft.Encode(capture.Ambient(capture.AmbientSpec{DNSCapture: true}))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.rules.Fake.Program(int(r.netns["b"].Fd()), b); err != nil {
		t.Fatal(err)
	}

	adopted, kept, cleared := r.e.AdoptAnnotated(context.Background())
	if adopted != 1 || kept != 1 || cleared != 1 {
		t.Fatalf("adopted %d kept %d cleared %d, want 1 1 1", adopted, kept, cleared)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the adopted pod's netns:\n%s\nwant:\n%s", got, want)
	}
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) {
		t.Errorf("members %v", got)
	}
	r.expect("zt.Track uid-a", "zt.Track uid-c", `annotate plain/b=""`)
	if got := r.dump("b"); got != "" {
		t.Errorf("rules left on a pod no longer selected:\n%s", got)
	}
}

// After a reboot no annotated pod has a netns: each is kept in ztunnel's
// snapshot, counted in the restore's summary, and not warned of one by
// one (a rebooted node with 100 pods logged 100 warnings). A /proc scan
// that fails is still a warning.
func TestAdoptionAfterARebootWarnsOnlyOfFailedScans(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	enabled := map[string]string{istio.AnnRedirection: "enabled"}
	for _, name := range []string{"a", "b", "c"} {
		r.pod("mesh", name, "uid-"+name, "10.0.0.5").Annotations = enabled // its sandbox gone with the reboot
	}
	r.finder.fail = map[string]error{"uid-c": os.ErrPermission}
	var out strings.Builder
	r.e.log = slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))

	if _, kept, _ := r.e.AdoptAnnotated(context.Background()); kept != 3 {
		t.Fatalf("kept %d, want 3", kept)
	}
	var warned, debugged []string
	for _, line := range strings.Split(out.String(), "\n") {
		if !strings.Contains(line, "netns was not found") {
			continue
		}
		_, pod, _ := strings.Cut(line, " pod=")
		pod = strings.Fields(pod)[0]
		switch {
		case strings.Contains(line, "level=WARN"):
			warned = append(warned, pod)
		case strings.Contains(line, "level=DEBUG"):
			debugged = append(debugged, pod)
		}
	}
	slices.Sort(warned)
	slices.Sort(debugged)
	if !slices.Equal(warned, []string{"mesh/c"}) || !slices.Equal(debugged, []string{"mesh/a", "mesh/b"}) {
		t.Errorf("warned of %v, at debug %v; want the failed scan (mesh/c) warned, the gone sandboxes at debug:\n%s", warned, debugged, out.String())
	}
}

// A running pod that was never ADDed through nftcni (it started before
// the plugin was installed) is enrolled once its namespace is labelled,
// its netns found through /proc.
func TestLateEnrolmentThroughProc(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", false)
	r.running("mesh", "a", "uid-a", "10.0.0.5", nil)
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	if r.dump("a") != "" || len(r.members()) != 0 {
		t.Fatal("a pod of an unlabelled namespace was enrolled")
	}
	r.namespace("mesh", true)
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	r.expect("find uid-a", "rules.Program", "zt.Add uid-a", `annotate mesh/a="enabled"`)
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("the pod's netns:\n%s\nwant:\n%s", got, want)
	}
	if n := testutil.ToFloat64(r.e.metrics.OutsideChain); n != 0 {
		t.Errorf("a pod that started before the agent counted as started outside the chain: %v", n)
	}

	// A pod that started while this agent ran and that no ADD brought is
	// one whose runtime ran a chain without our entry: counted (and
	// logged as a warning), then enrolled as any other.
	kp := r.running("mesh", "b", "uid-b", "10.0.0.6", nil)
	kp.Status.StartTime = &metav1.Time{Time: time.Now()}
	r.store.PutPod(kp)
	if err := r.e.Reconcile(context.Background(), "mesh", "b"); err != nil {
		t.Fatal(err)
	}
	r.expect("zt.Add uid-b")
	if n := testutil.ToFloat64(r.e.metrics.OutsideChain); n != 1 {
		t.Errorf("pods counted as started outside the chain: %v, want 1", n)
	}
}

// A pod istio-cni enrolled (annotated, its rules in its netns, no record
// of ours) is taken over: Istio's rules replaced by ours in one step, in
// ztunnel's first snapshot. One with someone else's rules beside Istio's is
// left exactly as it is, its annotation kept, and still in the snapshot.
func TestHandoverFromIstio(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	enabled := map[string]string{istio.AnnRedirection: "enabled"}
	r.running("mesh", "a", "uid-a", "10.0.0.5", enabled)
	r.running("mesh", "b", "uid-b", "10.0.0.6", enabled)
	r.rules.PlantIstio(int(r.netns["a"].Fd()), istioNat())
	r.rules.PlantIstio(int(r.netns["b"].Fd()), &nft.IstioState{Tables: istioNat().Tables, Unknown: []string{"table ip filter (3 rules)"}})

	adopted, kept, cleared := r.e.AdoptAnnotated(context.Background())
	if adopted != 1 || kept != 1 || cleared != 0 {
		t.Fatalf("adopted %d kept %d cleared %d, want 1 1 0", adopted, kept, cleared)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want || r.rules.Istio(int(r.netns["a"].Fd())) != nil {
		t.Errorf("the taken-over pod's netns:\n%s\nwant only ours:\n%s (Istio's left: %v)", got, want, r.rules.Istio(int(r.netns["a"].Fd())))
	}
	r.expect("rules.TakeOver", "zt.Track uid-a", "zt.Track uid-b")
	r.expectNot(`annotate mesh/b=""`, "rules.Remove")
	if r.dump("b") != "" || r.rules.Istio(int(r.netns["b"].Fd())) == nil {
		t.Errorf("the refused pod was changed: ours %q, Istio's %v", r.dump("b"), r.rules.Istio(int(r.netns["b"].Fd())))
	}
	if got := r.members(); !slices.Equal(got, []string{"mesh/a ambient uid-a"}) {
		t.Errorf("members %v", got)
	}
	// inspect has no record of it, and asks the agent by name.
	in := r.e.Inspect(&wire.Pod{Namespace: "mesh", Name: "b"})
	if in.Pod == nil || in.Pod.UID != "uid-b" || !strings.Contains(in.Enrolment, "istio-cni's rules left in place") ||
		!strings.Contains(in.Enrolment, "table ip filter") {
		t.Errorf("inspect of the refused pod: %+v (pod %+v)", in, in.Pod)
	}
	if in := r.e.Inspect(&wire.Pod{Namespace: "mesh", Name: "nosuch"}); in.Pod != nil {
		t.Errorf("inspect of an unknown pod found %+v", in.Pod)
	}
}

// A takeover whose enrolment fails afterwards (the probe entry, say)
// leaves the pod with our rules, and the next reconcile enrols it.
func TestHandoverFailureKeepsCapture(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.running("mesh", "a", "uid-a", "10.0.0.5", map[string]string{istio.AnnRedirection: "enabled"})
	r.rules.PlantIstio(int(r.netns["a"].Fd()), istioNat())
	r.probes.addErr = errors.New("netlink: ENOENT")
	if adopted, _, _ := r.e.AdoptAnnotated(context.Background()); adopted != 0 {
		t.Fatalf("adopted %d with a failing probe set", adopted)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("after a failed adoption the pod holds:\n%s\nwant ours (Istio's are gone)", got)
	}
	r.probes.addErr = nil
	if err := r.e.Reconcile(context.Background(), "mesh", "a"); err != nil {
		t.Fatal(err)
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want || len(r.members()) != 1 {
		t.Errorf("after the next reconcile: members %v, rules:\n%s\nwant:\n%s", r.members(), got, want)
	}
}

// A late enrolment that fails (no ztunnel yet, at an agent's start) never
// takes away a capture the pod already had: our rules from a takeover stay,
// and so do istio-cni's, which are taken over on the next try.
func TestFailedLateEnrolmentKeepsExistingCapture(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.running("mesh", "a", "uid-a", "10.0.0.5", nil)
	r.running("mesh", "b", "uid-b", "10.0.0.6", nil)
	b, err := nft.Encode(capture.Ambient(capture.AmbientSpec{DNSCapture: true}))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.rules.Fake.Program(int(r.netns["a"].Fd()), b); err != nil {
		t.Fatal(err)
	}
	r.rules.PlantIstio(int(r.netns["b"].Fd()), istioNat())
	r.zt.addErr = errors.New("no ztunnel connection")
	for _, name := range []string{"a", "b"} {
		if err := r.e.Reconcile(context.Background(), "mesh", name); err == nil {
			t.Fatalf("late enrolment of %s succeeded without ztunnel", name)
		}
	}
	if got, want := r.dump("a"), r.ambientRules(); got != want {
		t.Errorf("our rules after a failed late enrolment:\n%s\nwant them kept:\n%s", got, want)
	}
	if r.dump("b") == "" && r.rules.Istio(int(r.netns["b"].Fd())) == nil {
		t.Error("a failed late enrolment left the pod with neither Istio's rules nor ours")
	}
	r.zt.addErr = nil
	for _, name := range []string{"a", "b"} {
		if err := r.e.Reconcile(context.Background(), "mesh", name); err != nil {
			t.Fatal(err)
		}
		if got, want := r.dump(name), r.ambientRules(); got != want {
			t.Errorf("pod %s once ztunnel is there:\n%s\nwant:\n%s", name, got, want)
		}
	}
	if r.rules.Istio(int(r.netns["b"].Fd())) != nil || len(r.members()) != 2 {
		t.Errorf("Istio's left %v, members %v", r.rules.Istio(int(r.netns["b"].Fd())), r.members())
	}
}

// A pod annotated as enrolled whose capture lives in iptables-legacy
// (istio-cni's legacy mode: x_tables, out of nf_tables' reach) is refused:
// nothing programmed, its annotation kept, and still in ztunnel's snapshot.
func TestHandoverRefusesIptablesLegacy(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	r.running("mesh", "a", "uid-a", "10.0.0.5", map[string]string{istio.AnnRedirection: "enabled"})
	r.rules.PlantIstio(int(r.netns["a"].Fd()), &nft.IstioState{Legacy: []string{"ip nat"}})
	adopted, kept, cleared := r.e.AdoptAnnotated(context.Background())
	if adopted != 0 || kept != 1 || cleared != 0 {
		t.Fatalf("adopted %d kept %d cleared %d, want 0 1 0", adopted, kept, cleared)
	}
	r.expect("zt.Track uid-a")
	r.expectNot("rules.Program", "rules.TakeOver", `annotate mesh/a=""`)
	if r.dump("a") != "" || len(r.members()) != 0 {
		t.Errorf("a legacy pod was enrolled: members %v, rules %q", r.members(), r.dump("a"))
	}
}

// The plugin sends the primary's addresses unchecked; the agent keeps them
// parsed and unmapped, and drops what is not an address.
func TestCanonicalIPs(t *testing.T) {
	got := canonical([]string{"10.0.0.5/24", "::ffff:10.0.0.6/120", "not an address", "fd00::1/64", ""})
	if want := []string{"10.0.0.5/24", "10.0.0.6/24", "fd00::1/64"}; !slices.Equal(got, want) {
		t.Errorf("canonical = %v, want %v", got, want)
	}
	if got := addrs(got); len(got) != 3 || got[1] != netip.MustParseAddr("10.0.0.6") {
		t.Errorf("addrs = %v", got)
	}
}

// A DEL the plugin carried out while no agent ran (it removed the rules
// and left a tombstone) is final: the restarted agent releases the pod —
// ztunnel never gets it, no verification pass puts its rules back.
func TestDelWhileNoAgentRanIsFinal(t *testing.T) {
	r := newRig(t)
	r.namespace("mesh", true)
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.e.Close()
	r.rules.Tamper(int(r.netns["a"].Fd()), nil) // the plugin's own removal
	if err := os.WriteFile(wire.TombstonePath(r.runDir, wire.Attachment{ContainerID: "c-a", IfName: "eth0"}), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	r.l.reset()
	r.e = r.enroller()
	n, err := r.e.Restore(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n.Restored != 0 || n.Gone != 1 {
		t.Errorf("restore: %+v", n)
	}
	r.expectNot("zt.Track uid-a", "zt.Add uid-a")
	if got := r.members(); len(got) != 0 {
		t.Errorf("members %v", got)
	}
	if got := r.recorded(); len(got) != 0 {
		t.Errorf("still recorded: %v", got)
	}
	if checked, repaired := r.e.VerifyPass(context.Background(), 1); checked != 0 || repaired != 0 {
		t.Errorf("verify pass: checked %d repaired %d", checked, repaired)
	}
	if got := r.dump("a"); got != "" {
		t.Errorf("rules put back into the deleted pod's netns:\n%s", got)
	}
	// The tombstone is gone with the pod: the next start has nothing to do.
	if ents, _ := filepath.Glob(filepath.Join(r.runDir, wire.RecordsDir, "*.mark")); len(ents) != 0 {
		t.Errorf("tombstones left: %v", ents)
	}
	t.Logf("calls: %s", r.l)
}
