package wire

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft/nlsend"
)

func TestRoundTrip(t *testing.T) {
	msgs := []*Message{
		{Kind: KindAdd, Pod: &Pod{Namespace: "ns", Name: "p", UID: "u", Attachment: Attachment{ContainerID: "c", IfName: "eth0"},
			IPs: []string{"10.0.0.5/24", "fd00::5/64"}}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeAmbient, Reason: "r"},
			Batch: &nlsend.Batch{Tables: []byte{1, 2, 3}, Replace: []byte{4}, Routes: []byte{5, 6}}},
		{Kind: KindDecision, Decision: &Verdict{Mode: ModeSidecar, ConfirmsUndo: true},
			Batch: &nlsend.Batch{Tables: []byte{1}}},
		{Kind: KindOutcome, Logs: []json.RawMessage{json.RawMessage(`{"msg":"programmed"}`)}},
		{Kind: KindDone, Inspect: &Inspect{ZDS: "held", Verified: time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC), Repairs: 2, Drift: "table missing"}},
		{Kind: KindOutcome, Error: "boom"},
		{Kind: KindGC, Valid: []Attachment{{ContainerID: "c", IfName: "eth0"}}},
		{Kind: KindLog, Logs: []json.RawMessage{json.RawMessage(`{"msg":"x"}`)}},
	}
	for _, m := range msgs {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Errorf("round trip of %s:\n got %+v\nwant %+v", b, got, m)
		}
	}
}

func TestDecodeRefuses(t *testing.T) {
	for in, want := range map[string]string{
		``:                                       "decoding message",
		`{"kind":"add"}`:                         "without a pod",
		`{"kind":"del","pod":{"namespace":"n"}}`: "needs namespace, name and containerID",
		`{"kind":"decision"}`:                    "without a decision",
		`{"kind":"decision","decision":{"mode":"x"}}`:       "unknown mode",
		`{"kind":"decision","decision":{"mode":"ambient"}}`: "without a batch",
		`{"kind":"nope"}`:                            "unknown message kind",
		`{"kind":"status"} {"kind":"status"}`:        "trailing data",
		`{"kind":"status","valid":"x"}`:              "decoding message",
		`{"kind":"inspect","pod":{"namespace":"n"}}`: "needs a pod UID, or its namespace and name",
	} {
		if _, err := Decode([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Decode(%q) = %v, want %q", in, err, want)
		}
	}
	for _, ok := range []string{`{"kind":"inspect","pod":{"uid":"u"}}`, `{"kind":"inspect","pod":{"namespace":"n","name":"p"}}`} {
		if _, err := Decode([]byte(ok)); err != nil {
			t.Errorf("Decode(%q) = %v", ok, err)
		}
	}
	if _, err := Encode(&Message{Kind: KindLog, Logs: []json.RawMessage{json.RawMessage(`"` + strings.Repeat("x", MaxMessage) + `"`)}}); err == nil {
		t.Error("Encode accepted a message over the limit")
	}
}

func TestFallback(t *testing.T) {
	p := &Policy{ExcludeNamespaces: []string{"kube-system"}, EnrolledNamespaces: []string{"mesh"},
		Pods: map[string]Mode{"mesh/opted-out": ModeNone, "plain/labelled": ModeAmbient, "plain/side": ModeSidecar}}
	for _, tc := range []struct {
		ns, name string
		enrol    bool
	}{
		{"mesh", "new", true},         // enrolled namespace, unknown pod: fail closed
		{"mesh", "opted-out", false},  // the agent knew this pod opts out
		{"plain", "labelled", true},   // enrolled by its own label
		{"plain", "side", true},       // sidecar pods are captured too
		{"plain", "new", false},       // nothing enrols it
		{"kube-system", "dns", false}, // excluded
	} {
		got, why := p.Fallback(tc.ns, tc.ns+"/"+tc.name)
		if got != tc.enrol || why == "" {
			t.Errorf("Fallback(%s/%s) = %v (%s), want %v", tc.ns, tc.name, got, why, tc.enrol)
		}
	}
}

func TestSidecarInjection(t *testing.T) {
	for _, tc := range []struct {
		name string
		ann  map[string]string
		want Injection
	}{
		{"no annotations", nil, NotInjected},
		{"not injected", map[string]string{"a": "b"}, NotInjected},
		{"unreadable status", map[string]string{istio.AnnSidecarStatus: "{"}, NotInjected},
		{"injected", map[string]string{istio.AnnSidecarStatus: `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}, Sidecar},
		{"istio-init", map[string]string{istio.AnnSidecarStatus: `{"initContainers":["istio-init"],"containers":["istio-proxy"]}`}, CapturesItself},
		{"no proxy", map[string]string{istio.AnnSidecarStatus: `{"containers":["app"]}`}, NoProxy},
	} {
		got, why := SidecarInjection(tc.ann)
		if got != tc.want || (got != NotInjected && why == "") {
			t.Errorf("%s: %v (%q), want %v", tc.name, got, why, tc.want)
		}
	}
}

// FuzzDecode: any input either decodes into a message that satisfies its
// kind's invariants and re-encodes, or is refused; nothing panics.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"kind":"add","pod":{"namespace":"n","name":"p","containerID":"c","ifname":"eth0","ips":["10.0.0.1/24"]}}`,
		`{"kind":"decision","decision":{"mode":"ambient","ambient":{"DNSCapture":true}}}`,
		`{"kind":"decision","decision":{"mode":"sidecar","sidecar":{"annotations":{"a":"b"},"proxy":{"UID":1}}}}`,
		`{"kind":"gc","valid":[{"containerID":"c","ifname":"eth0"}]}`,
		`{"kind":"log","logs":[{"msg":"x"},[1]]}`,
		`{"kind":"status"}`, `{"kind":"error","error":"x"}`, `[]`, `null`, `{"kind":"add","pod":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		switch m.Kind {
		case KindAdd, KindDel, KindCheck:
			if m.Pod == nil || m.Pod.Namespace == "" || m.Pod.Name == "" || m.Pod.ContainerID == "" {
				t.Fatalf("%s decoded with an incomplete pod: %q", m.Kind, b)
			}
		case KindDecision:
			if m.Decision == nil {
				t.Fatalf("decision without decision: %q", b)
			}
		}
		// Re-encoding may only fail for size (JSON escaping can grow it).
		if _, err := Encode(m); err != nil && !strings.Contains(err.Error(), "limit") {
			t.Fatalf("decoded message does not re-encode: %v (%q)", err, b)
		}
	})
}
