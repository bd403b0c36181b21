package wire

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// The plugin's gjson codec and the agent's encoding/json one read and
// write the same messages.

func TestAppendAddDecodes(t *testing.T) {
	for _, p := range []*Pod{
		{Namespace: "ns", Name: "p", Attachment: Attachment{ContainerID: "c", IfName: "eth0"}},
		{Namespace: "n\"s", Name: "p\\q\u00e9\u2028", UID: "u-1", Attachment: Attachment{ContainerID: "c1", IfName: "net1"},
			IPs:   []string{"10.0.0.5/24", "fd00::5/64"},
			Netns: "/var/run/netns/cni-1"},
		{Namespace: "ns", Name: "p", Attachment: Attachment{ContainerID: "c", IfName: "eth0"}},
	} {
		for _, deadline := range []int64{0, 1796500000123456789} {
			b := AppendAdd(nil, p, deadline)
			m, err := Decode(b)
			if err != nil {
				t.Fatalf("%s: %v", b, err)
			}
			if m.Kind != KindAdd || !reflect.DeepEqual(m.Pod, p) || m.Deadline != deadline {
				t.Errorf("AppendAdd round trip:\n got %+v (deadline %d)\nwant %+v (deadline %d)\n%s", m.Pod, m.Deadline, p, deadline, b)
			}
		}
	}
}

func TestAppendOutcomeDecodes(t *testing.T) {
	for _, tc := range []struct {
		err  string
		logs []json.RawMessage
		t    *Timings
	}{
		{"", nil, &Timings{Decided: 1.25, Programmed: 2.5}},
		{"nf_tables transaction: \"file exists\"", []json.RawMessage{json.RawMessage(`{"level":"WARN","msg":"x"}`)}, nil},
	} {
		b := AppendOutcome(nil, tc.err, tc.logs, tc.t)
		m, err := Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if m.Kind != KindOutcome || m.Error != tc.err || !reflect.DeepEqual(m.Logs, tc.logs) || !reflect.DeepEqual(m.Timings, tc.t) {
			t.Errorf("AppendOutcome round trip: %+v from %s", m, b)
		}
	}
}

func TestParseReplyAgreesWithDecode(t *testing.T) {
	batch := &nlsend.Batch{Tables: []byte{1, 2, 3, 0xff}, Replace: []byte{4}, Routes: []byte{5}}
	for _, m := range []*Message{
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeNone, Reason: "no selector matches"}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeAmbient, Reason: "r"}, Batch: batch},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeSidecar}, Batch: &nlsend.Batch{Tables: []byte{9}}},
		// The agent programmed the ruleset itself: no batch.
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeSidecar, Programmed: true}},
		{Kind: KindDone},
		{Kind: KindError, Error: "pod x is not in the agent's cache"},
	} {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		r, err := ParseReply(b)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		want := &Reply{Kind: m.Kind, Error: m.Error}
		if m.Decision != nil {
			want.Mode, want.Reason, want.Batch, want.Programmed = m.Decision.Mode, m.Decision.Reason, m.Batch, m.Decision.Programmed
		}
		if !reflect.DeepEqual(r, want) {
			t.Errorf("ParseReply(%s) = %+v, want %+v", b, r, want)
		}
	}
}

// FuzzParseReply: whatever ParseReply accepts, Decode accepts as the same
// message; what Decode accepts as a reply, ParseReply accepts.
func FuzzParseReply(f *testing.F) {
	for _, s := range []string{`{"kind":"done"}`, `{"kind":"error","error":"x"}`,
		`{"kind":"decision","decision":{"mode":"none","reason":"r"}}`,
		"{\"kind\":\"decision\",\"decision\":{\"mode\":\"ambient\"},\"batch\":{\"tables\":3,\"routes\":1}}\x00\x01\x02\x03\x04",
		"{\"kind\":\"decision\",\"decision\":{\"mode\":\"sidecar\"},\"batch\":{\"tables\":0}}\x00",
		"{\"kind\":\"done\"}\x00junk"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, rerr := ParseReply(b)
		m, derr := Decode(b)
		reply := derr == nil && (m.Kind == KindDecision || m.Kind == KindDone || m.Kind == KindError)
		if rerr == nil && derr != nil {
			// Decode is stricter on fields ParseReply never reads (a
			// decision's spec, say); the fields both read must agree.
			return
		}
		if reply && rerr != nil {
			t.Fatalf("Decode accepted %s, ParseReply refused: %v", b, rerr)
		}
		if rerr != nil || !reply {
			return
		}
		if r.Kind != m.Kind || r.Error != m.Error {
			t.Fatalf("%s: ParseReply %+v, Decode %+v", b, r, m)
		}
		if m.Decision != nil && (r.Mode != m.Decision.Mode || r.Reason != m.Decision.Reason || r.Programmed != m.Decision.Programmed) {
			t.Fatalf("%s: decisions differ: %+v vs %+v", b, r, m.Decision)
		}
		if m.Batch != nil && r.Batch != nil && !bytes.Equal(r.Batch.Tables, m.Batch.Tables) {
			t.Fatalf("%s: batches differ", b)
		}
	})
}

// TestBatchTailRefusals: a batch's lengths must fill the bytes after the
// object exactly, and both codecs refuse the same tails.
func TestBatchTailRefusals(t *testing.T) {
	head := `{"kind":"decision","decision":{"mode":"ambient"},"batch":`
	for name, tc := range map[string]struct{ b, want string }{
		"short":          {head + `{"tables":4}}` + "\x00\x01\x02", "do not fill"},
		"long":           {head + `{"tables":1}}` + "\x00\x01\x02", "do not fill"},
		"negative":       {head + `{"tables":-1,"routes":2}}` + "\x00\x01", "do not fill"},
		"huge":           {head + `{"tables":9223372036854775807,"routes":2}}` + "\x00\x01", "do not fill"},
		"no tail":        {head + `{"tables":1}}`, "is missing"},
		"tail, no batch": {`{"kind":"decision","decision":{"mode":"none"}}` + "\x00\x01", "names no batch"},
		"not a length":   {head + `{"tables":"AQID"}}` + "\x00\x01", ""},
		"no object":      {"\x00\x01", "no JSON object"},
	} {
		_, derr := Decode([]byte(tc.b))
		_, rerr := ParseReply([]byte(tc.b))
		if derr == nil || rerr == nil || !strings.Contains(derr.Error(), tc.want) {
			t.Errorf("%s: Decode %v, ParseReply %v; want both to refuse (%q)", name, derr, rerr, tc.want)
		}
	}
	// The bytes come through as they went, without a copy per part.
	m := &Message{Kind: KindDecision, Decision: &Verdict{Mode: ModeAmbient}, Batch: &nlsend.Batch{Tables: []byte{0, 1, 0}, Routes: []byte{0}}}
	b, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	r, err := ParseReply(b)
	if err != nil || !bytes.Equal(r.Batch.Tables, []byte{0, 1, 0}) || r.Batch.Replace != nil || !bytes.Equal(r.Batch.Routes, []byte{0}) {
		t.Fatalf("ParseReply = %+v, %v", r, err)
	}
	if &r.Batch.Tables[0] != &b[len(b)-4] {
		t.Error("ParseReply copied the batch")
	}
}
