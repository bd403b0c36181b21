package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/events"
	"github.com/nftcni/nftcni/agent/mesh"
	"github.com/nftcni/nftcni/agent/podsource"
	"github.com/nftcni/nftcni/plugin/wire"
)

// ambientFlags are the enrolment settings, named as istio-cni names them.
type ambientFlags struct {
	podSource, nodeName, systemNamespace, selectors string
	dnsCapture, ipv6                                bool
}

func (a *ambientFlags) register(f *flagSet) {
	f.str(&a.podSource, "pod-source", "POD_SOURCE", "", "directory of Pod and Namespace manifests to enrol from, for hosts without Kubernetes (watched)")
	f.str(&a.nodeName, "node-name", "NODE_NAME", "", "this node's name: pods bound to other nodes are ignored")
	f.str(&a.systemNamespace, "system-namespace", "SYSTEM_NAMESPACE", "istio-system", "ztunnel's namespace; its pods are never enrolled")
	f.str(&a.selectors, "ambient-enablement-selector", "AMBIENT_ENABLEMENT_SELECTOR", "", "JSON list of {podSelector, namespaceSelector}; empty: Istio's defaults on istio.io/dataplane-mode")
	f.boolean(&a.dnsCapture, "ambient-dns-capture", "AMBIENT_DNS_CAPTURE", true, "capture DNS to ztunnel's 15053 unless a pod says otherwise")
	f.boolean(&a.ipv6, "ambient-ipv6", "AMBIENT_IPV6", true, "add IPv6 rules for pods that have an IPv6 address")
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

// serveEvents starts the plugin's endpoint: the pod store, the mesh
// record, the policy snapshot and the socket server. stop waits for the
// server to finish its connections.
func serveEvents(ctx context.Context, c *common, a *ambientFlags, policy *enablement.Policy, reg prometheus.Registerer, log *slog.Logger) (*mesh.Mesh, func(), error) {
	store := mesh.NewMemStore()
	m := mesh.New(policy, store, c.runDir, log)
	writePolicy := func() {
		if err := m.WritePolicy(); err != nil {
			log.Error("could not write the policy snapshot the plugin falls back on", "path", filepath.Join(c.runDir, wire.PolicyName), "err", err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	var waits []chan struct{}
	if a.podSource != "" {
		if err := podsource.Sync(store, a.podSource, a.nodeName); err != nil {
			cancel()
			return nil, nil, fmt.Errorf("--pod-source: %w", err)
		}
		log.Info("enrolling from a static pod source", "dir", a.podSource, "pods", len(store.Pods()), "namespaces", len(store.Namespaces()))
		done := make(chan struct{})
		waits = append(waits, done)
		go func() {
			defer close(done)
			if err := podsource.Watch(ctx, store, a.podSource, a.nodeName, log, writePolicy); err != nil {
				log.Error("cannot watch the pod source; it will not be reloaded", "dir", a.podSource, "err", err)
			}
		}()
	} else {
		log.Warn("no pod source: the agent knows no pods, so every pod passes through un-enrolled")
	}
	writePolicy()
	sock := filepath.Join(c.runDir, wire.SocketName)
	l, err := events.Listen(sock)
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("plugin socket %s: %w (is another agent running?)", sock, err)
	}
	srv := events.NewServer(m, log, events.NewMetrics(reg))
	done := make(chan struct{})
	waits = append(waits, done)
	go func() {
		defer close(done)
		_ = srv.Serve(ctx, l)
	}()
	log.Info("serving the plugin", "socket", sock, "policy-snapshot", filepath.Join(c.runDir, wire.PolicyName))
	stop := func() {
		cancel()
		for _, w := range waits {
			<-w
		}
	}
	return m, stop, nil
}
