package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// The one codec of the protocol, both sides: Encode writes a Message by
// hand and Decode reads it with gjson. The plugin is exec'd for every pod
// sandbox, and the first use of encoding/json's reflection costs a fresh
// process about 25 page faults (0.2 ms here); the bytes are the JSON that
// encoding/json makes and reads of Message (its struct tags), which the
// tests hold them to.

// envelope is a Message as encoding/json sees it on the wire (the tests'
// oracle): a batch is named in the JSON by the lengths of its parts, and
// its bytes follow the object.
type envelope struct {
	*Message
	Batch *batchLen `json:"batch,omitempty"`
}

// batchLen gives the length of each part of a batch in a message's tail,
// which holds them in this order.
type batchLen struct {
	Tables  int `json:"tables"`
	Replace int `json:"replace,omitempty"`
	Routes  int `json:"routes,omitempty"`
}

// tailMark ends the JSON object of a message that carries a tail. JSON
// text never holds a raw NUL, so the first one is where the tail begins.
const tailMark = 0

// Encode writes m, refusing what the peer would refuse. A batch goes after
// the object, a NUL between them: 10 KiB of rules would take 14 as base64
// text, and the plugin, a fresh process, would pay the page faults of
// decoding it.
func Encode(m *Message) ([]byte, error) {
	return AppendMessage(make([]byte, 0, 512), m)
}

// AppendMessage appends m, encoded, to b.
func AppendMessage(b []byte, m *Message) ([]byte, error) {
	start := len(b)
	b = append(b, `{"kind":`...)
	b = gjson.AppendJSONString(b, string(m.Kind))
	if m.Pod != nil {
		b = appendPod(append(b, `,"pod":`...), m.Pod)
	}
	if d := m.Decision; d != nil {
		b = append(b, `,"decision":{"mode":`...)
		b = gjson.AppendJSONString(b, string(d.Mode))
		b = appendStr(b, "reason", d.Reason)
		if d.Programmed {
			b = append(b, `,"programmed":true`...)
		}
		if d.ConfirmsUndo {
			b = append(b, `,"confirms_undo":true`...)
		}
		b = append(b, '}')
	}
	b = appendStr(b, "error", m.Error)
	if m.Retry {
		b = append(b, `,"retry":true`...)
	}
	if len(m.Valid) > 0 {
		b = appendValid(append(b, `,"valid":`...), m.Valid)
	}
	if len(m.Logs) > 0 {
		b = append(b, `,"logs":[`...)
		for i, l := range m.Logs {
			if !gjson.ValidBytes(l) {
				return nil, fmt.Errorf("%s message: log record %d is not JSON", m.Kind, i)
			}
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, bytes.TrimSpace(l)...)
		}
		b = append(b, ']')
	}
	if t := m.Timings; t != nil {
		b = append(b, `,"timings":{"decided_ms":`...)
		b = strconv.AppendFloat(b, t.Decided, 'f', -1, 64)
		b = append(b, `,"programmed_ms":`...)
		b = append(strconv.AppendFloat(b, t.Programmed, 'f', -1, 64), '}')
	}
	if m.Inspect != nil {
		b = appendInspect(append(b, `,"inspect":`...), m.Inspect)
	}
	if m.Deadline != 0 {
		b = strconv.AppendInt(append(b, `,"deadline":`...), m.Deadline, 10)
	}
	if m.Batch != nil {
		b = append(b, `,"batch":{"tables":`...)
		b = strconv.AppendInt(b, int64(len(m.Batch.Tables)), 10)
		if len(m.Batch.Replace) > 0 {
			b = strconv.AppendInt(append(b, `,"replace":`...), int64(len(m.Batch.Replace)), 10)
		}
		if len(m.Batch.Routes) > 0 {
			b = strconv.AppendInt(append(b, `,"routes":`...), int64(len(m.Batch.Routes)), 10)
		}
		b = append(b, '}', '}', tailMark)
		b = append(append(append(b, m.Batch.Tables...), m.Batch.Replace...), m.Batch.Routes...)
	} else {
		b = append(b, '}')
	}
	if n := len(b) - start; n > MaxMessage {
		return nil, fmt.Errorf("%s message of %d bytes exceeds the %d-byte limit", m.Kind, n, MaxMessage)
	}
	return b, nil
}

func appendValid(b []byte, valid []Attachment) []byte {
	b = append(b, '[')
	for i, a := range valid {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"containerID":`...)
		b = gjson.AppendJSONString(b, a.ContainerID)
		b = append(b, `,"ifname":`...)
		b = append(gjson.AppendJSONString(b, a.IfName), '}')
	}
	return append(b, ']')
}

func appendInspect(b []byte, in *Inspect) []byte {
	b = append(b, `{"zds":`...)
	b = gjson.AppendJSONString(b, in.ZDS)
	if !in.Verified.IsZero() {
		b = appendStr(b, "verified", in.Verified.Format(time.RFC3339Nano))
	}
	b = appendStr(b, "drift", in.Drift)
	if in.Repairs != 0 {
		b = strconv.AppendInt(append(b, `,"repairs":`...), int64(in.Repairs), 10)
	}
	if in.Pod != nil {
		b = appendPod(append(b, `,"pod":`...), in.Pod)
	}
	return append(appendStr(b, "enrolment", in.Enrolment), '}')
}

func appendPod(b []byte, p *Pod) []byte {
	b = append(b, `{"namespace":`...)
	b = gjson.AppendJSONString(b, p.Namespace)
	b = append(b, `,"name":`...)
	b = gjson.AppendJSONString(b, p.Name)
	b = appendStr(b, "uid", p.UID)
	b = append(b, `,"containerID":`...)
	b = gjson.AppendJSONString(b, p.ContainerID)
	b = append(b, `,"ifname":`...)
	b = gjson.AppendJSONString(b, p.IfName)
	if len(p.IPs) > 0 {
		b = append(b, `,"ips":[`...)
		for i, ip := range p.IPs {
			if i > 0 {
				b = append(b, ',')
			}
			b = gjson.AppendJSONString(b, ip)
		}
		b = append(b, ']')
	}
	return append(appendStr(b, "netns", p.Netns), '}')
}

// appendStr appends `,"key":"v"` unless v is empty (omitempty).
func appendStr(b []byte, key, v string) []byte {
	if v == "" {
		return b
	}
	b = append(append(append(b, `,"`...), key...), `":`...)
	return gjson.AppendJSONString(b, v)
}

// Decode parses one message and checks that the fields its kind needs are
// there, so handlers never see a half-formed message. Unknown fields are
// ignored and null is an absent field, as encoding/json does; a field of
// the wrong type is refused.
func Decode(b []byte) (*Message, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("message of %d bytes exceeds the %d-byte limit", len(b), MaxMessage)
	}
	obj, tail, hasTail := bytes.Cut(b, []byte{tailMark})
	if len(bytes.TrimSpace(obj)) == 0 {
		return nil, errors.New("decoding message: no JSON object")
	}
	if !gjson.ValidBytes(obj) {
		return nil, errors.New("decoding message: not valid JSON, or trailing data after the object")
	}
	root := gjson.ParseBytes(obj)
	if !root.IsObject() {
		return nil, errors.New("decoding message: not a JSON object")
	}
	m := &Message{}
	var lens *batchLen
	var err error
	root.ForEach(func(k, v gjson.Result) bool {
		if v.Type == gjson.Null {
			return true
		}
		err = decodeField(m, &lens, k.Str, v)
		return err == nil
	})
	if err != nil {
		return nil, fmt.Errorf("decoding message: %w", err)
	}
	if m.Batch, err = splitTail(lens, tail, hasTail); err != nil {
		return nil, err
	}
	return m, m.check()
}

// decodeField reads one top-level field into m.
func decodeField(m *Message, lens **batchLen, key string, v gjson.Result) (err error) {
	switch key {
	case "kind":
		var s string
		s, err = str(v, key, "")
		m.Kind = Kind(s)
	case "pod":
		m.Pod, err = decodePod(v, key)
	case "decision":
		m.Decision, err = decodeVerdict(v)
	case "error":
		m.Error, err = str(v, key, "")
	case "retry":
		m.Retry, err = boolean(v, key, "")
	case "valid":
		m.Valid, err = decodeValid(v)
	case "logs":
		if !v.IsArray() {
			return errors.New("logs: want a list")
		}
		for _, l := range v.Array() {
			m.Logs = append(m.Logs, json.RawMessage(l.Raw))
		}
	case "timings":
		t := &Timings{}
		m.Timings = t
		err = fields(v, key, func(k string, v gjson.Result) (err error) {
			switch k {
			case "decided_ms":
				t.Decided, err = num(v, key, k)
			case "programmed_ms":
				t.Programmed, err = num(v, key, k)
			}
			return err
		})
	case "inspect":
		m.Inspect, err = decodeInspect(v)
	case "deadline":
		m.Deadline, err = integer(v, key, "")
	case "batch":
		l := &batchLen{}
		*lens = l
		err = fields(v, key, func(k string, v gjson.Result) error {
			switch k {
			case "tables":
				return length(&l.Tables, v, k)
			case "replace":
				return length(&l.Replace, v, k)
			case "routes":
				return length(&l.Routes, v, k)
			}
			return nil
		})
	}
	return err
}

// check holds a decoded message to what its kind needs.
func (m *Message) check() error {
	switch m.Kind {
	case KindAdd, KindDel, KindCheck:
		if m.Pod == nil {
			return fmt.Errorf("%s message without a pod", m.Kind)
		}
		if m.Pod.Namespace == "" || m.Pod.Name == "" || m.Pod.ContainerID == "" {
			return fmt.Errorf("%s message: pod needs namespace, name and containerID", m.Kind)
		}
	case KindDecision:
		return m.checkDecision()
	case KindInspect:
		if m.Pod == nil || (m.Pod.UID == "" && (m.Pod.Namespace == "" || m.Pod.Name == "")) {
			return errors.New("inspect message: needs a pod UID, or its namespace and name")
		}
	case KindOutcome, KindDone, KindStatus, KindGC, KindLog, KindError:
	default:
		return fmt.Errorf("unknown message kind %q", m.Kind)
	}
	return nil
}

func (m *Message) checkDecision() error {
	d := m.Decision
	if d == nil {
		return errors.New("decision message without a decision")
	}
	switch d.Mode {
	case ModeNone:
		return nil
	case ModeAmbient, ModeSidecar:
	default:
		return fmt.Errorf("decision message: unknown mode %q", d.Mode)
	}
	switch {
	case d.Programmed && m.Batch != nil:
		return errors.New("decision message: a batch for a ruleset the agent programmed")
	case !d.Programmed && (m.Batch == nil || len(m.Batch.Tables) == 0):
		return fmt.Errorf("decision message: %s without a batch to program", d.Mode)
	}
	return nil
}

func decodePod(v gjson.Result, at string) (*Pod, error) {
	p := &Pod{}
	err := fields(v, at, func(k string, v gjson.Result) (err error) {
		switch k {
		case "namespace":
			p.Namespace, err = str(v, at, k)
		case "name":
			p.Name, err = str(v, at, k)
		case "uid":
			p.UID, err = str(v, at, k)
		case "containerID":
			p.ContainerID, err = str(v, at, k)
		case "ifname":
			p.IfName, err = str(v, at, k)
		case "netns":
			p.Netns, err = str(v, at, k)
		case "ips":
			if !v.IsArray() {
				return fmt.Errorf("%s.ips: want a list", at)
			}
			for _, ip := range v.Array() {
				s, err := str(ip, at, k)
				if err != nil {
					return err
				}
				p.IPs = append(p.IPs, s)
			}
		}
		return err
	})
	return p, err
}

func decodeVerdict(v gjson.Result) (*Verdict, error) {
	d := &Verdict{}
	err := fields(v, "decision", func(k string, v gjson.Result) (err error) {
		switch k {
		case "mode":
			var mode string
			mode, err = str(v, "decision", k)
			d.Mode = Mode(mode)
		case "reason":
			d.Reason, err = str(v, "decision", k)
		case "programmed":
			d.Programmed, err = boolean(v, "decision", k)
		case "confirms_undo":
			d.ConfirmsUndo, err = boolean(v, "decision", k)
		}
		return err
	})
	return d, err
}

func decodeValid(v gjson.Result) ([]Attachment, error) {
	if !v.IsArray() {
		return nil, errors.New("valid: want a list")
	}
	var out []Attachment
	for _, e := range v.Array() {
		var a Attachment
		if err := fields(e, "valid", func(k string, v gjson.Result) (err error) {
			switch k {
			case "containerID":
				a.ContainerID, err = str(v, "valid", k)
			case "ifname":
				a.IfName, err = str(v, "valid", k)
			}
			return err
		}); err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

func decodeInspect(v gjson.Result) (*Inspect, error) {
	in := &Inspect{}
	err := fields(v, "inspect", func(k string, v gjson.Result) (err error) {
		switch k {
		case "zds":
			in.ZDS, err = str(v, "inspect", k)
		case "drift":
			in.Drift, err = str(v, "inspect", k)
		case "enrolment":
			in.Enrolment, err = str(v, "inspect", k)
		case "repairs":
			var n int64
			n, err = integer(v, "inspect", k)
			in.Repairs = int(n)
		case "verified":
			var t string
			if t, err = str(v, "inspect", k); err == nil {
				in.Verified, err = time.Parse(time.RFC3339Nano, t)
			}
		case "pod":
			in.Pod, err = decodePod(v, "inspect.pod")
		}
		return err
	})
	return in, err
}

// fields reads an object's fields with read (key, value); null ones are
// skipped, as encoding/json leaves them.
func fields(v gjson.Result, at string, read func(key string, v gjson.Result) error) error {
	if !v.IsObject() {
		return fmt.Errorf("%s: want an object", at)
	}
	var err error
	v.ForEach(func(k, v gjson.Result) bool {
		if v.Type != gjson.Null {
			err = read(k.Str, v)
		}
		return err == nil
	})
	return err
}

// field names a field in an error: at.key, or at alone.
func field(at, key string) string {
	if key == "" {
		return at
	}
	return at + "." + key
}

func str(v gjson.Result, at, key string) (string, error) {
	if v.Type != gjson.String {
		return "", fmt.Errorf("%s: want a string", field(at, key))
	}
	if !utf8.ValidString(v.Str) {
		return validUTF8(v.Str), nil
	}
	return v.Str, nil
}

// validUTF8 replaces each byte of an invalid sequence with U+FFFD, as
// encoding/json reads it.
func validUTF8(s string) string {
	var b strings.Builder
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		b.WriteRune(r) // utf8.RuneError for an invalid byte, n == 1
		s = s[n:]
	}
	return b.String()
}

func boolean(v gjson.Result, at, key string) (bool, error) {
	if v.Type != gjson.True && v.Type != gjson.False {
		return false, fmt.Errorf("%s: want true or false", field(at, key))
	}
	return v.Bool(), nil
}

func num(v gjson.Result, at, key string) (float64, error) {
	if v.Type != gjson.Number {
		return 0, fmt.Errorf("%s: want a number", field(at, key))
	}
	return v.Num, nil
}

// integer reads a whole number exactly (a deadline in nanoseconds does not
// fit a float64's mantissa).
func integer(v gjson.Result, at, key string) (int64, error) {
	if v.Type != gjson.Number {
		return 0, fmt.Errorf("%s: want a number", field(at, key))
	}
	n, err := strconv.ParseInt(v.Raw, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: want a whole number: %w", field(at, key), err)
	}
	return n, nil
}

// length reads a batch part's length; splitTail holds it to the tail.
func length(dst *int, v gjson.Result, key string) error {
	n, err := integer(v, "batch", key)
	if err != nil {
		return fmt.Errorf("batch.%s is not a length", key)
	}
	*dst = int(n)
	return nil
}

// splitTail cuts a message's tail into the batch its lengths name: the
// parts must fill it exactly.
func splitTail(l *batchLen, tail []byte, hasTail bool) (*nlsend.Batch, error) {
	switch {
	case l == nil && !hasTail:
		return nil, nil
	case l == nil:
		return nil, errors.New("decoding message: data after the object names no batch")
	case !hasTail:
		return nil, errors.New("decoding message: the batch it names is missing")
	case !within(l.Tables, len(tail)) || !within(l.Replace, len(tail)) || !within(l.Routes, len(tail)) || l.Tables+l.Replace+l.Routes != len(tail):
		return nil, fmt.Errorf("decoding message: batch lengths %d+%d+%d do not fill its %d bytes", l.Tables, l.Replace, l.Routes, len(tail))
	}
	b := &nlsend.Batch{Tables: tail[:l.Tables:l.Tables]}
	if rest := tail[l.Tables:]; l.Replace > 0 {
		b.Replace = rest[:l.Replace:l.Replace]
	}
	if l.Routes > 0 {
		b.Routes = tail[len(tail)-l.Routes:]
	}
	return b, nil
}

func within(n, max int) bool { return n >= 0 && n <= max }
