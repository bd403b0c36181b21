package kube

import (
	"context"
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// API is all the agent asks of the Kubernetes API server.
type API interface {
	// ListWatch lists and watches a core/v1 resource ("pods",
	// "namespaces") in every namespace, tweak (may be nil) narrowing it.
	ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher
	// PatchPodStatus merge-patches a pod's status subresource.
	PatchPodStatus(ctx context.Context, namespace, name string, patch []byte) error
	// DeletePod deletes the pod only while it still has that UID and
	// resourceVersion (repair: the pod judged broken, not a newer one).
	DeletePod(ctx context.Context, namespace, name string, uid types.UID, resourceVersion string) error
	GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error)
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
	// PatchNode and PatchNodeStatus patch the node and its status (the
	// readiness gate's taint and condition).
	PatchNode(ctx context.Context, name string, pt types.PatchType, patch []byte) error
	PatchNodeStatus(ctx context.Context, name string, pt types.PatchType, patch []byte) error
}

// Client is API over client-go's REST client with a scheme of the two API
// groups the agent reads (core/v1, apps/v1). client-go's typed clientset
// would register every built-in API group at start-up: about 10 MB more
// resident memory for an agent that reads five resources.
type Client struct {
	core, apps *rest.RESTClient
}

var _ API = (*Client)(nil)

var codecs = func() serializer.CodecFactory {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err) // a registration conflict is a build defect
		}
	}
	return serializer.NewCodecFactory(s)
}()

// NewClient connects to the API server cfg names.
func NewClient(cfg *rest.Config) (*Client, error) {
	restFor := func(apiPath string, gv schema.GroupVersion) (*rest.RESTClient, error) {
		c := rest.CopyConfig(cfg)
		c.APIPath, c.GroupVersion = apiPath, &gv
		c.NegotiatedSerializer = codecs.WithoutConversion()
		// Protobuf, as the kubelet asks for: decoding a pod costs the agent
		// a fraction of its JSON, and the API server sends the encoding it
		// already made for the kubelet's watch of the same pods.
		c.ContentType = runtime.ContentTypeProtobuf
		c.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
		// Uncompressed: the API server (1.37) gzips each watcher's stream
		// on its own, and both ends pay the CPU for an agent whose traffic
		// is its own node's pods (SIG Scalability's trade, kubernetes#112296).
		c.DisableCompression = true
		if c.UserAgent == "" {
			c.UserAgent = rest.DefaultKubernetesUserAgent()
		}
		return rest.RESTClientFor(c)
	}
	core, err := restFor("/api", corev1.SchemeGroupVersion)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	apps, err := restFor("/apis", appsv1.SchemeGroupVersion)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return &Client{core: core, apps: apps}, nil
}

// ListWatch implements API.
func (c *Client) ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	if tweak == nil {
		tweak = func(*metav1.ListOptions) {}
	}
	return cache.NewFilteredListWatchFromClient(c.core, resource, metav1.NamespaceAll, tweak)
}

// PatchPodStatus implements API.
func (c *Client) PatchPodStatus(ctx context.Context, namespace, name string, patch []byte) error {
	return c.core.Patch(types.MergePatchType).Namespace(namespace).Resource("pods").Name(name).
		SubResource("status").Body(patch).Do(ctx).Error()
}

// GetDaemonSet implements API.
func (c *Client) GetDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	ds := &appsv1.DaemonSet{}
	err := c.apps.Get().Namespace(namespace).Resource("daemonsets").Name(name).Do(ctx).Into(ds)
	return ds, err
}

// GetNode implements API.
func (c *Client) GetNode(ctx context.Context, name string) (*corev1.Node, error) {
	n := &corev1.Node{}
	err := c.core.Get().Resource("nodes").Name(name).Do(ctx).Into(n)
	return n, err
}

// PatchNode implements API.
func (c *Client) PatchNode(ctx context.Context, name string, pt types.PatchType, patch []byte) error {
	return c.core.Patch(pt).Resource("nodes").Name(name).Body(patch).Do(ctx).Error()
}

// PatchNodeStatus implements API.
func (c *Client) PatchNodeStatus(ctx context.Context, name string, pt types.PatchType, patch []byte) error {
	return c.core.Patch(pt).Resource("nodes").Name(name).SubResource("status").Body(patch).Do(ctx).Error()
}

// DeletePod implements API.
func (c *Client) DeletePod(ctx context.Context, namespace, name string, uid types.UID, resourceVersion string) error {
	opts := &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &resourceVersion}}
	return c.core.Delete().Namespace(namespace).Resource("pods").Name(name).Body(opts).Do(ctx).Error()
}
