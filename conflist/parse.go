// Package conflist finds the host's primary CNI network configuration and
// edits it byte-precisely: our plugin entry is added or removed with gjson and
// sjson, and every byte outside that entry stays exactly as the primary CNI
// wrote it. Files are written atomically and never through a symlink.
package conflist

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/tidwall/gjson"
)

// Kind tells how a runtime loads a file.
type Kind int

const (
	// List is a network configuration list (".conflist", or a ".json"/".conf"
	// holding a "plugins" array).
	List Kind = iota + 1
	// Single is a single-plugin network configuration (".conf"/".json" with a
	// top-level "type"); runtimes wrap it into a one-element list.
	Single
)

func (k Kind) String() string {
	switch k {
	case List:
		return "conflist"
	case Single:
		return "single-plugin conf"
	}
	return "unknown"
}

// Extensions are the file extensions containerd (go-cni) and CRI-O (ocicni)
// load from a CNI conf dir, in the order they document.
var Extensions = []string{".conf", ".conflist", ".json"}

// Loadable reports whether a runtime would try to load a file of this name.
func Loadable(name string) bool {
	ext := filepath.Ext(name)
	for _, e := range Extensions {
		if ext == e {
			return true
		}
	}
	return false
}

// MaxFileSize bounds what we read from a conf dir. Real conflists are a few
// KiB; anything this large is not a CNI config and must not be rewritten.
const MaxFileSize = 1 << 20

// ErrInvalid wraps every reason a file is not a usable network configuration.
var ErrInvalid = errors.New("invalid CNI network configuration")

// Config is a parsed view of a network configuration file. Data is the exact
// file content; nothing is re-serialized.
type Config struct {
	Path       string
	Data       []byte
	Kind       Kind
	Name       string
	CNIVersion string
	// Types lists the plugin types in order (one for Single).
	Types []string
}

func invalid(path, format string, args ...any) error {
	return fmt.Errorf("%w %s: %s", ErrInvalid, path, fmt.Sprintf(format, args...))
}

// Parse validates data the way libcni does before a runtime would use it:
// a JSON object with a string "name", an optional string "cniVersion", and
// either a non-empty "plugins" array of objects with a string "type", or
// (for .conf/.json) a top-level string "type".
func Parse(path string, data []byte) (*Config, error) {
	if len(data) == 0 {
		return nil, invalid(path, "file is empty (a zero-byte file is what a crash during a non-atomic write leaves behind)")
	}
	if len(data) > MaxFileSize {
		return nil, invalid(path, "file is %d bytes, larger than the %d bytes a CNI config can reasonably be", len(data), MaxFileSize)
	}
	if !gjson.ValidBytes(data) {
		return nil, invalid(path, "not valid JSON (truncated or hand-edited?)")
	}
	root := gjson.ParseBytes(data)
	if !root.IsObject() {
		return nil, invalid(path, "top level is %s, not a JSON object", typeName(root))
	}
	if k := duplicateKey(root); k != "" {
		return nil, invalid(path, "key %q appears twice; runtimes read the last one, JSON path tools the first, so nftcni will not edit this file", k)
	}
	c := &Config{Path: path, Data: data}
	if v := root.Get("cniVersion"); v.Exists() {
		if v.Type != gjson.String {
			return nil, invalid(path, `"cniVersion" is %s, not a string`, typeName(v))
		}
		c.CNIVersion = v.Str
	}
	name := root.Get("name")
	plugins := root.Get("plugins")
	isList := strings.HasSuffix(path, ".conflist") || plugins.Exists()
	if !isList {
		t := root.Get("type")
		if t.Type != gjson.String || t.Str == "" {
			return nil, invalid(path, `single-plugin config has no string "type"`)
		}
		if name.Exists() && name.Type != gjson.String {
			return nil, invalid(path, `"name" is %s, not a string`, typeName(name))
		}
		c.Kind, c.Name, c.Types = Single, name.Str, []string{t.Str}
		return c, nil
	}
	if name.Type != gjson.String {
		return nil, invalid(path, `network list has no string "name"`)
	}
	if !plugins.IsArray() {
		return nil, invalid(path, `"plugins" is %s, not an array`, typeName(plugins))
	}
	c.Kind, c.Name = List, name.Str
	for i, p := range plugins.Array() {
		if !p.IsObject() {
			return nil, invalid(path, "plugins[%d] is %s, not an object", i, typeName(p))
		}
		if k := duplicateKey(p); k != "" {
			return nil, invalid(path, "plugins[%d]: key %q appears twice", i, k)
		}
		t := p.Get("type")
		if t.Type != gjson.String || t.Str == "" {
			return nil, invalid(path, `plugins[%d] has no string "type"`, i)
		}
		c.Types = append(c.Types, t.Str)
	}
	if len(c.Types) == 0 {
		return nil, invalid(path, `"plugins" is empty`)
	}
	return c, nil
}

// duplicateKey returns a key that appears more than once in object r.
func duplicateKey(r gjson.Result) string {
	seen := map[string]bool{}
	dup := ""
	r.ForEach(func(k, _ gjson.Result) bool {
		if seen[k.Str] {
			dup = k.Str
			return false
		}
		seen[k.Str] = true
		return true
	})
	return dup
}

func typeName(r gjson.Result) string {
	switch {
	case !r.Exists():
		return "missing"
	case r.IsObject():
		return "an object"
	case r.IsArray():
		return "an array"
	}
	switch r.Type {
	case gjson.String:
		return "a string"
	case gjson.Number:
		return "a number"
	case gjson.True, gjson.False:
		return "a boolean"
	case gjson.Null:
		return "null"
	}
	return "unknown"
}
