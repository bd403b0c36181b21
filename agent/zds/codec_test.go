package zds

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

// istioRequest is r in Istio's generated ZDS types (istio.io/istio
// pkg/zdsapi at the version go.mod pins): the oracle our hand codec must
// agree with byte for byte.
func istioRequest(r *Request) *zdsapi.WorkloadRequest {
	switch r.Kind {
	case KindAdd:
		a := &zdsapi.AddWorkload{Uid: r.UID}
		if r.Info != nil {
			a.WorkloadInfo = &zdsapi.WorkloadInfo{Name: r.Info.Name, Namespace: r.Info.Namespace, ServiceAccount: r.Info.ServiceAccount}
		}
		return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: a}}
	case KindKeep:
		return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: r.UID}}}
	case KindDel:
		return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: r.UID}}}
	case KindSnapshotSent:
		return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}
	}
	return nil
}

// fromIstio is what Istio's types decode of a request, as our Request.
func fromIstio(m *zdsapi.WorkloadRequest) (Kind, string) {
	switch p := m.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		return KindAdd, p.Add.GetUid()
	case *zdsapi.WorkloadRequest_Keep:
		return KindKeep, p.Keep.GetUid()
	case *zdsapi.WorkloadRequest_Del:
		return KindDel, p.Del.GetUid()
	case *zdsapi.WorkloadRequest_SnapshotSent:
		return KindSnapshotSent, ""
	}
	return 0, ""
}

func TestCodecMatchesIstiosZDSTypes(t *testing.T) {
	reqs := []*Request{
		{Kind: KindAdd, UID: "6b1e0d2a-cart", Info: &WorkloadInfo{Name: "cart", Namespace: "shop", ServiceAccount: "cart-sa"}},
		{Kind: KindAdd, UID: "u2"},
		{Kind: KindKeep, UID: "u3"},
		{Kind: KindDel, UID: "u4"},
		{Kind: KindSnapshotSent},
	}
	for _, r := range reqs {
		ours, err := EncodeRequest(r)
		if err != nil {
			t.Fatal(err)
		}
		// Istio's types read our bytes as the request we meant...
		var m zdsapi.WorkloadRequest
		if err := proto.Unmarshal(ours, &m); err != nil {
			t.Fatalf("%s: %v", r.Kind, err)
		}
		if k, uid := fromIstio(&m); k != r.Kind || uid != r.UID {
			t.Fatalf("%s decoded by Istio's types as %s %q", r.Kind, k, uid)
		}
		if r.Info != nil {
			wi := m.GetAdd().GetWorkloadInfo()
			if wi.GetName() != r.Info.Name || wi.GetNamespace() != r.Info.Namespace || wi.GetServiceAccount() != r.Info.ServiceAccount {
				t.Errorf("%s workload info decoded as %v", r.Kind, wi)
			}
		}
		// ...their encoding of it is byte-identical to ours...
		theirs, err := proto.MarshalOptions{Deterministic: true}.Marshal(istioRequest(r))
		if err != nil {
			t.Fatal(err)
		}
		if string(theirs) != string(ours) {
			t.Errorf("%s: ours %x, Istio's %x", r.Kind, ours, theirs)
		}
		// ...and we read theirs back.
		back, err := DecodeRequest(theirs)
		if err != nil || back.Kind != r.Kind || back.UID != r.UID || (r.Info != nil && *back.Info != *r.Info) {
			t.Errorf("%s: decoded back %+v %v", r.Kind, back, err)
		}
	}

	hb, _ := proto.Marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	if string(hb) != string(EncodeHello(VersionV1)) {
		t.Errorf("hello: ours %x, Istio's %x", EncodeHello(VersionV1), hb)
	}
	if v, err := DecodeHello(hb); err != nil || v != VersionV1 {
		t.Errorf("DecodeHello = %d, %v", v, err)
	}
	for _, text := range []string{"", "netns gone"} {
		rb, _ := proto.Marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: text}}})
		if string(rb) != string(EncodeAck(text)) {
			t.Errorf("ack %q: ours %x, Istio's %x", text, EncodeAck(text), rb)
		}
		got, ok, err := DecodeAck(rb)
		if err != nil || !ok || got != text {
			t.Errorf("DecodeAck = %q %v %v", got, ok, err)
		}
	}
	if _, ok, _ := DecodeAck(nil); ok {
		t.Error("an empty response decoded as an ack")
	}
	long := &Request{Kind: KindAdd, UID: string(make([]byte, MaxMessage))}
	if _, err := EncodeRequest(long); err == nil {
		t.Error("a request over 1024 bytes was encoded")
	}
}

func FuzzDecode(f *testing.F) {
	for _, r := range []*Request{{Kind: KindAdd, UID: "u", Info: &WorkloadInfo{Name: "n", Namespace: "ns"}}, {Kind: KindDel, UID: "u"}, {Kind: KindSnapshotSent}} {
		b, _ := EncodeRequest(r)
		f.Add(b)
	}
	f.Add(EncodeAck("x"))
	f.Add(EncodeHello(1))
	f.Fuzz(func(t *testing.T, b []byte) {
		if r, err := DecodeRequest(b); err == nil {
			// Whatever we accept, Istio's types read the same way.
			var m zdsapi.WorkloadRequest
			if err := proto.Unmarshal(b, &m); err != nil {
				t.Fatalf("we decoded %x as %+v; Istio's types refuse it: %v", b, r, err)
			}
			if k, uid := fromIstio(&m); k != r.Kind || uid != r.UID {
				t.Fatalf("we decoded %x as %s %q; Istio's types as %s %q", b, r.Kind, r.UID, k, uid)
			}
			if r.Kind != KindAdd && r.Kind != KindDel && r.Kind != KindKeep && r.Kind != KindSnapshotSent {
				t.Fatalf("decoded an unknown kind %d", r.Kind)
			}
			if len(r.UID) <= MaxMessage-8 && (r.Info == nil || len(r.Info.Name)+len(r.Info.Namespace)+len(r.Info.ServiceAccount) < 512) {
				if _, err := EncodeRequest(r); err != nil {
					t.Fatalf("decoded request does not re-encode: %v", err)
				}
			}
		}
		_, _, _ = DecodeAck(b)
		_, _ = DecodeHello(b)
	})
}
