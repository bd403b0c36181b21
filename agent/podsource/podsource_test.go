package podsource

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

const manifests = `apiVersion: v1
kind: Namespace
metadata:
  name: mesh
  labels:
    istio.io/dataplane-mode: ambient
---
apiVersion: v1
kind: Pod
metadata:
  name: app
  namespace: mesh
  uid: "1111"
spec:
  nodeName: node-a
  serviceAccountName: app-sa
  containers: [{name: app, image: x}]
---
apiVersion: v1
kind: Pod
metadata:
  name: elsewhere
  namespace: mesh
  uid: "2222"
spec:
  nodeName: node-b
`

const list = `{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web","uid":"3333"}}]}`

func write(t *testing.T, dir, name, body string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "10-mesh.yaml", manifests)
	write(t, dir, "20-list.json", list)
	write(t, dir, "README.md", "not a manifest")
	store := NewStore()
	bad, err := New(dir, "node-a", store, quiet()).Load()
	if err != nil || len(bad) != 0 {
		t.Fatal(err, bad)
	}
	if store.Pod("mesh", "elsewhere") != nil {
		t.Error("node-b's pod was loaded for node-a")
	}
	app, web := store.Pod("mesh", "app"), store.Pod("default", "web")
	if app == nil || web == nil || string(app.UID) != "1111" {
		t.Fatalf("pods: app %v, web %v (a pod without namespace is in default)", app, web)
	}
	// serviceAccountName defaults as the API server defaults it.
	if app.Spec.ServiceAccountName != "app-sa" || web.Spec.ServiceAccountName != "default" {
		t.Errorf("service accounts %q, %q; want app-sa, default", app.Spec.ServiceAccountName, web.Spec.ServiceAccountName)
	}
	if ns := store.Namespace("mesh"); ns == nil || ns.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Errorf("namespace mesh: %+v", ns)
	}
	for body, want := range map[string]string{
		"kind: Service\nmetadata: {name: s}\n":                         "want Pod, Namespace or List",
		"kind: Pod\nmetadata: {name: p, uid: u}\nspec: {bogus: 1}\n":   "unknown field",
		"kind: Pod\nmetadata: {uid: u}\n":                              "without a name",
		"kind: Pod\nmetadata: {name: nouid}\n":                         "pod default/nouid has no metadata.uid",
		"kind: [\n":                                                    "yaml",
		"kind: List\nitems: [{kind: Pod, metadata: {name: nouid2}}]\n": "pod default/nouid2 has no metadata.uid",
	} {
		bad := t.TempDir()
		write(t, bad, "bad.yaml", "kind: Namespace\nmetadata: {name: ok}\n---\n"+body)
		if _, err := LoadFile(filepath.Join(bad, "bad.yaml"), ""); err == nil || !strings.Contains(err.Error(), "bad.yaml document 2") || !strings.Contains(err.Error(), want) {
			t.Errorf("LoadFile(%q) = %v, want %q naming the file and document", body, err, want)
		}
	}
}

// One bad file does not stop the others, at start or later, and keeps its
// own last good content; a removed file's pods are gone.
func TestEachFileOnItsOwn(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "a.yaml", manifests)
	write(t, dir, "b.json", "{not json")
	store := NewStore()
	s := New(dir, "node-a", store, quiet())
	bad, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(bad) != 1 || !strings.Contains(bad[0].Error(), "b.json") {
		t.Errorf("bad files at start: %v, want b.json", bad)
	}
	if store.Pod("mesh", "app") == nil {
		t.Fatal("a bad file at start kept the good one from loading")
	}
	write(t, dir, "b.json", list)
	if _, err := s.Load(); err != nil || store.Pod("default", "web") == nil {
		t.Fatalf("fixed file not loaded: %v", err)
	}
	write(t, dir, "b.json", "kind: Pod\nmetadata: {name: web}\n") // no uid: bad again
	bad, _ = s.Load()
	if len(bad) != 1 || store.Pod("default", "web") == nil || string(store.Pod("default", "web").UID) != "3333" {
		t.Errorf("a broken file's last good content is not kept: bad %v, web %+v", bad, store.Pod("default", "web"))
	}
	os.Remove(filepath.Join(dir, "b.json"))
	if _, err := s.Load(); err != nil || store.Pod("default", "web") != nil || store.Pod("mesh", "app") == nil {
		t.Errorf("after removing b.json: web %v, app %v (%v)", store.Pod("default", "web"), store.Pod("mesh", "app"), err)
	}
}

func TestWatchReloads(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "pods.yaml", manifests)
	store := NewStore()
	s := New(dir, "node-a", store, quiet())
	if _, err := s.Load(); err != nil {
		t.Fatal(err)
	}
	var reloads atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- s.Watch(ctx, func() { reloads.Add(1) }) }()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(3 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	time.Sleep(50 * time.Millisecond) // let the watch arm
	write(t, dir, "more.json", list)
	waitFor("the new pod", func() bool { return store.Pod("default", "web") != nil })
	write(t, dir, "broken.yaml", "kind: [\n")
	waitFor("a reload after the broken file", func() bool { return reloads.Load() >= 2 })
	if store.Pod("default", "web") == nil || store.Pod("mesh", "app") == nil {
		t.Error("a broken manifest changed the store")
	}
	os.Remove(filepath.Join(dir, "more.json"))
	waitFor("the pod's removal", func() bool { return store.Pod("default", "web") == nil })
}
