package node

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/enrol"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/hostprobe"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// The parts of the composition root that need no kernel: the pod source,
// the policy snapshot's writer and the static source's reconciliation.
// Start itself, in the order that keeps pods captured across a restart,
// is the integration tests' (TestAgentRestartKeepsCapture and the rest).

var log = slog.New(slog.DiscardHandler)

const manifests = `apiVersion: v1
kind: Namespace
metadata:
  name: mesh
  labels:
    istio.io/dataplane-mode: ambient
---
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: mesh
  uid: "1111"
spec:
  nodeName: node-a
`

func staticDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "pods.yaml"), []byte(manifests), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func policy(t *testing.T) *enablement.Policy {
	t.Helper()
	p, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPodSources(t *testing.T) {
	ctx := context.Background()
	var opts enrol.Options
	src, err := openPodSource(ctx, Config{StaticDir: staticDir(t), NodeName: "node-a", Log: log}, &opts, func() {})
	if err != nil || src.static == nil || src.kube != nil {
		t.Fatalf("static source: %+v, %v", src, err)
	}
	if kp := opts.Store.Pod("mesh", "web"); kp == nil || string(kp.UID) != "1111" {
		t.Errorf("the static source's store has no mesh/web: %v", kp)
	}
	if opts.Annotator != nil {
		t.Error("a static source annotates pods")
	}

	if _, err := openPodSource(ctx, Config{StaticDir: filepath.Join(t.TempDir(), "absent"), Log: log}, &enrol.Options{}, func() {}); err == nil {
		t.Error("a static source that does not exist was accepted")
	}

	store := podsource.NewStore()
	opts = enrol.Options{}
	if src, err := openPodSource(ctx, Config{Store: store, Log: log}, &opts, func() {}); err != nil || src.static != nil || opts.Store != store {
		t.Errorf("a caller's store: %+v %v, store kept %v", src, err, opts.Store == store)
	}
	opts = enrol.Options{}
	if _, err := openPodSource(ctx, Config{Log: log}, &opts, func() {}); err != nil || opts.Store == nil || len(opts.Store.Pods()) != 0 {
		t.Errorf("no source: %v, store %v", err, opts.Store)
	}
}

// A burst of changes is one write of the snapshot, a debounce later; a
// change after it is another.
func TestPolicySnapshotIsWrittenOncePerBurst(t *testing.T) {
	var opts enrol.Options
	if _, err := openPodSource(context.Background(), Config{StaticDir: staticDir(t), NodeName: "node-a", Log: log}, &opts, func() {}); err != nil {
		t.Fatal(err)
	}
	opts.Policy = policy(t)
	var mu sync.Mutex
	var saved []*wire.Policy
	path := filepath.Join(t.TempDir(), wire.PolicyName)
	s := &snapshot{path: path, e: enrol.New(opts), log: log, dirty: make(chan struct{}, 1), save: func(p string, pol *wire.Policy) error {
		mu.Lock()
		saved = append(saved, pol)
		mu.Unlock()
		return events.WritePolicy(p, pol)
	}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.run(ctx) }()
	defer func() { cancel(); <-done }()
	writes := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(saved)
	}
	settle := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); writes() < n && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(3 * snapshotDebounce) // room for a write too many
	}

	for range 50 {
		s.mark()
	}
	settle(1)
	if n := writes(); n != 1 {
		t.Fatalf("50 changes in a burst: %d writes, want 1", n)
	}
	if mode := saved[0].Pods["mesh/web"]; mode != wire.ModeAmbient || len(saved[0].EnrolledNamespaces) != 1 {
		t.Errorf("the snapshot says mesh/web is %q, enrolled namespaces %v", mode, saved[0].EnrolledNamespaces)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the snapshot file: %v", err)
	}
	s.mark()
	settle(2)
	if n := writes(); n != 2 {
		t.Errorf("a later change: %d writes in all, want 2", n)
	}
}

// The static source's changes are followed: the store reloads and the
// policy snapshot is marked dirty.
func TestStaticSourceFollowed(t *testing.T) {
	dir := staticDir(t)
	var opts enrol.Options
	src, err := openPodSource(context.Background(), Config{StaticDir: dir, NodeName: "node-a", Log: log}, &opts, func() {})
	if err != nil {
		t.Fatal(err)
	}
	opts.Policy = policy(t)
	e := enrol.New(opts)
	n := &Node{}
	ctx, cancel := context.WithCancel(context.Background())
	marked := make(chan struct{}, 1)
	n.follow(ctx, Config{StaticDir: dir, Log: log}, src, e, func() {
		select {
		case marked <- struct{}{}:
		default:
		}
	})
	defer func() {
		cancel()
		for _, w := range n.waits {
			<-w
		}
	}()
	onlyNamespace := manifests[:strings.Index(manifests, "---")]
	for deadline := time.Now().Add(5 * time.Second); opts.Store.Pod("mesh", "web") != nil; {
		if time.Now().After(deadline) {
			t.Fatal("the pod removed from the static source is still in the store")
		}
		// Rewritten until seen: the watch may start after the first write.
		if err := os.WriteFile(filepath.Join(dir, "pods.yaml"), []byte(onlyNamespace), 0o644); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case <-marked:
	case <-time.After(5 * time.Second):
		t.Error("the policy snapshot was not marked after the source changed")
	}
	if opts.Store.Namespace("mesh") == nil {
		t.Error("the namespace left in the source is gone from the store")
	}
}

// The host takeover from istio-cni: our probe table holds exactly the
// members, istio-cni's host state goes, and its ipsets go once the kernel
// lets go of them.
func TestTakeHostFromIstio(t *testing.T) {
	k := &nft.FakeHost{IpsetsBusy: 2}
	k.PlantIstio(nft.FakeIstioHostState("ISTIO_POSTRT"))
	n := &Node{}
	var err error
	if n.Host, err = hostprobe.New(k, capture.HostSpec{}, log); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Host.Assert(nil, true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	members := []nft.Member{{UID: "uid-a", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}}
	if err := n.takeHost(ctx, Config{HostNetns: "/host", HostGuardEvery: time.Hour, Log: log}, k, members); err != nil {
		t.Fatal(err)
	}
	if owners, ok, _ := k.Elements(); !ok || len(owners) != 1 || owners[netip.MustParseAddr("10.0.0.5")] != "uid-a" {
		t.Errorf("the probe set after the takeover: %v (table there: %v)", owners, ok)
	}
	if s, _ := k.SurveyIstio(); s.Found() {
		t.Errorf("istio-cni's host state is still there: %v", s.What())
	}
	for deadline := time.Now().Add(5 * time.Second); !k.IpsetsDestroyed(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("istio-cni's ipsets were never destroyed")
		}
	}
	cancel()
	for _, w := range n.waits {
		<-w
	}
}
