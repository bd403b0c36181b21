package kube

import (
	"bytes"
	"context"
	"encoding/pem"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
)

// encoder is the codec factory's serializer for mediaType.
func encoder(t testing.TB, mediaType string) runtime.Encoder {
	info, ok := runtime.SerializerInfoForMediaType(codecs.SupportedMediaTypes(), mediaType)
	if !ok {
		t.Fatalf("no %s serializer", mediaType)
	}
	return codecs.EncoderForVersion(info.Serializer, corev1.SchemeGroupVersion)
}

// samplePod is a pod as the agent's informer sees one running: metadata
// with the labels and annotations the burst benchmark's pods carry, a
// container, and a status with conditions.
func samplePod() *corev1.Pod {
	now := metav1.Now()
	p := &corev1.Pod{
		TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "app-42", Namespace: "burst", UID: "0b02d2c0-81d7-48a8-9049-cfe7d7f265c6",
			ResourceVersion: "123456", CreationTimestamp: now,
			Labels:      map[string]string{"app": "burst", "istio.io/dataplane-mode": "ambient"},
			Annotations: map[string]string{"ambient.istio.io/redirection": "enabled"}},
		Spec: corev1.PodSpec{NodeName: "node-1", ServiceAccountName: "default",
			Containers: []corev1.Container{{Name: "app", Image: "registry.local/nodeapp:1", Args: []string{"serve", "--port", "8080"},
				Ports:     []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.22.0.42", HostIP: "10.0.0.2",
			PodIPs: []corev1.PodIP{{IP: "10.22.0.42"}}, StartTime: &now},
	}
	for _, c := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", Ready: true, Image: "registry.local/nodeapp:1",
		ContainerID: "containerd://6af6140691743c45f417612d24e87adec2ea1993b0d2d24701dfacec6",
		State:       corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}}}
	return p
}

// TestClientSpeaksProtobuf: the agent asks the API server for protobuf
// (JSON as the fallback), uncompressed, decodes the protobuf it gets back,
// and still sends its patches as the patch type they are.
func TestClientSpeaksProtobuf(t *testing.T) {
	pb := encoder(t, runtime.ContentTypeProtobuf)
	var mu sync.Mutex
	seen := map[string]http.Header{} // method -> the request's headers
	bodies := map[string]string{}
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen[r.Method], bodies[r.Method] = r.Header.Clone(), string(body)
		mu.Unlock()
		var obj runtime.Object = samplePod()
		if r.Method == http.MethodGet {
			obj = &corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"},
				ListMeta: metav1.ListMeta{ResourceVersion: "123456"}, Items: []corev1.Pod{*samplePod()}}
		}
		var buf bytes.Buffer
		if err := pb.Encode(obj, &buf); err != nil {
			t.Error(err)
		}
		w.Header().Set("Content-Type", runtime.ContentTypeProtobuf)
		w.Write(buf.Bytes())
	}))
	defer srv.Close()
	// TLS, as every API server is: without a TLS config client-go uses
	// Go's default transport and ignores the compression setting.
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	c, err := NewClient(&rest.Config{Host: srv.URL, TLSClientConfig: rest.TLSClientConfig{CAData: ca}})
	if err != nil {
		t.Fatal(err)
	}

	got, err := c.ListWatch("pods", nil).List(metav1.ListOptions{})
	if err != nil {
		t.Fatalf("listing pods answered in protobuf: %v", err)
	}
	list, ok := got.(*corev1.PodList)
	if !ok || len(list.Items) != 1 || list.Items[0].Status.PodIP != "10.22.0.42" || list.Items[0].Annotations["ambient.istio.io/redirection"] != "enabled" {
		t.Fatalf("decoded list %#v, want the sample pod", got)
	}
	if a := seen[http.MethodGet].Get("Accept"); !strings.HasPrefix(a, runtime.ContentTypeProtobuf+",") {
		t.Errorf("list Accept %q, want protobuf first", a)
	}
	if e := seen[http.MethodGet].Get("Accept-Encoding"); e != "" {
		t.Errorf("list Accept-Encoding %q, want none (uncompressed)", e)
	}

	patch := `{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}`
	if err := c.PatchPodStatus(context.Background(), "burst", "app-42", []byte(patch)); err != nil {
		t.Fatalf("patch answered in protobuf: %v", err)
	}
	if ct := seen[http.MethodPatch].Get("Content-Type"); ct != string(types.MergePatchType) {
		t.Errorf("patch Content-Type %q, want %s", ct, types.MergePatchType)
	}
	if bodies[http.MethodPatch] != patch {
		t.Errorf("patch body %q, want %q as given", bodies[http.MethodPatch], patch)
	}

	if err := c.DeletePod(context.Background(), "burst", "app-42", "0b02d2c0-81d7-48a8-9049-cfe7d7f265c6", "123456"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if ct := seen[http.MethodDelete].Get("Content-Type"); ct != runtime.ContentTypeProtobuf {
		t.Errorf("delete options sent as %q, want protobuf", ct)
	}
}

// BenchmarkDecodePod: what one pod update costs the agent's informer to
// decode, in each encoding the API server offers.
func BenchmarkDecodePod(b *testing.B) {
	for _, mt := range []string{runtime.ContentTypeJSON, runtime.ContentTypeProtobuf} {
		var buf bytes.Buffer
		if err := encoder(b, mt).Encode(samplePod(), &buf); err != nil {
			b.Fatal(err)
		}
		info, _ := runtime.SerializerInfoForMediaType(codecs.SupportedMediaTypes(), mt)
		dec := codecs.WithoutConversion().DecoderToVersion(info.Serializer, corev1.SchemeGroupVersion)
		b.Run(strings.TrimPrefix(mt, "application/"), func(b *testing.B) {
			b.ReportAllocs()
			b.ReportMetric(float64(buf.Len()), "bytes")
			for i := 0; i < b.N; i++ {
				if _, _, err := dec.Decode(buf.Bytes(), nil, &corev1.Pod{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
