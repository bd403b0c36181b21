// Package podsource is the static source of pods and namespaces: a
// directory of Kubernetes manifests (YAML or JSON, several documents per
// file, kind Pod, Namespace or List), kept in a Store and reloaded when the
// directory changes. It drives the demo, and it lets nftcni enrol
// containers on hosts without Kubernetes.
//
// Each file is read on its own. A file that does not parse, or that holds
// a Pod the agent could not hand to ztunnel (no metadata.uid), is skipped
// with an error that names it, at start as on every reload, and the last
// content of it that did parse stays in use; the other files load. A
// removed file takes its pods and namespaces with it: to the agent those
// pods are deleted.
package podsource

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// Objects is what a file (or a directory) holds.
type Objects struct {
	Pods       []*corev1.Pod
	Namespaces []*corev1.Namespace
}

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// Source is a watched directory of manifests feeding a Store.
type Source struct {
	dir, node string
	store     *Store
	log       *slog.Logger
	files     map[string]*Objects // last good content per file name
}

// New returns a source for dir; pods bound to another node (spec.nodeName
// set and not node) are left out when node is not empty.
func New(dir, node string, store *Store, log *slog.Logger) *Source {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{dir: dir, node: node, store: store, log: log, files: map[string]*Objects{}}
}

// Load reads the directory into the store. It fails only when the
// directory itself cannot be read; bad files are logged and skipped, and
// it returns them.
func (s *Source) Load() (bad []error, err error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	for _, e := range ents {
		ext := filepath.Ext(e.Name())
		if e.IsDir() || (ext != ".yaml" && ext != ".yml" && ext != ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		seen[e.Name()] = true
		path := filepath.Join(s.dir, e.Name())
		o, err := LoadFile(path, s.node)
		if err != nil {
			bad = append(bad, err)
			if _, had := s.files[e.Name()]; had {
				s.log.Error("pod source file not loaded; keeping its last good content", "file", path, "err", err)
			} else {
				s.log.Error("pod source file not loaded; skipped", "file", path, "err", err)
			}
			continue
		}
		s.files[e.Name()] = o
	}
	for name := range s.files {
		if !seen[name] {
			delete(s.files, name) // removed: its pods are deleted
		}
	}
	s.store.Replace(s.merged())
	return bad, nil
}

// merged is every file's objects, in file name order; a later file's
// object of the same name wins.
func (s *Source) merged() ([]*corev1.Pod, []*corev1.Namespace) {
	names := make([]string, 0, len(s.files))
	for n := range s.files {
		names = append(names, n)
	}
	sort.Strings(names)
	var pods []*corev1.Pod
	var nss []*corev1.Namespace
	for _, n := range names {
		pods = append(pods, s.files[n].Pods...)
		nss = append(nss, s.files[n].Namespaces...)
	}
	return pods, nss
}

// LoadFile reads one manifest file. Errors name the file and document.
func LoadFile(path, node string) (*Objects, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	o := &Objects{}
	for i, doc := range docSeparator.Split(string(b), -1) {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		if err := o.add([]byte(doc), node); err != nil {
			return nil, fmt.Errorf("%s document %d: %w", path, i+1, err)
		}
	}
	return o, nil
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
			return errors.New("pod without a name")
		}
		if p.UID == "" {
			// The API server always sets one; ztunnel names workloads by it.
			return fmt.Errorf("pod %s/%s has no metadata.uid: give each pod a unique one", p.Namespace, p.Name)
		}
		if p.Spec.ServiceAccountName == "" {
			p.Spec.ServiceAccountName = "default" // as the API server defaults it
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
			return errors.New("namespace without a name")
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

// Watch reloads the store whenever the directory changes, until ctx ends,
// and calls changed after each reload.
func (s *Source) Watch(ctx context.Context, changed func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.Add(s.dir); err != nil {
		return err
	}
	reload := func() {
		if _, err := s.Load(); err != nil {
			s.log.Error("pod source not reloaded; keeping the last good one", "dir", s.dir, "err", err)
			return
		}
		s.log.Info("pod source loaded", "dir", s.dir, "pods", len(s.store.Pods()), "namespaces", len(s.store.Namespaces()))
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
			s.log.Warn("watching the pod source", "dir", s.dir, "err", err)
		case <-timer:
			timer = nil
			reload()
		}
	}
}
