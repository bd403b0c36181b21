// Package podsource is the static source of pods and namespaces: a
// directory of Kubernetes manifests (YAML or JSON, several documents per
// file, kind Pod, Namespace or List), kept in a mesh.MemStore and reloaded
// when the directory changes. It drives the demo, and it lets nftcni enrol
// containers on hosts without Kubernetes.
package podsource

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/nftcni/nftcni/agent/mesh"
)

// Objects is what a directory holds.
type Objects struct {
	Pods       []*corev1.Pod
	Namespaces []*corev1.Namespace
}

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// Load reads every *.yaml, *.yml and *.json file in dir, in name order. A
// pod bound to another node (spec.nodeName set and not node) is left out
// when node is not empty. Errors name the file and document.
func Load(dir, node string) (*Objects, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := &Objects{}
	for _, e := range ents {
		ext := filepath.Ext(e.Name())
		if e.IsDir() || (ext != ".yaml" && ext != ".yml" && ext != ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		path := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		for i, doc := range docSeparator.Split(string(b), -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			if err := out.add([]byte(doc), node); err != nil {
				return nil, fmt.Errorf("%s document %d: %w", path, i+1, err)
			}
		}
	}
	return out, nil
}

func (o *Objects) add(doc []byte, node string) error {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	var head struct {
		Kind  string            `json:"kind"`
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(j, &head); err != nil {
		return err
	}
	strict := func(v any) error {
		d := json.NewDecoder(bytes.NewReader(j))
		d.DisallowUnknownFields()
		return d.Decode(v)
	}
	switch head.Kind {
	case "Pod":
		p := &corev1.Pod{}
		if err := strict(p); err != nil {
			return err
		}
		if p.Namespace == "" {
			p.Namespace = "default"
		}
		if p.Name == "" {
			return fmt.Errorf("pod without a name")
		}
		if node == "" || p.Spec.NodeName == "" || p.Spec.NodeName == node {
			o.Pods = append(o.Pods, p)
		}
	case "Namespace":
		n := &corev1.Namespace{}
		if err := strict(n); err != nil {
			return err
		}
		if n.Name == "" {
			return fmt.Errorf("namespace without a name")
		}
		o.Namespaces = append(o.Namespaces, n)
	case "List":
		for _, it := range head.Items {
			if err := o.add(it, node); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("kind %q: want Pod, Namespace or List", head.Kind)
	}
	return nil
}

// Sync makes store hold exactly what dir holds.
func Sync(store *mesh.MemStore, dir, node string) error {
	o, err := Load(dir, node)
	if err != nil {
		return err
	}
	store.Replace(o.Pods, o.Namespaces)
	return nil
}

// Watch reloads the store whenever dir changes, until ctx ends, and calls
// changed after each successful reload. A directory that does not parse
// leaves the store as it was (never half a directory).
func Watch(ctx context.Context, store *mesh.MemStore, dir, node string, log *slog.Logger, changed func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.Add(dir); err != nil {
		return err
	}
	reload := func() {
		if err := Sync(store, dir, node); err != nil {
			log.Error("pod source not reloaded; keeping the last good one", "dir", dir, "err", err)
			return
		}
		log.Info("pod source loaded", "dir", dir, "pods", len(store.Pods()), "namespaces", len(store.Namespaces()))
		if changed != nil {
			changed()
		}
	}
	var timer <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev := <-w.Events:
			if strings.HasPrefix(filepath.Base(ev.Name), ".") {
				continue
			}
			timer = time.After(20 * time.Millisecond) // one reload per burst of writes
		case err := <-w.Errors:
			log.Warn("watching the pod source", "dir", dir, "err", err)
		case <-timer:
			timer = nil
			reload()
		}
	}
}
