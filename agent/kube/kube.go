// Package kube is the Kubernetes source of pods and namespaces: client-go
// informers for the pods bound to this node and for all namespaces, one
// rate-limited work queue that drives the mesh's reconcile, and the pod
// annotation that records enrolment state (ambient.istio.io/redirection,
// merge-patched on pods/status as istio-cni does).
package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/nftcni/nftcni/istio"
)

// Source watches Kubernetes. It implements mesh.Store and mesh.Annotator.
type Source struct {
	api     API
	log     *slog.Logger
	pods    corelisters.PodLister
	nss     corelisters.NamespaceLister
	podInf  cache.SharedIndexInformer
	nsInf   cache.SharedIndexInformer
	queue   workqueue.TypedRateLimitingInterface[string]
	events  *prometheus.CounterVec
	changed func()
}

// New watches the pods bound to node and all namespaces. changed (may be
// nil) is called after any change that can alter the policy snapshot.
func New(api API, node string, reg prometheus.Registerer, log *slog.Logger, changed func()) *Source {
	s := &Source{api: api, log: log, changed: changed,
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "nodeagent_reconcile_events_total", Help: "Pod and namespace events queued for reconcile, by type.",
		}, []string{"type"}),
		// Istio's limiter: per-item exponential 5 ms..5 s, overall 10 qps burst 100.
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.NewTypedMaxOfRateLimiter(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](5*time.Millisecond, 5*time.Second),
			&workqueue.TypedBucketRateLimiter[string]{Limiter: newLimiter()},
		), workqueue.TypedRateLimitingQueueConfig[string]{Name: "ambient"}),
	}
	if reg != nil {
		reg.MustRegister(s.events)
	}
	s.podInf = cache.NewSharedIndexInformer(api.ListWatch("pods", func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
	}), &corev1.Pod{}, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	s.nsInf = cache.NewSharedIndexInformer(api.ListWatch("namespaces", nil), &corev1.Namespace{}, 0, cache.Indexers{})
	for _, inf := range []cache.SharedIndexInformer{s.podInf, s.nsInf} {
		_ = inf.SetTransform(dropManagedFields)
	}
	s.pods, s.nss = corelisters.NewPodLister(s.podInf.GetIndexer()), corelisters.NewNamespaceLister(s.nsInf.GetIndexer())
	_, _ = s.podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.enqueuePod("add", o) },
		UpdateFunc: func(_, o any) { s.enqueuePod("update", o) },
		DeleteFunc: func(o any) { s.enqueuePod("delete", o) },
	})
	_, _ = s.nsInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(o any) { s.enqueueNamespace("add", o, nil) },
		UpdateFunc: func(old, o any) {
			s.enqueueNamespace("update", o, old)
		},
		DeleteFunc: func(o any) { s.notify() },
	})
	return s
}

// dropManagedFields keeps the server-side-apply bookkeeping out of the
// caches: the agent never reads it, and on a pod it is often the largest
// part of the object.
func dropManagedFields(o any) (any, error) {
	if m, ok := o.(metav1.Object); ok {
		m.SetManagedFields(nil)
	}
	return o, nil
}

func (s *Source) notify() {
	if s.changed != nil {
		s.changed()
	}
}

func (s *Source) enqueuePod(typ string, o any) {
	if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	s.events.WithLabelValues(typ).Inc()
	s.queue.Add(p.Namespace + "/" + p.Name)
	if typ != "update" {
		s.notify()
	}
}

// enqueueNamespace re-evaluates every pod of a namespace whose labels
// changed (or that just appeared).
func (s *Source) enqueueNamespace(typ string, o, old any) {
	ns, ok := o.(*corev1.Namespace)
	if !ok {
		return
	}
	if prev, ok := old.(*corev1.Namespace); ok && labels.Equals(prev.Labels, ns.Labels) {
		return
	}
	s.events.WithLabelValues("namespace-" + typ).Inc()
	pods, _ := s.pods.Pods(ns.Name).List(labels.Everything())
	for _, p := range pods {
		s.queue.Add(p.Namespace + "/" + p.Name)
	}
	s.notify()
}

// Start runs the informers and waits for their caches.
func (s *Source) Start(ctx context.Context) error {
	go s.podInf.RunWithContext(ctx)
	go s.nsInf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), s.podInf.HasSynced, s.nsInf.HasSynced) {
		return fmt.Errorf("informer caches of pods and namespaces did not sync: %w", context.Cause(ctx))
	}
	return nil
}

// Run works the queue with reconcile until ctx ends; failures are retried
// with backoff.
func (s *Source) Run(ctx context.Context, reconcile func(ctx context.Context, namespace, name string) error) {
	go func() { <-ctx.Done(); s.queue.ShutDown() }()
	for {
		key, quit := s.queue.Get()
		if quit {
			return
		}
		ns, name, _ := cache.SplitMetaNamespaceKey(key)
		if err := reconcile(ctx, ns, name); err != nil {
			s.log.Warn("reconcile failed; retrying", "pod", key, "err", err, "attempt", s.queue.NumRequeues(key)+1)
			s.queue.AddRateLimited(key)
		} else {
			s.queue.Forget(key)
		}
		s.queue.Done(key)
	}
}

// Pod implements mesh.Store.
func (s *Source) Pod(namespace, name string) *corev1.Pod {
	p, err := s.pods.Pods(namespace).Get(name)
	if err != nil {
		return nil
	}
	return p
}

// Namespace implements mesh.Store.
func (s *Source) Namespace(name string) *corev1.Namespace {
	n, err := s.nss.Get(name)
	if err != nil {
		return nil
	}
	return n
}

// Pods implements mesh.Store.
func (s *Source) Pods() []*corev1.Pod {
	out, _ := s.pods.List(labels.Everything())
	return out
}

// Namespaces implements mesh.Store.
func (s *Source) Namespaces() []*corev1.Namespace {
	out, _ := s.nss.List(labels.Everything())
	return out
}

// SetRedirection implements mesh.Annotator: a JSON merge patch on the
// pods/status subresource, as istio-cni does; "" removes the annotation,
// and a pod already gone is not an error then.
func (s *Source) SetRedirection(ctx context.Context, namespace, name, state string) error {
	var v any
	if state != "" {
		v = state
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{istio.AnnRedirection: v}}})
	err := s.api.PatchPodStatus(ctx, namespace, name, patch)
	if err != nil && state == "" && apierrors.IsNotFound(err) {
		return nil
	}
	return err
}
