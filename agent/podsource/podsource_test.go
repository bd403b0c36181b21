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

	"github.com/nftcni/nftcni/agent/mesh"
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
  containers: [{name: app, image: x}]
---
apiVersion: v1
kind: Pod
metadata:
  name: elsewhere
  namespace: mesh
spec:
  nodeName: node-b
`

const list = `{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web"}}]}`

func write(t *testing.T, dir, name, body string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "10-mesh.yaml", manifests)
	write(t, dir, "20-list.json", list)
	write(t, dir, "README.md", "not a manifest")
	o, err := Load(dir, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range o.Pods {
		names = append(names, p.Namespace+"/"+p.Name)
	}
	if strings.Join(names, ",") != "mesh/app,default/web" {
		t.Errorf("pods %v (node-b's pod must be left out, a pod without namespace is in default)", names)
	}
	if len(o.Namespaces) != 1 || o.Namespaces[0].Labels["istio.io/dataplane-mode"] != "ambient" || string(o.Pods[0].UID) != "1111" {
		t.Errorf("objects %+v", o)
	}
	for body, want := range map[string]string{
		"kind: Service\nmetadata: {name: s}\n":               "want Pod, Namespace or List",
		"kind: Pod\nmetadata: {name: p}\nspec: {bogus: 1}\n": "unknown field",
		"kind: Pod\nmetadata: {}\n":                          "without a name",
		"kind: [\n":                                          "yaml",
	} {
		bad := t.TempDir()
		write(t, bad, "bad.yaml", "kind: Namespace\nmetadata: {name: ok}\n---\n"+body)
		if _, err := Load(bad, ""); err == nil || !strings.Contains(err.Error(), "bad.yaml document 2") || !strings.Contains(err.Error(), want) {
			t.Errorf("Load(%q) = %v, want %q naming the file and document", body, err, want)
		}
	}
}

func TestWatchReloadsAndKeepsLastGood(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "pods.yaml", manifests)
	store := mesh.NewMemStore()
	if err := Sync(store, dir, "node-a"); err != nil {
		t.Fatal(err)
	}
	var reloads atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		done <- Watch(ctx, store, dir, "node-a", slog.New(slog.NewTextHandler(io.Discard, nil)), func() { reloads.Add(1) })
	}()
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
	// A write can arrive as several events more than one debounce apart
	// (create, then write): count reloads only once they have settled.
	n := reloads.Load()
	for settled := time.Now(); time.Since(settled) < 150*time.Millisecond; time.Sleep(10 * time.Millisecond) {
		if m := reloads.Load(); m != n {
			n, settled = m, time.Now()
		}
	}
	write(t, dir, "broken.yaml", "kind: [\n")
	time.Sleep(200 * time.Millisecond)
	if store.Pod("default", "web") == nil || store.Pod("mesh", "app") == nil || reloads.Load() != n {
		t.Error("a broken manifest changed the store")
	}
	os.Remove(filepath.Join(dir, "broken.yaml"))
	os.Remove(filepath.Join(dir, "more.json"))
	waitFor("the pod's removal", func() bool { return store.Pod("default", "web") == nil })
}
