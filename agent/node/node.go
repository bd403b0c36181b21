// Package node is the agent's enrolment side put together: the run dir
// lock, the host probe table, the pod records, ztunnel's ZDS server, the
// pod source, the enrolment state machine, the plugin socket and the
// continuous verification, started in the one order that keeps every
// enrolled pod captured across a restart. The command and the integration
// tests start it the same way.
package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/enrol"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/hostprobe"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/agent/procscan"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/repair"
	"github.com/nftcni/nftcni/agent/runlock"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Config is what the enrolment side runs with.
type Config struct {
	RunDir string // sockets, pod records, lock (and the policy snapshot without StateDir)
	// StateDir keeps what must outlive a reboot: the policy snapshot the
	// plugin falls back on while the agent is not back yet. Empty: RunDir.
	StateDir  string
	HostNetns string // the host's netns, where the probe table lives
	// HostKernel is the host netns's nf_tables (nil: through netlink in
	// HostNetns; tests give nft.FakeHost).
	HostKernel nft.Host
	ProcDir    string // the host's /proc, for pods that predate the agent
	// ZtunnelSocket is the ZDS socket; "" runs without ztunnel.
	ZtunnelSocket string
	// ZtunnelSocketWait is how long a ZDS socket another live process
	// serves (istio-cni's agent, during a rollout) is waited for before
	// the agent gives up; 0 means 30 s (istio-cni's grace period).
	ZtunnelSocketWait time.Duration
	IPv6              bool
	ProbeSNAT         capture.ProbeSNAT
	Policy            *enablement.Policy

	// Where pods come from: Kubernetes (Kube set), a static directory
	// (StaticDir), a store filled by the caller (Store), or nothing.
	Kube kubesrc.API
	// Repair is istio-cni's repair of sidecar pods whose capture check
	// failed (Kubernetes only).
	Repair    repair.Config
	StaticDir string
	Store     *podsource.Store
	NodeName  string

	// VerifyEvery is the continuous verification's interval (0: off);
	// VerifyConcurrency how many pods it checks at once.
	VerifyEvery       time.Duration
	VerifyConcurrency int
	// AdoptConcurrency is how many pods istio-cni enrolled are taken over
	// at once at start; 0: enrol.DefaultAdoptConcurrency.
	AdoptConcurrency int
	// HostGuardEvery is how often the host probe table is checked.
	HostGuardEvery time.Duration
	// LookupRetries bounds the wait for a pod the store does not have yet
	// (0: enrol's default).
	LookupRetries int

	Registry prometheus.Registerer // nil: metrics not exported
	Log      *slog.Logger
	// Lock is the run dir's lock when the caller took it already (the
	// command takes it before anything else); nil: Start takes it.
	Lock *runlock.Lock
}

// PolicyPath is where the policy snapshot goes.
func (c Config) PolicyPath() string {
	if c.StateDir != "" {
		return filepath.Join(c.StateDir, wire.PolicyName)
	}
	return filepath.Join(c.RunDir, wire.PolicyName)
}

func (c Config) socketWait() time.Duration {
	if c.ZtunnelSocketWait == 0 {
		return 30 * time.Second
	}
	return c.ZtunnelSocketWait
}

// Node is a running enrolment side.
type Node struct {
	Enroller *enrol.Enroller
	Host     *hostprobe.Table
	ZDS      *zds.Server // nil without ztunnel
	Restored enrol.Restored

	cancel    context.CancelFunc
	waits     []chan struct{}
	closers   []func()
	zdsServed bool // ZDS.Serve owns the listener
}

func (n *Node) goWait(f func()) {
	done := make(chan struct{})
	n.waits = append(n.waits, done)
	go func() { defer close(done); f() }()
}

// Stop stops serving and waits for everything to finish. In-pod rules,
// the host table, the records and ztunnel's state stay as they are: the
// next agent takes them over. (Uninstalling removes the host table first:
// Host.Delete.)
func (n *Node) Stop() {
	n.cancel()
	for _, w := range n.waits {
		<-w
	}
	if n.Enroller != nil {
		n.Enroller.Close()
	}
	for i := len(n.closers) - 1; i >= 0; i-- {
		n.closers[i]()
	}
}

// Start brings the enrolment side up: the run dir is locked before any
// socket is touched; the pod source is complete and the previous agent's
// pods are restored before ztunnel may connect and get its snapshot, and
// before the plugin is served; their rules are checked by the first
// verification pass, once the agent serves. It returns when the plugin is
// served.
func Start(ctx context.Context, cfg Config) (_ *Node, err error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	log := cfg.Log
	ctx, cancel := context.WithCancel(ctx)
	n := &Node{cancel: cancel}
	defer func() {
		if err != nil {
			n.Stop()
		}
	}()
	hostNetns, hostKernel, err := n.openHost(cfg)
	if err != nil {
		return nil, err
	}
	recs, err := records.Open(cfg.RunDir)
	if err != nil {
		return nil, fmt.Errorf("pod records in %s: %w", cfg.RunDir, err)
	}
	proc := cfg.ProcDir
	if proc == "" {
		proc = "/proc"
	}
	opts := enrol.Options{Policy: cfg.Policy, Log: log, Probes: n.Host, Records: recs,
		Finder: &procscan.Scanner{Proc: proc, Host: hostNetns}, Metrics: enrol.NewMetrics(cfg.Registry),
		LookupRetries: cfg.LookupRetries, AdoptConcurrency: cfg.AdoptConcurrency}
	zl, err := n.listenZtunnel(cfg)
	if err != nil {
		return nil, err
	}
	if n.ZDS != nil {
		opts.Ztunnel = n.ZDS
	}

	// 1. The pod source, complete; the policy snapshot follows it.
	snap := &snapshot{path: cfg.PolicyPath(), log: log, dirty: make(chan struct{}, 1), save: events.WritePolicy}
	src, err := openPodSource(ctx, cfg, &opts, snap.mark)
	if err != nil {
		return nil, err
	}
	e := enrol.New(opts)
	n.Enroller, snap.e = e, e
	n.goWait(func() { snap.run(ctx) })

	// 2. The previous agent's pods: netns reopened, enrolments restored.
	n.restore(ctx, e, log)

	// 3. The host probe table (exactly the restored members), then
	// ztunnel, the pod source's changes, and the plugin.
	if err := n.takeHost(ctx, cfg, hostKernel, e.ProbeMembers()); err != nil {
		return nil, err
	}
	if n.ZDS != nil {
		n.goWait(func() { _ = n.ZDS.Serve(ctx, zl) })
		n.zdsServed = true
		log.Info("serving ztunnel (ZDS)", "socket", cfg.ZtunnelSocket, "snapshot", len(n.ZDS.Known()))
	}
	n.follow(ctx, cfg, src, e, snap.mark)
	snap.write()
	return n, n.serve(ctx, cfg, e)
}

// openHost takes the run dir's lock, opens the host's netns and its
// kernel, and puts the host probe table in place (with whatever it holds)
// before any pod is restored or adopted: their probe entries go into it.
func (n *Node) openHost(cfg Config) (*os.File, nft.Host, error) {
	if cfg.Lock == nil {
		lock, err := runlock.Acquire(cfg.RunDir)
		if err != nil {
			return nil, nil, err
		}
		n.closers = append(n.closers, func() { lock.Release() })
	}
	hostNetns, err := os.Open(cfg.HostNetns)
	if err != nil {
		return nil, nil, fmt.Errorf("--host-netns %s: %w (in a pod: mount the host's /proc and add CAP_SYS_PTRACE to open /host/proc/1/ns/net)", cfg.HostNetns, err)
	}
	n.closers = append(n.closers, func() { hostNetns.Close() })
	var k nft.Host = cfg.HostKernel
	if k == nil {
		if k, err = nft.OpenHost(int(hostNetns.Fd())); err != nil {
			return nil, nil, fmt.Errorf("host probe table in %s: %w%s", cfg.HostNetns, err, capsHint)
		}
	}
	n.closers = append(n.closers, func() { k.Close() })
	if n.Host, err = hostprobe.New(k, capture.HostSpec{IPv6: cfg.IPv6, SNAT: cfg.ProbeSNAT}, cfg.Log); err != nil {
		return nil, nil, fmt.Errorf("host probe table in %s: %w%s", cfg.HostNetns, err, capsHint)
	}
	if _, err := n.Host.Assert(nil, true); err != nil {
		return nil, nil, fmt.Errorf("host probe table in %s: %w%s", cfg.HostNetns, err, capsHint)
	}
	return hostNetns, k, nil
}

const capsHint = " (the agent needs CAP_NET_ADMIN, and CAP_SYS_ADMIN to enter that netns)"

// listenZtunnel binds the ZDS socket (waiting out another live server of
// it) and makes the ZDS server; nil without a socket configured.
func (n *Node) listenZtunnel(cfg Config) (*net.UnixListener, error) {
	if cfg.ZtunnelSocket == "" {
		cfg.Log.Warn("no ztunnel socket: ambient pods get their rules but no ztunnel")
		return nil, nil
	}
	zl, err := zds.Listen(cfg.ZtunnelSocket, cfg.socketWait())
	if err != nil {
		return nil, fmt.Errorf("ZDS socket %s: %w", cfg.ZtunnelSocket, err)
	}
	n.closers = append(n.closers, func() {
		if !n.zdsServed {
			zl.Close() // Serve owns it once it runs
		}
	})
	n.ZDS = zds.NewServer(cfg.Log, cfg.Registry)
	return zl, nil
}

// podSource is where pods come from: one of the two is set, or neither
// (a store the caller fills, or none).
type podSource struct {
	kube   *kubesrc.Source
	static *podsource.Source
}

// openPodSource fills opts' store (and annotator) and returns once the
// source is complete; changed is called whenever it changes.
func openPodSource(ctx context.Context, cfg Config, opts *enrol.Options, changed func()) (podSource, error) {
	log := cfg.Log
	switch {
	case cfg.Kube != nil:
		kube := kubesrc.New(cfg.Kube, cfg.NodeName, cfg.Registry, log, changed)
		opts.Store, opts.Annotator = kube, kube
		if err := kube.Start(ctx); err != nil {
			return podSource{}, fmt.Errorf("kubernetes informers: %w", err)
		}
		log.Info("informer caches synced", "pods-on-node", len(kube.Pods()), "namespaces", len(kube.Namespaces()))
		return podSource{kube: kube}, nil
	case cfg.StaticDir != "":
		store := podsource.NewStore()
		opts.Store = store
		static := podsource.New(cfg.StaticDir, cfg.NodeName, store, log)
		bad, err := static.Load()
		if err != nil {
			return podSource{}, fmt.Errorf("--pod-source: %w", err)
		}
		log.Info("enrolling from a static pod source", "dir", cfg.StaticDir, "pods", len(store.Pods()), "namespaces", len(store.Namespaces()), "files-skipped", len(bad))
		return podSource{static: static}, nil
	case cfg.Store != nil:
		opts.Store = cfg.Store
	default:
		opts.Store = podsource.NewStore()
		log.Warn("no pod source (no --kubeconfig, not in a cluster, no --pod-source): the agent knows no pods, so every pod passes through un-enrolled")
	}
	return podSource{}, nil
}

// snapshot is the policy snapshot the plugin falls back on while no agent
// answers: written once the agent serves, then at most every 100 ms while
// the pod source changes (changes come in bursts: an informer's first
// list, a namespace of pods).
type snapshot struct {
	path  string
	e     *enrol.Enroller
	log   *slog.Logger
	dirty chan struct{}
	save  func(path string, p *wire.Policy) error // events.WritePolicy
}

const snapshotDebounce = 100 * time.Millisecond

// mark says the policy may have changed.
func (s *snapshot) mark() {
	select {
	case s.dirty <- struct{}{}:
	default:
	}
}

func (s *snapshot) write() {
	if err := s.save(s.path, s.e.Policy()); err != nil {
		s.log.Error("could not write the policy snapshot the plugin falls back on", "path", s.path, "err", err)
	}
}

// run writes the snapshot after each burst of marks until ctx ends.
func (s *snapshot) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.dirty:
		}
		time.Sleep(snapshotDebounce)
		select {
		case <-s.dirty:
		default:
		}
		s.write()
	}
}

// restore takes over what the previous agent left: its records, the pods
// gone since, and pods annotated as enrolled without a record.
func (n *Node) restore(ctx context.Context, e *enrol.Enroller, log *slog.Logger) {
	var err error
	if n.Restored, err = e.Restore(ctx); err != nil {
		log.Error("could not read the previous agent's pod records; pods enrolled before this start are not restored", "err", err)
	}
	r := &n.Restored
	r.Pruned = e.PruneGone(ctx)
	r.Adopted, r.Kept, r.Cleared = e.AdoptAnnotated(ctx)
	log.Info("pods restored from the previous agent", "restored", r.Restored, "sandbox-gone", r.Gone, "pod-gone", r.Pruned,
		"adopted-through-proc", r.Adopted, "kept-without-netns", r.Kept, "stale-annotations-cleared", r.Cleared)
}

// takeHost makes the host probe table hold exactly members, removes
// istio-cni's probe SNAT (a live migration from it) once ours covers the
// pods taken over, and guards the table from then on.
func (n *Node) takeHost(ctx context.Context, cfg Config, k nft.Host, members []nft.Member) error {
	log := cfg.Log
	if _, err := n.Host.Assert(members, false); err != nil {
		return fmt.Errorf("host probe table in %s: %w%s", cfg.HostNetns, err, capsHint)
	}
	log.Info("host probe SNAT table in place", "netns", cfg.HostNetns, "table", "inet "+nft.HostTable)
	if s, err := k.SurveyIstio(); err != nil {
		log.Warn("could not look for istio-cni's host probe state", "netns", cfg.HostNetns, "err", err)
	} else if s.Found() {
		if err := k.RemoveIstio(s); err != nil {
			log.Error("could not remove istio-cni's host probe state; probes still work through ours", "netns", cfg.HostNetns, "err", err)
		} else {
			log.Info("removed istio-cni's host probe rules", "netns", cfg.HostNetns, "removed", s.What())
			if s.UsesIpsets() {
				n.goWait(func() { destroyIstioIpsets(ctx, k, log) })
			}
		}
	}
	guard := cfg.HostGuardEvery
	if guard <= 0 {
		guard = 10 * time.Second
	}
	n.goWait(func() { n.Host.Guard(ctx, guard) })
	return nil
}

// follow reconciles pods as the pod source changes: Kubernetes' informer
// events (and istio-cni's repair of sidecar pods), or the static
// directory's changes.
func (n *Node) follow(ctx context.Context, cfg Config, src podSource, e *enrol.Enroller, changed func()) {
	log := cfg.Log
	switch {
	case src.kube != nil:
		kube := src.kube
		rep := repair.New(cfg.Repair, cfg.Kube, e.RepairSidecar, log)
		n.goWait(func() {
			kube.Run(ctx, func(ctx context.Context, namespace, name string) error {
				err := e.Reconcile(ctx, namespace, name)
				return errors.Join(err, rep.Reconcile(ctx, kube.Pod(namespace, name)))
			})
		})
	case src.static != nil:
		reconcile := make(chan struct{}, 1)
		reconcile <- struct{}{} // what changed while no agent ran
		n.goWait(func() { reconcileOnChange(ctx, e, reconcile, log) })
		n.goWait(func() {
			err := src.static.Watch(ctx, func() {
				changed()
				select {
				case reconcile <- struct{}{}:
				default:
				}
			})
			if err != nil {
				log.Error("cannot watch the pod source; it will not be reloaded", "dir", cfg.StaticDir, "err", err)
			}
		})
	}
}

// serve serves the plugin and starts the continuous verification.
func (n *Node) serve(ctx context.Context, cfg Config, e *enrol.Enroller) error {
	log := cfg.Log
	sock := filepath.Join(cfg.RunDir, wire.SocketName)
	l, err := events.Listen(sock)
	if err != nil {
		return fmt.Errorf("plugin socket %s: %w", sock, err)
	}
	srv := events.NewServer(e, log, events.NewMetrics(cfg.Registry))
	n.goWait(func() { _ = srv.Serve(ctx, l) })
	log.Info("serving the plugin", "socket", sock, "policy-snapshot", cfg.PolicyPath())
	if cfg.VerifyEvery > 0 {
		n.goWait(func() { e.Verify(ctx, cfg.VerifyEvery, cfg.VerifyConcurrency) })
		log.Info("verifying every enrolled pod's ruleset", "interval", cfg.VerifyEvery, "concurrency", cfg.VerifyConcurrency)
	} else {
		log.Warn("continuous verification is off: a changed pod ruleset is found only by the next agent start")
	}
	return nil
}

// destroyIstioIpsets removes istio-cni's probe ipsets once the kernel has
// released the rules that used them (some time after their removal), for
// up to a minute; a leftover set holds nothing that matters.
func destroyIstioIpsets(ctx context.Context, k nft.Host, log *slog.Logger) {
	var err error
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		if err = k.DestroyIstioProbeSets(); !errors.Is(err, nft.ErrIpsetBusy) {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
	if err != nil {
		log.Warn("could not remove istio-cni's host probe ipsets; they are unused", "err", err)
		return
	}
	log.Info("removed istio-cni's host probe ipsets", "sets", nft.IstioProbeSets)
}

// reconcileOnChange re-evaluates every pod whenever the pod source
// changed, and again every 2 s while some could not be brought in line (a
// late enrolment waiting for ztunnel, say).
func reconcileOnChange(ctx context.Context, e *enrol.Enroller, changed <-chan struct{}, log *slog.Logger) {
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-retry:
		}
		retry = nil
		if err := e.ReconcileAll(ctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Warn("some pods are not in line with the pod source yet; retrying in 2s", "err", err)
			retry = time.After(2 * time.Second)
		}
	}
}
