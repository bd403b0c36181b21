package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/mesh"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/agent/procscan"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/plugin/wire"
)

// ambientFlags are the enrolment settings, named as istio-cni names them.
type ambientFlags struct {
	kubeconfig                                      string
	podSource, nodeName, systemNamespace, selectors string
	ztunnelSocket, hostNetns, procDir               string
	dnsCapture, ipv6                                bool
}

func (a *ambientFlags) register(f *flagSet) {
	f.str(&a.kubeconfig, "kubeconfig", "KUBECONFIG", "", "kubeconfig to watch pods and namespaces with (default: in-cluster config when running in a pod)")
	f.str(&a.podSource, "pod-source", "POD_SOURCE", "", "directory of Pod and Namespace manifests to enrol from instead of Kubernetes, for hosts without it (watched)")
	f.str(&a.nodeName, "node-name", "NODE_NAME", "", "this node's name: pods bound to other nodes are ignored")
	f.str(&a.systemNamespace, "system-namespace", "SYSTEM_NAMESPACE", "istio-system", "ztunnel's namespace; its pods are never enrolled")
	f.str(&a.selectors, "ambient-enablement-selector", "AMBIENT_ENABLEMENT_SELECTOR", "", "JSON list of {podSelector, namespaceSelector}; empty: Istio's defaults on istio.io/dataplane-mode")
	f.boolean(&a.dnsCapture, "ambient-dns-capture", "AMBIENT_DNS_CAPTURE", true, "capture DNS to ztunnel's 15053 unless a pod says otherwise")
	ipv6Flag(f, &a.ipv6)
	f.str(&a.ztunnelSocket, "ztunnel-socket", "ZTUNNEL_UDS_ADDRESS", zds.DefaultSocket, "ZDS socket ztunnel connects to; \"none\": no ztunnel (rules only, for tests and demos)")
	hostNetnsFlag(f, &a.hostNetns)
	f.str(&a.procDir, "proc-dir", "PROC_DIR", "/proc", "the host's /proc (the agent's pod mounts it at /host/proc): where the netns of pods that predate the agent is found")
}

func (a *ambientFlags) policy(exclude []string) (*enablement.Policy, error) {
	cfg := enablement.DefaultConfig()
	cfg.ExcludeNamespaces, cfg.SystemNamespace = exclude, a.systemNamespace
	cfg.DNSCapture, cfg.IPv6 = a.dnsCapture, a.ipv6
	if strings.TrimSpace(a.selectors) != "" {
		sel, err := enablement.ParseSelectors([]byte(a.selectors))
		if err != nil {
			return nil, fmt.Errorf("--ambient-enablement-selector: %w", err)
		}
		cfg.Selectors = sel
	}
	return enablement.Compile(cfg)
}

// source says where pods come from: Kubernetes (a kubeconfig, or running in
// a cluster), a static directory, or nowhere.
func (a *ambientFlags) source() (string, error) {
	inCluster := os.Getenv("KUBERNETES_SERVICE_HOST") != ""
	switch {
	case a.podSource != "" && a.kubeconfig != "":
		return "", fmt.Errorf("--pod-source and --kubeconfig are exclusive: pods come from one place")
	case a.podSource != "":
		return "static", nil
	case a.kubeconfig != "" || inCluster:
		if a.nodeName == "" {
			return "", fmt.Errorf("--node-name (NODE_NAME) is required to watch this node's pods")
		}
		return "kubernetes", nil
	}
	return "", nil
}

func (a *ambientFlags) restConfig() (*rest.Config, error) {
	if a.kubeconfig == "" {
		return rest.InClusterConfig()
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", a.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", a.kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = 80, 160 // istio-cni's
	return cfg, nil
}

// reconcileAll re-evaluates every pod after the static source changed.
func reconcileAll(ctx context.Context, m *mesh.Mesh, store *mesh.MemStore) {
	for _, p := range store.Pods() {
		_ = m.Reconcile(ctx, p.Namespace, p.Name)
	}
}

// enrolment is the running enrolment side: the mesh, the Kubernetes client
// when pods come from Kubernetes (nil otherwise), and stop, which waits for
// everything to finish.
type enrolment struct {
	mesh *mesh.Mesh
	kube kubernetes.Interface
	stop func()
}

// serveEvents starts the enrolment side of the agent, in the order that
// keeps every enrolled pod captured across a restart: the pod source is
// complete and the previous agent's pods are restored (rules verified)
// before ztunnel may connect and get its snapshot, and before the plugin
// is served.
func serveEvents(ctx context.Context, c *common, a *ambientFlags, policy *enablement.Policy, reg prometheus.Registerer, log *slog.Logger) (*enrolment, error) {
	src, err := a.source()
	if err != nil {
		return nil, err
	}
	hostNetns, err := os.Open(a.hostNetns)
	if err != nil {
		return nil, fmt.Errorf("--host-netns %s: %w (in a pod: mount the host's /proc and add CAP_SYS_PTRACE to open /host/proc/1/ns/net)", a.hostNetns, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	var waits []chan struct{}
	goWait := func(f func()) {
		done := make(chan struct{})
		waits = append(waits, done)
		go func() { defer close(done); f() }()
	}
	stop := func() {
		cancel()
		for _, w := range waits {
			<-w
		}
		hostNetns.Close()
	}
	var z *zds.Server
	var zl *net.UnixListener
	fail := func(err error) (*enrolment, error) {
		stop()
		if zl != nil {
			zl.Close() // Serve may not have started to own it
		}
		return nil, err
	}

	opts := mesh.Options{RunDir: c.runDir, Log: log, IPv6: a.ipv6, HostNetns: hostNetns,
		Finder: &procscan.Scanner{Proc: a.procDir, Host: hostNetns}}
	if a.ztunnelSocket != "none" {
		if zl, err = zds.Listen(a.ztunnelSocket); err != nil {
			return fail(fmt.Errorf("ZDS socket %s: %w", a.ztunnelSocket, err))
		}
		z = zds.NewServer(log, reg)
		opts.Ztunnel = z
	} else {
		log.Warn("no ztunnel socket (--ztunnel-socket none): ambient pods get their rules but no ztunnel")
	}
	store := mesh.NewMemStore()
	m := mesh.New(policy, store, opts)
	writeNow := func() {
		if err := m.WritePolicy(); err != nil {
			log.Error("could not write the policy snapshot the plugin falls back on", "path", filepath.Join(c.runDir, wire.PolicyName), "err", err)
		}
	}
	// Changes come in bursts (an informer's first list, a namespace of
	// pods): the snapshot is rewritten at most every 100 ms.
	policyDirty := make(chan struct{}, 1)
	writePolicy := func() {
		select {
		case policyDirty <- struct{}{}:
		default:
		}
	}
	goWait(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-policyDirty:
			}
			time.Sleep(100 * time.Millisecond)
			select {
			case <-policyDirty:
			default:
			}
			writeNow()
		}
	})

	// 1. The pod source, complete.
	var kube *kubesrc.Source
	var client kubernetes.Interface
	switch src {
	case "kubernetes":
		cfg, err := a.restConfig()
		if err != nil {
			return fail(err)
		}
		if client, err = kubernetes.NewForConfig(cfg); err != nil {
			return fail(err)
		}
		kube = kubesrc.New(client, a.nodeName, reg, log, writePolicy)
		m.SetStore(kube, kube)
		log.Info("watching Kubernetes", "api", cfg.Host, "node", a.nodeName)
		if err := kube.Start(ctx); err != nil {
			return fail(fmt.Errorf("kubernetes informers: %w", err))
		}
		log.Info("informer caches synced", "pods-on-node", len(kube.Pods()), "namespaces", len(kube.Namespaces()))
	case "static":
		if err := podsource.Sync(store, a.podSource, a.nodeName); err != nil {
			return fail(fmt.Errorf("--pod-source: %w", err))
		}
		log.Info("enrolling from a static pod source", "dir", a.podSource, "pods", len(store.Pods()), "namespaces", len(store.Namespaces()))
	default:
		log.Warn("no pod source (no --kubeconfig, not in a cluster, no --pod-source): the agent knows no pods, so every pod passes through un-enrolled")
	}

	// 2. The previous agent's pods: netns reopened, rules verified.
	restored, repaired, err := m.Restore(ctx)
	if err != nil {
		log.Error("could not read the previous agent's pod record; pods enrolled before this start are not restored", "err", err)
	}
	pruned, adopted, kept, cleared := 0, 0, 0, 0
	if src != "" {
		pruned = m.PruneGone(ctx)
		adopted, kept, cleared = m.AdoptAnnotated(ctx)
	}
	log.Info("pods restored from the previous agent", "restored", restored, "rules-repaired", repaired, "gone", pruned,
		"adopted-through-proc", adopted, "kept-without-netns", kept, "stale-annotations-cleared", cleared)

	// 3. Host probe table (exactly the restored members), then ztunnel,
	// then the plugin.
	if err := m.PruneHost(); err != nil {
		return fail(fmt.Errorf("host probe table in %s: %w (the agent needs CAP_NET_ADMIN, and CAP_SYS_ADMIN to enter that netns)", a.hostNetns, err))
	}
	log.Info("host probe SNAT table in place", "netns", a.hostNetns, "table", "inet nftcni-host")
	goWait(func() { m.GuardHost(ctx, 10*time.Second) })
	if z != nil {
		goWait(func() { _ = z.Serve(ctx, zl) })
		log.Info("serving ztunnel (ZDS)", "socket", a.ztunnelSocket, "snapshot", len(z.Known()))
	}
	switch src {
	case "kubernetes":
		goWait(func() { kube.Run(ctx, m.Reconcile) })
	case "static":
		goWait(func() {
			if err := podsource.Watch(ctx, store, a.podSource, a.nodeName, log, func() { writePolicy(); reconcileAll(ctx, m, store) }); err != nil {
				log.Error("cannot watch the pod source; it will not be reloaded", "dir", a.podSource, "err", err)
			}
		})
	}
	writeNow()
	sock := filepath.Join(c.runDir, wire.SocketName)
	l, err := events.Listen(sock)
	if err != nil {
		return fail(fmt.Errorf("plugin socket %s: %w (is another agent running?)", sock, err))
	}
	srv := events.NewServer(m, log, events.NewMetrics(reg))
	goWait(func() { _ = srv.Serve(ctx, l) })
	log.Info("serving the plugin", "socket", sock, "policy-snapshot", filepath.Join(c.runDir, wire.PolicyName))
	return &enrolment{mesh: m, kube: client, stop: stop}, nil
}
