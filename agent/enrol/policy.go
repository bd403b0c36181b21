package enrol

import (
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// podCleanup is the removal the plugin falls back on at DEL: every pod
// ruleset's table and policy routes.
var podCleanup = sync.OnceValues(func() (*nlsend.Removal, error) { return nft.EncodeRemoval(capture.PodCleanup()) })

// Policy computes, from the store, the snapshot the plugin falls back on
// when the agent cannot be reached (wire.Policy).
func (e *Enroller) Policy() *wire.Policy {
	cfg := e.policy.Config()
	p := &wire.Policy{Generated: time.Now().UTC(), ExcludeNamespaces: cfg.ExcludeNamespaces,
		EnrolledNamespaces: []string{}, Pods: map[string]wire.Mode{}}
	if c, err := podCleanup(); err != nil {
		e.log.Error("cannot encode the pod cleanup for the policy snapshot; the plugin's DEL leaves rules to go with the netns", "err", err)
	} else {
		p.Cleanup = c
	}
	nss := map[string]*corev1.Namespace{}
	for _, ns := range e.store.Namespaces() {
		nss[ns.Name] = ns
		if e.policy.NamespaceEnrols(ns) {
			p.EnrolledNamespaces = append(p.EnrolledNamespaces, ns.Name)
		}
	}
	sort.Strings(p.EnrolledNamespaces)
	for _, pod := range e.store.Pods() {
		p.Pods[pod.Namespace+"/"+pod.Name] = e.policy.Decide(pod, nss[pod.Namespace], nil).Mode
	}
	return p
}
