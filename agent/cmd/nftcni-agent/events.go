package main

import (
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nftcni/nftcni/agent/enablement"
	kubesrc "github.com/nftcni/nftcni/agent/kube"
	"github.com/nftcni/nftcni/agent/node"
	"github.com/nftcni/nftcni/agent/repair"
	"github.com/nftcni/nftcni/agent/runlock"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/istio"
)

// ambientFlags are the enrolment settings, named as istio-cni names them.
type ambientFlags struct {
	kubeconfig                                      string
	podSource, nodeName, systemNamespace, selectors string
	ztunnelSocket, hostNetns, procDir               string
	dnsCapture, ipv6                                bool
	probeSNAT                                       probeSNATFlags
	verifyEvery                                     time.Duration
	verifyConcurrency                               int
	repair                                          repair.Config
}

func (a *ambientFlags) register(f *flagSet) {
	f.str(&a.kubeconfig, "kubeconfig", "KUBECONFIG", "", "kubeconfig to watch pods and namespaces with (default: in-cluster config when running in a pod)")
	f.str(&a.podSource, "pod-source", "POD_SOURCE", "", "directory of Pod and Namespace manifests to enrol from instead of Kubernetes, for hosts without it (watched)")
	f.str(&a.nodeName, "node-name", "NODE_NAME", "", "this node's name: pods bound to other nodes are ignored")
	f.str(&a.systemNamespace, "system-namespace", "SYSTEM_NAMESPACE", istio.SystemNamespace, "ztunnel's namespace; its pods are never enrolled")
	f.str(&a.selectors, "ambient-enablement-selector", "AMBIENT_ENABLEMENT_SELECTOR", "", "JSON list of {podSelector, namespaceSelector}; empty: Istio's defaults on istio.io/dataplane-mode")
	f.boolean(&a.dnsCapture, "ambient-dns-capture", "AMBIENT_DNS_CAPTURE", true, "capture DNS to ztunnel's 15053 unless a pod says otherwise")
	ipv6Flag(f, &a.ipv6)
	a.probeSNAT.register(f)
	f.str(&a.ztunnelSocket, "ztunnel-socket", "ZTUNNEL_UDS_ADDRESS", zds.DefaultSocket, "ZDS socket ztunnel connects to; \"none\": no ztunnel (rules only, for tests and demos)")
	hostNetnsFlag(f, &a.hostNetns)
	f.str(&a.procDir, "proc-dir", "PROC_DIR", "/proc", "the host's /proc (the agent's pod mounts it at /host/proc): where the netns of pods that predate the agent is found")
	f.duration(&a.verifyEvery, "verify-interval", "VERIFY_INTERVAL", 30*time.Second, "how often every enrolled pod's ruleset and policy routes are verified and repaired (jittered by 10%); 0 turns it off")
	f.integer(&a.verifyConcurrency, "verify-concurrency", "VERIFY_CONCURRENCY", 4, "pods verified at once")
	// istio-cni's repair controller, under its flag names and defaults.
	d := repair.DefaultConfig()
	f.boolean(&a.repair.Enabled, "repair-enabled", "REPAIR_ENABLED", d.Enabled, "act on sidecar pods whose istio-validation init container failed (their traffic was not captured when it ran)")
	f.boolean(&a.repair.RepairPods, "repair-repair-pods", "REPAIR_REPAIR_PODS", d.RepairPods, "program such a pod's ruleset in place, found through /proc, so its check passes when kubelet runs it again (a pod that will not run it again is deleted or labelled instead)")
	f.boolean(&a.repair.DeletePods, "repair-delete-pods", "REPAIR_DELETE_PODS", d.DeletePods, "delete such pods, so they are re-created with capture in place (also those that will never run the init container again: restartPolicy Never)")
	f.boolean(&a.repair.LabelPods, "repair-label-pods", "REPAIR_LABEL_PODS", d.LabelPods, "label such pods (when not deleting them)")
	f.str(&a.repair.LabelKey, "repair-broken-pod-label-key", "REPAIR_BROKEN_POD_LABEL_KEY", d.LabelKey, "the label key --repair-label-pods sets")
	f.str(&a.repair.LabelValue, "repair-broken-pod-label-value", "REPAIR_BROKEN_POD_LABEL_VALUE", d.LabelValue, "the label value --repair-label-pods sets")
	f.str(&a.repair.SidecarAnnotation, "repair-sidecar-annotation", "REPAIR_SIDECAR_ANNOTATION", d.SidecarAnnotation, "only pods with this annotation are looked at")
	f.str(&a.repair.InitContainerName, "repair-init-container-name", "REPAIR_INIT_CONTAINER_NAME", d.InitContainerName, "the init container that checks capture")
	f.str(&a.repair.InitTerminationMsg, "repair-init-container-termination-message", "REPAIR_INIT_CONTAINER_TERMINATION_MESSAGE", d.InitTerminationMsg, "its termination message that means a failed check (empty: any)")
	f.integer(&a.repair.InitExitCode, "repair-init-container-exit-code", "REPAIR_INIT_CONTAINER_EXIT_CODE", d.InitExitCode, "its exit code that means a failed check (0: any)")
}

func (a *ambientFlags) policy(exclude []string) (*enablement.Policy, error) {
	cfg := enablement.DefaultConfig()
	cfg.ExcludeNamespaces, cfg.SystemNamespace = exclude, a.systemNamespace
	cfg.DNSCapture, cfg.IPv6 = a.dnsCapture, a.ipv6
	var err error
	if cfg.ProbeSNAT, err = a.probeSNAT.parse(); err != nil {
		return nil, err
	}
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

// nodeConfig is the enrolment side's Config (package node) from the
// flags, with the Kubernetes client when pods come from Kubernetes.
func nodeConfig(c *common, a *ambientFlags, policy *enablement.Policy, lock *runlock.Lock, reg prometheus.Registerer, log *slog.Logger) (node.Config, error) {
	cfg := node.Config{RunDir: c.runDir, StateDir: c.stateDir, HostNetns: a.hostNetns, ProcDir: a.procDir, IPv6: a.ipv6, ProbeSNAT: policy.Config().ProbeSNAT, Policy: policy,
		NodeName: a.nodeName, Repair: a.repair, VerifyEvery: a.verifyEvery, VerifyConcurrency: a.verifyConcurrency, Registry: reg, Log: log, Lock: lock}
	src, err := a.source()
	if err != nil {
		return cfg, err
	}
	if a.ztunnelSocket != "none" {
		cfg.ZtunnelSocket = a.ztunnelSocket
	}
	switch src {
	case "kubernetes":
		rc, err := a.restConfig()
		if err != nil {
			return cfg, err
		}
		kc, err := kubesrc.NewClient(rc)
		if err != nil {
			return cfg, err
		}
		cfg.Kube = kc
		log.Info("watching Kubernetes", "api", rc.Host, "node", a.nodeName)
	case "static":
		cfg.StaticDir = a.podSource
	}
	return cfg, nil
}
