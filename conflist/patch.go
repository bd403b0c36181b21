package conflist

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"

	"github.com/containernetworking/cni/pkg/version"
	"github.com/tidwall/gjson"
	"github.com/tidwall/pretty"
	"github.com/tidwall/sjson"
)

// Entries returns our plugin entries (plugins whose "type" is ptype) in a
// network list, in order. Index on each result is the byte offset in doc.
func Entries(doc []byte, ptype string) []gjson.Result {
	var out []gjson.Result
	for _, p := range gjson.GetBytes(doc, "plugins").Array() {
		if p.Get("type").Str == ptype {
			out = append(out, p)
		}
	}
	return out
}

// HasEntry reports whether doc holds exactly one entry of type ptype and that
// entry means the same as want (same keys and values; formatting and key
// order are ignored). A hand-edited or stale entry does not count
// (istio#55913 checked only presence).
func HasEntry(doc []byte, ptype string, want []byte) bool {
	es := Entries(doc, ptype)
	return len(es) == 1 && SameJSON([]byte(es[0].Raw), want)
}

// SameJSON reports whether two JSON texts hold the same value.
func SameJSON(a, b []byte) bool {
	va, erra := decode(a)
	vb, errb := decode(b)
	return erra == nil && errb == nil && reflect.DeepEqual(va, vb)
}

func decode(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	err := d.Decode(&v)
	return v, err
}

// PredatesChaining says whether c's cniVersion (none: 0.1.0) is older than
// 0.3.0, where plugin lists and prevResult begin.
func PredatesChaining(c *Config) (bool, error) {
	v := c.CNIVersion
	if v == "" {
		v = "0.1.0"
	}
	ok, err := version.GreaterThanOrEqualTo(v, "0.3.0")
	if err != nil {
		return false, invalid(c.Path, "cniVersion %q: %v", c.CNIVersion, err)
	}
	return !ok, nil
}

// CheckChainable refuses a cniVersion older than 0.3.0, which a config can
// only be chained into by raising it (FromSingle, with a version its plugin
// speaks: istio#32137, forcing 0.3.1 broke plugins that only speak older
// ones).
func CheckChainable(c *Config) error {
	old, err := PredatesChaining(c)
	if err != nil {
		return err
	}
	if old {
		return fmt.Errorf("%s: cniVersion %q predates plugin chaining (0.3.0)", c.Path, c.CNIVersion)
	}
	return nil
}

// Insert returns doc (a network list) with exactly one entry of type ptype,
// equal to entry, at the end of "plugins". Stale or duplicate entries of ours
// are removed first. When doc already holds exactly that entry it is returned
// unchanged, so installing twice gives byte-identical output. Every byte
// outside our entry is kept; the entry is indented like its siblings.
func Insert(doc []byte, ptype string, entry []byte) ([]byte, error) {
	if !gjson.ValidBytes(entry) || !gjson.ParseBytes(entry).IsObject() {
		return nil, fmt.Errorf("plugin entry is not a JSON object")
	}
	if HasEntry(doc, ptype, entry) {
		return doc, nil
	}
	out, _, err := RemoveEntries(doc, ptype)
	if err != nil {
		return nil, err
	}
	arr := gjson.GetBytes(out, "plugins")
	elems := arr.Array()
	if !arr.IsArray() {
		return nil, fmt.Errorf(`"plugins" is not an array`)
	}
	if len(elems) == 0 { // the list held only entries of ours
		return sjson.SetRawBytes(out, "plugins", []byte("["+string(pretty.Ugly(entry))+arr.Raw[1:]))
	}
	last := elems[len(elems)-1]
	end := last.Index + len(last.Raw) - arr.Index // offset in arr.Raw
	var sep string
	if len(elems) > 1 {
		prev := elems[len(elems)-2]
		sep = string(out[prev.Index+len(prev.Raw) : last.Index])
	} else {
		sep = "," + arr.Raw[1:last.Index-arr.Index]
	}
	newArr := arr.Raw[:end] + sep + format(entry, sep, indentUnit(out)) + arr.Raw[end:]
	res, err := sjson.SetRawBytes(out, "plugins", []byte(newArr))
	if err != nil {
		return nil, err
	}
	if !gjson.ValidBytes(res) {
		return nil, fmt.Errorf("inserting the entry produced invalid JSON")
	}
	return res, nil
}

// RemoveEntries deletes every entry of type ptype from doc's "plugins", together
// with the separator that precedes it, which undoes Insert byte for byte.
func RemoveEntries(doc []byte, ptype string) ([]byte, int, error) {
	n := 0
	for {
		arr := gjson.GetBytes(doc, "plugins")
		elems := arr.Array()
		i := len(elems) - 1
		for ; i >= 0 && elems[i].Get("type").Str != ptype; i-- {
		}
		if i < 0 {
			return doc, n, nil
		}
		raw := arr.Raw
		off := func(r gjson.Result) int { return r.Index - arr.Index }
		var from, to int
		switch {
		case i > 0: // from the end of the previous element to the end of ours
			from, to = off(elems[i-1])+len(elems[i-1].Raw), off(elems[i])+len(elems[i].Raw)
		case len(elems) > 1: // first: from our start to the next element's start
			from, to = off(elems[0]), off(elems[1])
		default: // the only element
			from, to = off(elems[0]), off(elems[0])+len(elems[0].Raw)
		}
		out, err := sjson.SetRawBytes(doc, "plugins", []byte(raw[:from]+raw[to:]))
		if err != nil {
			return nil, n, err
		}
		doc = out
		n++
	}
}

// indentUnit guesses the file's indentation from the first member of the top
// object: "\n  \"name\"" gives two spaces, a compact file gives "".
func indentUnit(doc []byte) string {
	s := string(bytes.TrimLeft(doc, " \t\r\n"))
	if len(s) < 2 || s[0] != '{' {
		return ""
	}
	ws := s[1:]
	ws = ws[:len(ws)-len(strings.TrimLeft(ws, " \t\r\n"))]
	if i := strings.LastIndexByte(ws, '\n'); i >= 0 {
		return ws[i+1:]
	}
	return ""
}

// format renders entry for insertion after sep: compact when the list is on
// one line, else pretty-printed with the sibling's indentation as prefix.
func format(entry []byte, sep, unit string) string {
	nl := strings.LastIndexByte(sep, '\n')
	if nl < 0 || unit == "" {
		return string(pretty.Ugly(entry))
	}
	prefix := sep[nl+1:]
	p := pretty.PrettyOptions(entry, &pretty.Options{Width: 80, Prefix: prefix, Indent: unit})
	return strings.TrimSuffix(strings.TrimPrefix(string(p), prefix), "\n")
}

// FromSingle turns a single-plugin config into a network list that keeps its
// name and cniVersion and holds the original plugin object followed by our
// entry. A non-empty version replaces the cniVersion of a config older than
// chaining (the caller asks the plugin which it speaks). The original object
// keeps its bytes; libcni sets name and cniVersion on each plugin from the
// list anyway.
func FromSingle(c *Config, version, ptype string, entry []byte) ([]byte, error) {
	if c.Kind != Single {
		return nil, fmt.Errorf("%s is not a single-plugin config", c.Path)
	}
	if version == "" {
		version = c.CNIVersion
	}
	doc := []byte("{}")
	var err error
	if version != "" {
		doc, _ = sjson.SetBytes(doc, "cniVersion", version)
	}
	doc, _ = sjson.SetBytes(doc, "name", c.Name)
	doc, err = sjson.SetRawBytes(doc, "plugins", []byte("["+strings.TrimSpace(string(c.Data))+"]"))
	if err != nil {
		return nil, err
	}
	doc = pretty.PrettyOptions(doc, &pretty.Options{Width: 80, Indent: "  "})
	return Insert(doc, ptype, entry)
}
