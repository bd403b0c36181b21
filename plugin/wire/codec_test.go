package wire

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// The codec's oracle is encoding/json on Message's struct tags: what an
// agent or a plugin of before this codec wrote and read. Encode's bytes
// read back with encoding/json as the same message; encoding/json's bytes
// decode as the same message.

// oracleEncode is a message as encoding/json writes it.
func oracleEncode(t testing.TB, m *Message) []byte {
	t.Helper()
	env := envelope{Message: m}
	if m.Batch != nil {
		env.Batch = &batchLen{Tables: len(m.Batch.Tables), Replace: len(m.Batch.Replace), Routes: len(m.Batch.Routes)}
	}
	b, err := json.Marshal(&env)
	if err != nil {
		t.Fatal(err)
	}
	if m.Batch != nil {
		b = append(append(append(append(b, tailMark), m.Batch.Tables...), m.Batch.Replace...), m.Batch.Routes...)
	}
	return b
}

// oracleDecode reads a message as encoding/json does; the batch is
// checked by the caller.
func oracleDecode(t testing.TB, b []byte) *Message {
	t.Helper()
	obj, _, _ := bytes.Cut(b, []byte{tailMark})
	m := &Message{}
	if err := json.Unmarshal(obj, &envelope{Message: m}); err != nil {
		t.Fatalf("encoding/json cannot read %q: %v", b, err)
	}
	return m
}

// samples are messages of every kind, with strings that need escaping.
func samples() []*Message {
	batch := &nlsend.Batch{Tables: []byte{1, 2, 3, 0xff}, Replace: []byte{4}, Routes: []byte{5}}
	pod := &Pod{Namespace: "n\"s", Name: "p\\q\u00e9\u2028<&>", UID: "u-1", Attachment: Attachment{ContainerID: "c1", IfName: "net1"},
		IPs: []string{"10.0.0.5/24", "fd00::5/64"}, Netns: "/var/run/netns/cni-1"}
	return []*Message{
		{Kind: KindAdd, Pod: pod, Deadline: 1796500000123456789},
		{Kind: KindAdd, Pod: &Pod{Namespace: "ns", Name: "p", Attachment: Attachment{ContainerID: "c", IfName: "eth0"}}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeNone, Reason: "no selector matches"}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeAmbient, Reason: "r"}, Batch: batch},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeSidecar}, Batch: &nlsend.Batch{Tables: []byte{9}}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeSidecar, Programmed: true}},
		{Kind: KindDone},
		{Kind: KindError, Error: "pod x is not in the agent's cache"},
		{Kind: KindError, Error: "no ztunnel connection", Retry: true},
		{Kind: KindOutcome, Timings: &Timings{Decided: 1.25, Programmed: 2.5}},
		{Kind: KindOutcome, Error: "nf_tables transaction: \"file exists\"", Logs: []json.RawMessage{json.RawMessage(`{"level":"WARN","msg":"x"}`)}},
		{Kind: KindDel, Pod: pod, Logs: []json.RawMessage{json.RawMessage(`{"msg":"a"}`), json.RawMessage(`[1,2]`)}, Deadline: 5},
		{Kind: KindCheck, Pod: pod},
		{Kind: KindStatus},
		{Kind: KindGC, Valid: []Attachment{{ContainerID: "c", IfName: "eth0"}, {ContainerID: "d", IfName: "net1"}}},
		{Kind: KindInspect, Pod: &Pod{UID: "u"}},
		{Kind: KindDone, Inspect: &Inspect{ZDS: "held", Verified: time.Date(2026, 12, 2, 0, 0, 0, 123, time.UTC), Repairs: 2, Drift: "table missing",
			Pod: pod, Enrolment: "none (left in place)"}},
		{Kind: KindDone, Inspect: &Inspect{ZDS: ""}},
		{Kind: KindLog, Logs: []json.RawMessage{json.RawMessage(`{"msg":"x"}`)}},
	}
}

func TestCodecAgreesWithEncodingJSON(t *testing.T) {
	for _, m := range samples() {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		// Ours, read by the oracle.
		got := oracleDecode(t, b)
		got.Batch = m.Batch
		if !reflect.DeepEqual(got, m) {
			t.Errorf("encoding/json reads %q as\n %+v\nwant %+v", b, got, m)
		}
		// Ours, read by ours.
		if got, err := Decode(b); err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("Decode(%q) = %+v, %v\nwant %+v", b, got, err, m)
		}
		// The oracle's, read by ours.
		ob := oracleEncode(t, m)
		if got, err := Decode(ob); err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("Decode of encoding/json's %q = %+v, %v\nwant %+v", ob, got, err, m)
		}
	}
}

// FuzzDecodeAgreesWithEncodingJSON: whatever Decode accepts re-encodes,
// and encoding/json reads the re-encoding as the same message.
func FuzzDecodeAgreesWithEncodingJSON(f *testing.F) {
	for _, m := range samples() {
		b, _ := Encode(m)
		f.Add(b)
	}
	for _, s := range []string{`{"kind":"decision","decision":{"mode":"none","reason":"r"},"x":[1,{"y":null}]}`,
		"{\"kind\":\"done\"}\x00junk", `{"kind":"status","pod":null,"deadline":1e3}`, `{"kind":"log","logs":[{"msg":"x"},[1]]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		re, err := Encode(m)
		if err != nil {
			if !strings.Contains(err.Error(), "limit") {
				t.Fatalf("decoded message does not re-encode: %v (%q)", err, b)
			}
			return
		}
		got := oracleDecode(t, re)
		got.Batch = m.Batch
		// encoding/json compacts raw logs; ours keeps them as sent.
		for i := range got.Logs {
			var c bytes.Buffer
			if json.Compact(&c, m.Logs[i]) == nil && bytes.Equal(c.Bytes(), got.Logs[i]) {
				got.Logs[i] = m.Logs[i]
			}
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("%q decodes as %+v; re-encoded %q, encoding/json reads %+v", b, m, re, got)
		}
	})
}

// TestBatchTailRefusals: a batch's lengths must fill the bytes after the
// object exactly.
func TestBatchTailRefusals(t *testing.T) {
	head := `{"kind":"decision","decision":{"mode":"ambient"},"batch":`
	for name, tc := range map[string]struct{ b, want string }{
		"short":          {head + `{"tables":4}}` + "\x00\x01\x02", "do not fill"},
		"long":           {head + `{"tables":1}}` + "\x00\x01\x02", "do not fill"},
		"negative":       {head + `{"tables":-1,"routes":2}}` + "\x00\x01", "do not fill"},
		"huge":           {head + `{"tables":9223372036854775807,"routes":2}}` + "\x00\x01", "do not fill"},
		"no tail":        {head + `{"tables":1}}`, "is missing"},
		"tail, no batch": {`{"kind":"decision","decision":{"mode":"none"}}` + "\x00\x01", "names no batch"},
		"not a length":   {head + `{"tables":"AQID"}}` + "\x00\x01", "not a length"},
		"no object":      {"\x00\x01", "no JSON object"},
		"programmed, with a batch": {`{"kind":"decision","decision":{"mode":"ambient","programmed":true},"batch":{"tables":1}}` + "\x00\x01",
			"a batch for a ruleset the agent programmed"},
	} {
		if _, err := Decode([]byte(tc.b)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Decode %v; want a refusal (%q)", name, err, tc.want)
		}
	}
	// The bytes come through as they went, without a copy per part.
	m := &Message{Kind: KindDecision, Decision: &Verdict{Mode: ModeAmbient}, Batch: &nlsend.Batch{Tables: []byte{0, 1, 0}, Routes: []byte{0}}}
	b, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Decode(b)
	if err != nil || !bytes.Equal(r.Batch.Tables, []byte{0, 1, 0}) || r.Batch.Replace != nil || !bytes.Equal(r.Batch.Routes, []byte{0}) {
		t.Fatalf("Decode = %+v, %v", r, err)
	}
	if &r.Batch.Tables[0] != &b[len(b)-4] {
		t.Error("Decode copied the batch")
	}
}
