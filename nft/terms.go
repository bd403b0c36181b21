package nft

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// A Term is one match or statement of a rule. It knows both its nft syntax,
// exactly as `nft list` prints it, and the netlink expressions that make it,
// exactly as `nft -f` would encode it (dependencies such as `meta nfproto`
// before an `ip daddr` are explicit here; nft hides them when printing).
type Term interface {
	Text() string
	Exprs() []expr.Any
}

// Op is a comparison.
type Op int

const (
	Eq Op = iota
	Neq
	Gte
)

func (o Op) text() string {
	switch o {
	case Neq:
		return "!= "
	case Gte:
		return ">= "
	}
	return ""
}

func (o Op) cmp() expr.CmpOp {
	switch o {
	case Neq:
		return expr.CmpOpNeq
	case Gte:
		return expr.CmpOpGte
	}
	return expr.CmpOpEq
}

type term struct {
	text  string
	exprs []expr.Any
}

func (t term) Text() string      { return t.text }
func (t term) Exprs() []expr.Any { return t.exprs }

func load(key expr.MetaKey) *expr.Meta { return &expr.Meta{Key: key, Register: 1} }

func cmp(op Op, data []byte) *expr.Cmp { return &expr.Cmp{Op: op.cmp(), Register: 1, Data: data} }

// Proto names an L4 protocol.
type Proto uint8

const (
	TCP Proto = unix.IPPROTO_TCP
	UDP Proto = unix.IPPROTO_UDP
)

func (p Proto) String() string {
	if p == UDP {
		return "udp"
	}
	return "tcp"
}

// L4 matches `meta l4proto tcp`.
func L4(p Proto) Term {
	return term{"meta l4proto " + p.String(), []expr.Any{load(expr.MetaKeyL4PROTO), cmp(Eq, []byte{byte(p)})}}
}

func l4dep(p Proto) []expr.Any {
	return []expr.Any{load(expr.MetaKeyL4PROTO), cmp(Eq, []byte{byte(p)})}
}

// DPort matches `tcp dport != 15008`; SPort `udp sport 53`.
func DPort(p Proto, op Op, port uint16) Term { return portTerm(p, "dport", 2, op, port) }
func SPort(p Proto, op Op, port uint16) Term { return portTerm(p, "sport", 0, op, port) }

func portTerm(p Proto, name string, off uint32, op Op, port uint16) Term {
	ex := append(l4dep(p),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
		cmp(op, binaryutil.BigEndian.PutUint16(port)))
	return term{fmt.Sprintf("%s %s %s%d", p, name, op.text(), port), ex}
}

// Addr matches `ip daddr != 127.0.0.1` or `ip6 saddr fd00::/8`; the family
// comes from the prefix. A full-length prefix prints as a bare address.
func Addr(src bool, op Op, pfx netip.Prefix) Term {
	fam, off, dir := addrLoad(src, pfx.Addr().Is4())
	ex := fam
	ex = append(ex, off)
	bits := pfx.Addr().BitLen()
	text := pfx.Addr().String()
	if pfx.Bits() < bits {
		mask := netip.PrefixFrom(pfx.Addr(), pfx.Bits()).Masked().Addr().AsSlice()
		m := make([]byte, len(mask))
		for i := 0; i < pfx.Bits(); i++ {
			m[i/8] |= 0x80 >> (i % 8)
		}
		ex = append(ex, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: uint32(len(m)), Mask: m, Xor: make([]byte, len(m))})
		ex = append(ex, cmp(op, mask))
		text = pfx.Masked().String()
	} else {
		ex = append(ex, cmp(op, pfx.Addr().AsSlice()))
	}
	return term{fmt.Sprintf("%s %s%s", dir, op.text(), text), ex}
}

// DPortInSet matches `tcp dport @name` against a named port set of this
// table.
func DPortInSet(p Proto, set string) Term {
	ex := append(l4dep(p),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: 1, SetName: set})
	return term{fmt.Sprintf("%s dport @%s", p, set), ex}
}

// AddrInSet matches `ip daddr @name` against a named set of this table.
func AddrInSet(src, v4 bool, set string) Term {
	fam, off, dir := addrLoad(src, v4)
	ex := append(fam, off, &expr.Lookup{SourceRegister: 1, SetName: set})
	return term{fmt.Sprintf("%s @%s", dir, set), ex}
}

func addrLoad(src, v4 bool) ([]expr.Any, *expr.Payload, string) {
	nfproto, off, l, name := byte(unix.NFPROTO_IPV4), uint32(16), uint32(4), "ip"
	if !v4 {
		nfproto, off, l, name = unix.NFPROTO_IPV6, 24, 16, "ip6"
	}
	dir := "daddr"
	if src {
		dir = "saddr"
		off -= l
	}
	dep := []expr.Any{load(expr.MetaKeyNFPROTO), cmp(Eq, []byte{nfproto})}
	return dep, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: l}, name + " " + dir
}

// Mark matches `meta mark & 0x00000fff != 0x00000539` (mask 0: no mask).
func Mark(op Op, mask, value uint32) Term {
	return markTerm("meta mark", load(expr.MetaKeyMARK), op, mask, value)
}

// CtMark matches `ct mark & 0x00000fff == 0x00000111`.
func CtMark(op Op, mask, value uint32) Term {
	return markTerm("ct mark", &expr.Ct{Key: expr.CtKeyMARK, Register: 1}, op, mask, value)
}

func markTerm(name string, ld expr.Any, op Op, mask, value uint32) Term {
	ex := []expr.Any{ld}
	text := name
	if mask != 0 {
		ex = append(ex, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: make([]byte, 4)})
		text += fmt.Sprintf(" & 0x%08x", mask)
		if op == Eq {
			text += " =="
		}
	}
	ex = append(ex, cmp(op, binaryutil.NativeEndian.PutUint32(value)))
	return term{fmt.Sprintf("%s %s0x%08x", text, op.text(), value), ex}
}

// IfName matches `iifname "eth1"` (in) or `oifname != "lo"` (out).
func IfName(in bool, op Op, name string) Term {
	key, kw := expr.MetaKeyOIFNAME, "oifname"
	if in {
		key, kw = expr.MetaKeyIIFNAME, "iifname"
	}
	data := make([]byte, unix.IFNAMSIZ)
	copy(data, name+"\x00")
	return term{fmt.Sprintf("%s %s%q", kw, op.text(), name), []expr.Any{load(key), cmp(op, data)}}
}

// SkUID matches `meta skuid 1337`; SkGID `meta skgid 1337`.
func SkUID(op Op, id uint32) Term { return skTerm("meta skuid", expr.MetaKeySKUID, op, id) }
func SkGID(op Op, id uint32) Term { return skTerm("meta skgid", expr.MetaKeySKGID, op, id) }

func skTerm(name string, key expr.MetaKey, op Op, id uint32) Term {
	return term{fmt.Sprintf("%s %s%d", name, op.text(), id), []expr.Any{load(key), cmp(op, binaryutil.NativeEndian.PutUint32(id))}}
}

// LocalSocket matches packets that belong to a local socket: `meta skuid >= 0`
// loads the socket's owner and so only matches when there is one, like
// iptables' `-m owner --socket-exists`. Forwarded packets never match.
func LocalSocket() Term { return SkUID(Gte, 0) }

// CtState matches `ct state invalid` or `ct state established,related`.
func CtState(states ...string) Term {
	bits := map[string]uint32{"invalid": 1, "established": 2, "related": 4, "new": 8}
	var mask uint32
	for _, s := range states {
		mask |= bits[s]
	}
	return term{"ct state " + strings.Join(states, ","), []expr.Any{
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: make([]byte, 4)},
		cmp(Neq, make([]byte, 4)),
	}}
}

// Statements.

// Counter counts packets and bytes; it prints as plain `counter` here (a
// listing's values are normalised away when compared).
func Counter() Term { return term{"counter", []expr.Any{&expr.Counter{}}} }

func verdict(kind expr.VerdictKind, text string) Term {
	return term{text, []expr.Any{&expr.Verdict{Kind: kind}}}
}

func Accept() Term { return verdict(expr.VerdictAccept, "accept") }
func Return() Term { return verdict(expr.VerdictReturn, "return") }
func Drop() Term   { return verdict(expr.VerdictDrop, "drop") }

// Jump jumps to a regular chain of the same table.
func Jump(chain string) Term {
	return term{"jump " + chain, []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: chain}}}
}

// Redirect is `redirect to :15001`.
func Redirect(port uint16) Term {
	return term{fmt.Sprintf("redirect to :%d", port), []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
	}}
}

// TProxy is `tproxy ip to :15006` (v4) or `tproxy ip6 to :15006`.
func TProxy(v4 bool, port uint16) Term {
	fam, name := byte(unix.NFPROTO_IPV4), "ip"
	if !v4 {
		fam, name = unix.NFPROTO_IPV6, "ip6"
	}
	return term{fmt.Sprintf("tproxy %s to :%d", name, port), []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.TProxy{Family: fam, TableFamily: unix.NFPROTO_INET, RegPort: 1},
	}}
}

// SetMark is `meta mark set 0x00000539`.
func SetMark(v uint32) Term {
	return term{fmt.Sprintf("meta mark set 0x%08x", v), []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(v)},
		&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
	}}
}

// SetMarkFromCt is `meta mark set ct mark`.
func SetMarkFromCt() Term {
	return term{"meta mark set ct mark", []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
	}}
}

// SetCtMarkFromMark is `ct mark set meta mark`.
func SetCtMarkFromMark() Term {
	return term{"ct mark set meta mark", []expr.Any{
		load(expr.MetaKeyMARK),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	}}
}

// SetCtMarkBits is `ct mark set (ct mark & keep) | bits`: it sets bits
// without touching the connection mark outside keep's complement.
func SetCtMarkBits(keep, bits uint32) Term {
	return term{fmt.Sprintf("ct mark set ct mark & 0x%08x | 0x%08x", keep|bits, bits), []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(keep), Xor: binaryutil.NativeEndian.PutUint32(bits)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	}}
}

// SetCtZone is `ct zone set 1`.
func SetCtZone(zone uint16) Term {
	return term{fmt.Sprintf("ct zone set %d", zone), []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(zone)},
		&expr.Ct{Key: expr.CtKeyZONE, Register: 1, SourceRegister: true},
	}}
}

// SNAT is `snat ip to 169.254.7.127` (or ip6).
func SNAT(to netip.Addr) Term {
	fam, name := uint32(unix.NFPROTO_IPV4), "ip"
	if to.Is6() {
		fam, name = unix.NFPROTO_IPV6, "ip6"
	}
	return term{fmt.Sprintf("snat %s to %s", name, to), []expr.Any{
		&expr.Immediate{Register: 1, Data: to.AsSlice()},
		&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1},
	}}
}
