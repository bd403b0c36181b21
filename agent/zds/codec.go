// Package zds speaks Istio's ZDS protocol (package istio.workload.zds) to
// ztunnel: the agent listens on a unix SOCK_SEQPACKET socket, ztunnel
// connects and says hello, the agent sends a snapshot of the pods it knows
// (Add with the pod's netns fd, or Keep), then SnapshotSent, one ack per
// message; afterwards Add goes to the newest connection and Del to all.
//
// The messages are encoded by hand with protowire, field numbers exactly as
// istio's zdsapi/zds.proto (and ztunnel's src/inpod) define them:
//
//	enum Version { NOT_USED = 0; V1 = 1; }
//	message ZdsHello { Version version = 1; }
//	message WorkloadInfo { string name = 1; string namespace = 2; string service_account = 3; reserved 4; }
//	message AddWorkload { string uid = 1; WorkloadInfo workload_info = 2; }
//	message KeepWorkload { string uid = 1; }
//	message DelWorkload { string uid = 2; }
//	message SnapshotSent {}
//	message WorkloadRequest { oneof payload { AddWorkload add = 1; DelWorkload del = 2;
//	                                          SnapshotSent snapshot_sent = 3; KeepWorkload keep = 5; } }
//	message Ack { string error = 1; }
//	message WorkloadResponse { oneof payload { Ack ack = 1; } }
//
// Five messages do not justify generated code; the decoders below are
// fuzzed, and both directions are here so the test ztunnel shares them.
package zds

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// MaxMessage is ztunnel's limit for one message, both ways.
const MaxMessage = 1024

// VersionV1 is the only protocol version.
const VersionV1 = 1

// Kind says which payload a WorkloadRequest carries.
type Kind int

const (
	KindAdd          Kind = 1
	KindDel          Kind = 2
	KindSnapshotSent Kind = 3
	KindKeep         Kind = 5
)

func (k Kind) String() string {
	switch k {
	case KindAdd:
		return "AddWorkload"
	case KindDel:
		return "DelWorkload"
	case KindSnapshotSent:
		return "SnapshotSent"
	case KindKeep:
		return "KeepWorkload"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// WorkloadInfo names the pod for ztunnel's logs and metrics.
type WorkloadInfo struct {
	Name, Namespace, ServiceAccount string
}

// Request is one WorkloadRequest.
type Request struct {
	Kind Kind
	UID  string
	// Info is set on Add.
	Info *WorkloadInfo
}

// EncodeRequest marshals a WorkloadRequest.
func EncodeRequest(r *Request) ([]byte, error) {
	var inner []byte
	switch r.Kind {
	case KindAdd:
		inner = appendString(inner, 1, r.UID)
		if r.Info != nil {
			var wi []byte
			wi = appendString(wi, 1, r.Info.Name)
			wi = appendString(wi, 2, r.Info.Namespace)
			wi = appendString(wi, 3, r.Info.ServiceAccount)
			inner = protowire.AppendTag(inner, 2, protowire.BytesType)
			inner = protowire.AppendBytes(inner, wi)
		}
	case KindKeep:
		inner = appendString(inner, 1, r.UID)
	case KindDel:
		inner = appendString(inner, 2, r.UID)
	case KindSnapshotSent:
	default:
		return nil, fmt.Errorf("unknown request kind %d", r.Kind)
	}
	b := protowire.AppendTag(nil, protowire.Number(r.Kind), protowire.BytesType)
	b = protowire.AppendBytes(b, inner)
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("%s of %d bytes exceeds ZDS's %d-byte limit", r.Kind, len(b), MaxMessage)
	}
	return b, nil
}

// appendString writes a string field, omitting the proto3 default.
func appendString(b []byte, n protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, n, protowire.BytesType)
	return protowire.AppendString(b, s)
}

// DecodeRequest parses a WorkloadRequest (the test ztunnel's side).
func DecodeRequest(b []byte) (*Request, error) {
	var r *Request
	err := fields(b, func(n protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		k := Kind(n)
		switch k {
		case KindAdd, KindKeep, KindDel, KindSnapshotSent:
		default:
			return nil // unknown field: skip, as protobuf does
		}
		r = &Request{Kind: k} // oneof: the last one wins
		uidField := protowire.Number(1)
		if k == KindDel {
			uidField = 2
		}
		return fields(v, func(n protowire.Number, typ protowire.Type, v []byte) error {
			switch {
			case typ != protowire.BytesType:
			case n == uidField && k != KindSnapshotSent:
				r.UID = string(v)
				return validUTF8(v)
			case n == 2 && k == KindAdd:
				r.Info = &WorkloadInfo{}
				return fields(v, func(n protowire.Number, typ protowire.Type, v []byte) error {
					if typ == protowire.BytesType {
						switch n {
						case 1:
							r.Info.Name = string(v)
						case 2:
							r.Info.Namespace = string(v)
						case 3:
							r.Info.ServiceAccount = string(v)
						default:
							return nil
						}
						return validUTF8(v)
					}
					return nil
				})
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, errors.New("WorkloadRequest without a payload")
	}
	return r, nil
}

// EncodeHello marshals ZdsHello{version}.
func EncodeHello(version uint64) []byte {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	return protowire.AppendVarint(b, version)
}

// DecodeHello parses ZdsHello and returns its version.
func DecodeHello(b []byte) (uint64, error) {
	var v uint64
	err := fields(b, func(n protowire.Number, typ protowire.Type, raw []byte) error {
		if n == 1 && typ == protowire.VarintType {
			x, m := protowire.ConsumeVarint(raw)
			if m < 0 {
				return protowire.ParseError(m)
			}
			v = x
		}
		return nil
	})
	return v, err
}

// EncodeAck marshals WorkloadResponse{ack: Ack{error}}.
func EncodeAck(errText string) []byte {
	ack := appendString(nil, 1, errText)
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	return protowire.AppendBytes(b, ack)
}

// DecodeAck parses a WorkloadResponse; ok is false when it holds no ack.
func DecodeAck(b []byte) (errText string, ok bool, err error) {
	err = fields(b, func(n protowire.Number, typ protowire.Type, v []byte) error {
		if n != 1 || typ != protowire.BytesType {
			return nil
		}
		ok, errText = true, ""
		return fields(v, func(n protowire.Number, typ protowire.Type, v []byte) error {
			if n == 1 && typ == protowire.BytesType {
				errText = string(v)
				return validUTF8(v)
			}
			return nil
		})
	})
	return errText, ok, err
}

// validUTF8 refuses a proto3 string that is not UTF-8, as protobuf does.
func validUTF8(v []byte) error {
	if !utf8.Valid(v) {
		return errors.New("decoding ZDS message: a string field is not valid UTF-8")
	}
	return nil
}

// fields walks a message's fields; for varints v is the raw varint bytes,
// for length-delimited fields it is the content.
func fields(b []byte, f func(protowire.Number, protowire.Type, []byte) error) error {
	for len(b) > 0 {
		n, typ, m := protowire.ConsumeTag(b)
		if m < 0 {
			return fmt.Errorf("decoding ZDS message: %w", protowire.ParseError(m))
		}
		if n > protowire.MaxValidNumber { // ConsumeTag checks only the lower bound; protobuf refuses these
			return fmt.Errorf("decoding ZDS message: field number %d is out of range", n)
		}
		b = b[m:]
		var v []byte
		switch typ {
		case protowire.BytesType:
			c, l := protowire.ConsumeBytes(b)
			if l < 0 {
				return fmt.Errorf("decoding ZDS message: %w", protowire.ParseError(l))
			}
			v, m = c, l
		default:
			m = protowire.ConsumeFieldValue(n, typ, b)
			if m < 0 {
				return fmt.Errorf("decoding ZDS message: %w", protowire.ParseError(m))
			}
			v = b[:m]
		}
		if err := f(n, typ, v); err != nil {
			return err
		}
		b = b[m:]
	}
	return nil
}
