package mesh

import (
	"maps"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
)

// MemStore is a Store held in memory: what a static pod source loads into,
// and what unit tests fill directly.
type MemStore struct {
	mu   sync.RWMutex
	pods map[string]*corev1.Pod
	nss  map[string]*corev1.Namespace
}

// NewMemStore returns an empty store.
func NewMemStore() *MemStore {
	return &MemStore{pods: map[string]*corev1.Pod{}, nss: map[string]*corev1.Namespace{}}
}

// PutPod adds or replaces a pod.
func (s *MemStore) PutPod(p *corev1.Pod) {
	s.mu.Lock()
	s.pods[p.Namespace+"/"+p.Name] = p
	s.mu.Unlock()
}

// DeletePod removes a pod.
func (s *MemStore) DeletePod(namespace, name string) {
	s.mu.Lock()
	delete(s.pods, namespace+"/"+name)
	s.mu.Unlock()
}

// PutNamespace adds or replaces a namespace.
func (s *MemStore) PutNamespace(ns *corev1.Namespace) {
	s.mu.Lock()
	s.nss[ns.Name] = ns
	s.mu.Unlock()
}

// Pod implements Store.
func (s *MemStore) Pod(namespace, name string) *corev1.Pod {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pods[namespace+"/"+name]
}

// Namespace implements Store.
func (s *MemStore) Namespace(name string) *corev1.Namespace {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.nss[name]
}

// Pods implements Store.
func (s *MemStore) Pods() []*corev1.Pod {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return slices.Collect(maps.Values(s.pods))
}

// Namespaces implements Store.
func (s *MemStore) Namespaces() []*corev1.Namespace {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return slices.Collect(maps.Values(s.nss))
}

// Replace swaps the whole content at once, so readers see the old set or
// the new one.
func (s *MemStore) Replace(pods []*corev1.Pod, nss []*corev1.Namespace) {
	np := make(map[string]*corev1.Pod, len(pods))
	for _, p := range pods {
		np[p.Namespace+"/"+p.Name] = p
	}
	nn := make(map[string]*corev1.Namespace, len(nss))
	for _, n := range nss {
		nn[n.Name] = n
	}
	s.mu.Lock()
	s.pods, s.nss = np, nn
	s.mu.Unlock()
}
