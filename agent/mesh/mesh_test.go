package mesh

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/plugin/wire"
)

func newMesh(t *testing.T) (*Mesh, *MemStore) {
	t.Helper()
	pol, err := enablement.Compile(enablement.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	s := NewMemStore()
	s.PutNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{enablement.LabelDataplaneMode: "ambient"}}})
	s.PutNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "plain"}})
	s.PutPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "a", UID: "uid-a"}})
	s.PutPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "out", Labels: map[string]string{enablement.LabelDataplaneMode: "none"}}})
	s.PutPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "plain", Name: "b"}})
	m := New(pol, s, Options{RunDir: t.TempDir(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	m.LookupRetries = 1
	t.Cleanup(m.Close)
	return m, s
}

func wpod(ns, name, uid string) *wire.Pod {
	return &wire.Pod{Namespace: ns, Name: name, UID: uid, Attachment: wire.Attachment{ContainerID: "c-" + name, IfName: "eth0"}}
}

func TestDecide(t *testing.T) {
	m, _ := newMesh(t)
	ctx := context.Background()
	for _, tc := range []struct {
		pod     *wire.Pod
		want    wire.Mode
		wantErr string
	}{
		{wpod("mesh", "a", "uid-a"), wire.ModeAmbient, ""},
		{wpod("mesh", "out", ""), wire.ModeNone, ""},
		{wpod("plain", "b", ""), wire.ModeNone, ""},
		// Not in the cache: fail closed only where the namespace enrols.
		{wpod("mesh", "new", "u"), "", "not in the agent's cache"},
		{wpod("plain", "new", "u"), wire.ModeNone, ""},
		// A recreated pod of the same name is not the one we know.
		{wpod("mesh", "a", "uid-other"), "", "not in the agent's cache"},
	} {
		d, err := m.Decide(ctx, tc.pod)
		switch {
		case tc.wantErr != "":
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: %v %v, want error %q", tc.pod.Key(), d, err, tc.wantErr)
			}
		case err != nil || d.Mode != tc.want:
			t.Errorf("%s: %+v %v, want %s", tc.pod.Key(), d, err, tc.want)
		}
	}
}

func TestEnrolledKeepsADupAndGCReleasesIt(t *testing.T) {
	m, _ := newMesh(t)
	ctx := context.Background()
	f, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	a, b := wpod("mesh", "a", "uid-a"), wpod("mesh", "b", "")
	d := &wire.Decision{Mode: wire.ModeAmbient}
	for _, p := range []*wire.Pod{a, b} {
		if err := m.Added(ctx, p, d, f, nil); err != nil {
			t.Fatal(err)
		}
	}
	f.Close() // the server closes its copy; ours must stay usable
	if got := len(m.Members()); got != 2 {
		t.Fatalf("members %d", got)
	}
	for _, mb := range m.members {
		if _, err := mb.netns.Stat(); err != nil {
			t.Errorf("kept netns unusable: %v", err)
		}
	}
	if err := m.GC(ctx, []wire.Attachment{a.Attachment}); err != nil {
		t.Fatal(err)
	}
	if got := m.Members(); len(got) != 1 || got[0].Pod.Name != "a" {
		t.Errorf("after GC: %+v", got)
	}
	if err := m.Added(ctx, a, d, nil, os.ErrDeadlineExceeded); err != nil {
		t.Fatal(err)
	}
	if got := len(m.Members()); got != 0 {
		t.Errorf("a failed outcome kept the pod: %d", got)
	}
}

func TestPolicySnapshot(t *testing.T) {
	m, _ := newMesh(t)
	if err := m.WritePolicy(); err != nil {
		t.Fatal(err)
	}
	p, err := wire.ReadPolicy(filepath.Join(m.opts.RunDir, wire.PolicyName))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(p.EnrolledNamespaces, []string{"mesh"}) || !reflect.DeepEqual(p.ExcludeNamespaces, []string{"kube-system"}) {
		t.Errorf("namespaces: %+v", p)
	}
	want := map[string]wire.Mode{"mesh/a": wire.ModeAmbient, "mesh/out": wire.ModeNone, "plain/b": wire.ModeNone}
	if !reflect.DeepEqual(p.Pods, want) {
		t.Errorf("pods %v, want %v", p.Pods, want)
	}
}

type fakeZtunnel struct{ dels []string }

func (f *fakeZtunnel) Add(context.Context, string, zds.WorkloadInfo, *os.File) error { return nil }
func (f *fakeZtunnel) Del(uid string)                                                { f.dels = append(f.dels, uid) }
func (f *fakeZtunnel) Track(string, zds.WorkloadInfo, *os.File)                      {}

// A re-created sandbox shares its pod's UID: deleting the old sandbox must
// not take the pod away from ztunnel while the new one is enrolled.
func TestDeleteOldSandboxKeepsTheNewOne(t *testing.T) {
	m, _ := newMesh(t)
	z := &fakeZtunnel{}
	m.opts.Ztunnel = z
	ctx := context.Background()
	f, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := &wire.Decision{Mode: wire.ModeAmbient}
	old, cur := wpod("mesh", "a", "uid-a"), wpod("mesh", "a", "uid-a")
	old.ContainerID, cur.ContainerID = "sandbox-1", "sandbox-2"
	for _, p := range []*wire.Pod{old, cur} {
		if err := m.Added(ctx, p, d, f, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Deleted(ctx, old); err != nil {
		t.Fatal(err)
	}
	if len(z.dels) != 0 {
		t.Errorf("old sandbox's DEL sent ZDS Del %v while the new sandbox is enrolled", z.dels)
	}
	if err := m.Deleted(ctx, cur); err != nil {
		t.Fatal(err)
	}
	if len(z.dels) != 1 || z.dels[0] != "uid-a" {
		t.Errorf("last sandbox's DEL: ZDS Del %v", z.dels)
	}
}
