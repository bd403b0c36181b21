package podsource

import (
	"maps"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
)

// Store holds pods and namespaces in memory (an enrol.Store): what a
// static pod source loads into, and what tests fill directly.
type Store struct {
	mu   sync.RWMutex
	pods map[string]*corev1.Pod
	nss  map[string]*corev1.Namespace
}

// NewStore returns an empty store.
func NewStore() *Store {
	return &Store{pods: map[string]*corev1.Pod{}, nss: map[string]*corev1.Namespace{}}
}

// PutPod adds or replaces a pod.
func (s *Store) PutPod(p *corev1.Pod) {
	s.mu.Lock()
	s.pods[p.Namespace+"/"+p.Name] = p
	s.mu.Unlock()
}

// DeletePod removes a pod.
func (s *Store) DeletePod(namespace, name string) {
	s.mu.Lock()
	delete(s.pods, namespace+"/"+name)
	s.mu.Unlock()
}

// PutNamespace adds or replaces a namespace.
func (s *Store) PutNamespace(ns *corev1.Namespace) {
	s.mu.Lock()
	s.nss[ns.Name] = ns
	s.mu.Unlock()
}

// Pod returns a pod, or nil.
func (s *Store) Pod(namespace, name string) *corev1.Pod {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pods[namespace+"/"+name]
}

// Namespace returns a namespace, or nil.
func (s *Store) Namespace(name string) *corev1.Namespace {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.nss[name]
}

// Pods lists the pods.
func (s *Store) Pods() []*corev1.Pod {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return slices.Collect(maps.Values(s.pods))
}

// Namespaces lists the namespaces.
func (s *Store) Namespaces() []*corev1.Namespace {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return slices.Collect(maps.Values(s.nss))
}

// Replace swaps the whole content at once, so readers see the old set or
// the new one.
func (s *Store) Replace(pods []*corev1.Pod, nss []*corev1.Namespace) {
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
