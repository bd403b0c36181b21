package conflist

import (
	"encoding/json"
	"os"
	"testing"
)

// BenchmarkInsert is our patch: locate with gjson, splice, set with sjson.
func BenchmarkInsert(b *testing.B) {
	doc, err := os.ReadFile("testdata/corpus/10-calico.conflist")
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, err := Insert(doc, ptype, testEntry); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInsertMapRoundTrip is the comparison: the encoding/json map
// round trip Istio, Linkerd, Kuma and Consul use, which also re-sorts keys
// and reformats the primary's file.
func BenchmarkInsertMapRoundTrip(b *testing.B) {
	doc, err := os.ReadFile("testdata/corpus/10-calico.conflist")
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		var m map[string]any
		var e map[string]any
		if err := json.Unmarshal(doc, &m); err != nil {
			b.Fatal(err)
		}
		if err := json.Unmarshal(testEntry, &e); err != nil {
			b.Fatal(err)
		}
		plugins := m["plugins"].([]any)
		kept := plugins[:0]
		for _, p := range plugins {
			if p.(map[string]any)["type"] != ptype {
				kept = append(kept, p)
			}
		}
		m["plugins"] = append(kept, e)
		if _, err := json.MarshalIndent(m, "", "  "); err != nil {
			b.Fatal(err)
		}
	}
}
