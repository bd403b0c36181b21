package zds

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// zdsProto is istio.workload.zds as a descriptor, transcribed from
// zds.proto; the real protobuf runtime encodes and decodes with it, and our
// hand codec must agree byte for byte.
func zdsProto(t *testing.T) protoreflect.FileDescriptor {
	t.Helper()
	str := descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum()
	msg := descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum()
	opt := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()
	field := func(name string, n int32, typ *descriptorpb.FieldDescriptorProto_Type, typeName string, oneof *int32) *descriptorpb.FieldDescriptorProto {
		f := &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n), Type: typ, Label: opt, OneofIndex: oneof}
		if typeName != "" {
			f.TypeName = proto.String(".istio.workload.zds." + typeName)
		}
		return f
	}
	zero := proto.Int32(0)
	fd := &descriptorpb.FileDescriptorProto{
		Name: proto.String("zds.proto"), Package: proto.String("istio.workload.zds"), Syntax: proto.String("proto3"),
		EnumType: []*descriptorpb.EnumDescriptorProto{{Name: proto.String("Version"), Value: []*descriptorpb.EnumValueDescriptorProto{
			{Name: proto.String("NOT_USED"), Number: proto.Int32(0)}, {Name: proto.String("V1"), Number: proto.Int32(1)}}}},
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("ZdsHello"), Field: []*descriptorpb.FieldDescriptorProto{
				{Name: proto.String("version"), Number: proto.Int32(1), Label: opt, Type: descriptorpb.FieldDescriptorProto_TYPE_ENUM.Enum(), TypeName: proto.String(".istio.workload.zds.Version")}}},
			{Name: proto.String("WorkloadInfo"), Field: []*descriptorpb.FieldDescriptorProto{
				field("name", 1, str, "", nil), field("namespace", 2, str, "", nil), field("service_account", 3, str, "", nil)}},
			{Name: proto.String("AddWorkload"), Field: []*descriptorpb.FieldDescriptorProto{
				field("uid", 1, str, "", nil), field("workload_info", 2, msg, "WorkloadInfo", nil)}},
			{Name: proto.String("KeepWorkload"), Field: []*descriptorpb.FieldDescriptorProto{field("uid", 1, str, "", nil)}},
			{Name: proto.String("DelWorkload"), Field: []*descriptorpb.FieldDescriptorProto{field("uid", 2, str, "", nil)}},
			{Name: proto.String("SnapshotSent")},
			{Name: proto.String("WorkloadRequest"), OneofDecl: []*descriptorpb.OneofDescriptorProto{{Name: proto.String("payload")}},
				Field: []*descriptorpb.FieldDescriptorProto{
					field("add", 1, msg, "AddWorkload", zero), field("keep", 5, msg, "KeepWorkload", zero),
					field("del", 2, msg, "DelWorkload", zero), field("snapshot_sent", 3, msg, "SnapshotSent", zero)}},
			{Name: proto.String("Ack"), Field: []*descriptorpb.FieldDescriptorProto{field("error", 1, str, "", nil)}},
			{Name: proto.String("WorkloadResponse"), OneofDecl: []*descriptorpb.OneofDescriptorProto{{Name: proto.String("payload")}},
				Field: []*descriptorpb.FieldDescriptorProto{field("ack", 1, msg, "Ack", zero)}},
		},
	}
	f, err := protodesc.NewFile(fd, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestCodecMatchesTheProtoSchema(t *testing.T) {
	f := zdsProto(t)
	md := func(name string) protoreflect.MessageDescriptor { return f.Messages().ByName(protoreflect.Name(name)) }
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
		// The protobuf runtime reads our bytes as the schema says...
		m := dynamicpb.NewMessage(md("WorkloadRequest"))
		if err := proto.Unmarshal(ours, m); err != nil {
			t.Fatalf("%s: %v", r.Kind, err)
		}
		set := m.WhichOneof(m.Descriptor().Oneofs().ByName("payload"))
		if set == nil || int(set.Number()) != int(r.Kind) {
			t.Fatalf("%s decoded as %v", r.Kind, set)
		}
		inner := m.Get(set).Message()
		if r.Kind != KindSnapshotSent {
			if got := inner.Get(inner.Descriptor().Fields().ByName("uid")).String(); got != r.UID {
				t.Errorf("%s uid = %q, want %q", r.Kind, got, r.UID)
			}
		}
		// ...and its encoding of the same message is byte-identical to ours.
		theirs, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if string(theirs) != string(ours) {
			t.Errorf("%s: ours %x, protobuf %x", r.Kind, ours, theirs)
		}
		back, err := DecodeRequest(theirs)
		if err != nil || back.Kind != r.Kind || back.UID != r.UID || (r.Info != nil && *back.Info != *r.Info) {
			t.Errorf("%s: decoded back %+v %v", r.Kind, back, err)
		}
	}

	hello := dynamicpb.NewMessage(md("ZdsHello"))
	hello.Set(hello.Descriptor().Fields().ByName("version"), protoreflect.ValueOfEnum(1))
	hb, _ := proto.Marshal(hello)
	if string(hb) != string(EncodeHello(VersionV1)) {
		t.Errorf("hello: ours %x, protobuf %x", EncodeHello(VersionV1), hb)
	}
	if v, err := DecodeHello(hb); err != nil || v != VersionV1 {
		t.Errorf("DecodeHello = %d, %v", v, err)
	}
	for _, text := range []string{"", "netns gone"} {
		resp := dynamicpb.NewMessage(md("WorkloadResponse"))
		ack := dynamicpb.NewMessage(md("Ack"))
		ack.Set(ack.Descriptor().Fields().ByName("error"), protoreflect.ValueOfString(text))
		resp.Set(resp.Descriptor().Fields().ByName("ack"), protoreflect.ValueOfMessage(ack))
		rb, _ := proto.Marshal(resp)
		if string(rb) != string(EncodeAck(text)) {
			t.Errorf("ack %q: ours %x, protobuf %x", text, EncodeAck(text), rb)
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
