package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// The plugin's ADD path writes and reads its messages with gjson instead
// of encoding/json: the plugin is exec'd for every pod sandbox, and the
// first use of encoding/json's reflection costs a fresh process about 25
// page faults (0.2 ms here). The bytes are the same JSON the agent decodes
// with Decode; tests check the two codecs agree message for message.

// AppendAdd appends the add message for p, with the plugin's deadline.
func AppendAdd(b []byte, p *Pod, deadline int64) []byte {
	b = append(b, `{"kind":"add","pod":{"namespace":`...)
	b = gjson.AppendJSONString(b, p.Namespace)
	b = append(b, `,"name":`...)
	b = gjson.AppendJSONString(b, p.Name)
	if p.UID != "" {
		b = append(b, `,"uid":`...)
		b = gjson.AppendJSONString(b, p.UID)
	}
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
	if p.Netns != "" {
		b = append(b, `,"netns":`...)
		b = gjson.AppendJSONString(b, p.Netns)
	}
	b = append(b, '}')
	if deadline != 0 {
		b = append(b, `,"deadline":`...)
		b = strconv.AppendInt(b, deadline, 10)
	}
	return append(b, '}')
}

// AppendOutcome appends an outcome message: errText "" when the batch is
// in place; logs are JSON records, as the plugin's slog handler writes
// them.
func AppendOutcome(b []byte, errText string, logs []json.RawMessage, t *Timings) []byte {
	b = append(b, `{"kind":"outcome"`...)
	if errText != "" {
		b = append(b, `,"error":`...)
		b = gjson.AppendJSONString(b, errText)
	}
	if len(logs) > 0 {
		b = append(b, `,"logs":[`...)
		for i, l := range logs {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, l...)
		}
		b = append(b, ']')
	}
	if t != nil {
		b = append(b, `,"timings":{"decided_ms":`...)
		b = strconv.AppendFloat(b, t.Decided, 'f', -1, 64)
		b = append(b, `,"programmed_ms":`...)
		b = strconv.AppendFloat(b, t.Programmed, 'f', -1, 64)
		b = append(b, '}')
	}
	return append(b, '}')
}

// Reply is an agent's answer as the plugin's ADD reads it.
type Reply struct {
	Kind  Kind
	Error string
	// Mode and Reason: decision.
	Mode   Mode
	Reason string
	// Batch: decision, for an enrolled pod, unless Programmed (the agent
	// wrote the ruleset itself: too large for a message).
	Batch      *nlsend.Batch
	Programmed bool
}

// ParseReply reads a decision, done or error message, refusing what Decode
// would refuse.
func ParseReply(b []byte) (*Reply, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("message of %d bytes exceeds the %d-byte limit", len(b), MaxMessage)
	}
	obj, tail, hasTail := bytes.Cut(b, []byte{tailMark})
	if !gjson.ValidBytes(obj) {
		return nil, errors.New("decoding message: not valid JSON")
	}
	m := gjson.ParseBytes(obj)
	if !m.IsObject() {
		return nil, errors.New("decoding message: not a JSON object")
	}
	r := &Reply{Kind: Kind(m.Get("kind").String()), Error: m.Get("error").String()}
	var lens *batchLen
	if bt := m.Get("batch"); bt.Exists() && bt.Type != gjson.Null {
		if !bt.IsObject() {
			return nil, errors.New("decoding message: batch is not an object")
		}
		lens = &batchLen{}
		for _, f := range [...]struct {
			key string
			n   *int
		}{{"tables", &lens.Tables}, {"replace", &lens.Replace}, {"routes", &lens.Routes}} {
			if v := bt.Get(f.key); v.Exists() {
				if v.Type != gjson.Number || v.Num != float64(int(v.Num)) {
					return nil, fmt.Errorf("decoding message: batch.%s is not a length", f.key)
				}
				*f.n = int(v.Num)
			}
		}
	}
	batch, err := splitTail(lens, tail, hasTail)
	if err != nil {
		return nil, err
	}
	switch r.Kind {
	case KindDone, KindError:
		return r, nil
	case KindDecision:
	default:
		return nil, fmt.Errorf("unexpected message kind %q", r.Kind)
	}
	d := m.Get("decision")
	if !d.IsObject() {
		return nil, errors.New("decision message without a decision")
	}
	r.Mode, r.Reason = Mode(d.Get("mode").String()), d.Get("reason").String()
	switch r.Mode {
	case ModeNone:
		return r, nil
	case ModeAmbient, ModeSidecar:
	default:
		return nil, fmt.Errorf("decision message: unknown mode %q", r.Mode)
	}
	r.Batch, r.Programmed = batch, d.Get("programmed").Bool()
	if r.Programmed {
		if batch != nil {
			return nil, errors.New("decision message: a batch for a ruleset the agent programmed")
		}
		return r, nil
	}
	if r.Batch == nil || len(r.Batch.Tables) == 0 {
		return nil, fmt.Errorf("decision message: %s without a batch to program", r.Mode)
	}
	return r, nil
}
