package conflist

import (
	"bytes"
	"testing"

	"github.com/tidwall/gjson"
)

// FuzzInsert checks the patcher's contract on any input a conf dir may hold:
// when Parse accepts a list, Insert gives valid JSON with exactly one entry of
// ours equal to the rendered one, and everything else is unchanged: removing
// our entries from the output gives what removing them from the input gives
// (and the input itself when it had none).
func FuzzInsert(f *testing.F) {
	for _, b := range corpus(f) {
		f.Add(b)
	}
	f.Add([]byte(`{"name":"n","plugins":[{"type":"nftcni"},{"type":"a"},{"type":"nftcni","x":1}]}`))
	f.Add([]byte(`{"name":"n","plugins":[ {"type":"a"} ]}`))
	f.Add([]byte("{\r\n\t\"name\" : \"n\" ,\r\n\t\"plugins\" : [\r\n\t\t{ \"type\" : \"a\" } ,\r\n\t\t{ \"type\" : \"b\" }\r\n\t]\r\n}\r\n"))
	f.Fuzz(func(t *testing.T, doc []byte) {
		c, err := Parse("f.conflist", doc)
		if err != nil || c.Kind != List {
			return
		}
		out, err := Insert(doc, ptype, testEntry)
		if err != nil {
			t.Fatalf("Insert failed on a config Parse accepted: %v", err)
		}
		if !gjson.ValidBytes(out) {
			t.Fatalf("output is not valid JSON:\n%s", out)
		}
		if _, err := Parse("f.conflist", out); err != nil {
			t.Fatalf("output does not parse: %v\n%s", err, out)
		}
		if !HasEntry(out, ptype, testEntry) {
			t.Fatalf("output does not hold exactly one entry equal to ours:\n%s", out)
		}
		again, err := Insert(out, ptype, testEntry)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("second insert changed the file (err %v)", err)
		}
		base, nIn, err := RemoveEntries(doc, ptype)
		if err != nil {
			t.Fatal(err)
		}
		back, _, err := RemoveEntries(out, ptype)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, base) {
			t.Fatalf("bytes outside our entry changed:\n in: %q\nout: %q", base, back)
		}
		if nIn == 0 && !bytes.Equal(back, doc) {
			t.Fatalf("uninstall is not byte-identical:\n in: %q\nout: %q", doc, back)
		}
	})
}
