package nft

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
)

// PrefixSet is a named interval set of prefixes of one family: each
// prefix masked, duplicates and prefixes inside another dropped (the
// kernel refuses overlapping intervals), sorted as nft lists them.
func PrefixSet(name string, v6 bool, pfxs []netip.Prefix) *Set {
	var ps []netip.Prefix
	for _, p := range pfxs {
		if p.Addr().Is4() == !v6 {
			ps = append(ps, p.Masked())
		}
	}
	// Shortest first among equal starts, so a prefix that contains later
	// ones comes before them.
	slices.SortFunc(ps, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	s := &Set{Name: name, V6: v6, Interval: true}
	for _, p := range ps {
		if n := len(s.Elements); n > 0 && s.Elements[n-1].Prefix.Overlaps(p) {
			continue // sorted: an overlap is containment by the kept one
		}
		s.Elements = append(s.Elements, Element{Prefix: p})
	}
	return s
}

// PortSet is a named set of transport ports, deduplicated and sorted.
func PortSet(name string, ports []uint16) *Set {
	ps := slices.Clone(ports)
	slices.Sort(ps)
	s := &Set{Name: name, Ports: true}
	for _, p := range slices.Compact(ps) {
		s.Elements = append(s.Elements, Element{Port: p})
	}
	return s
}

func (s *Set) keyType() nftables.SetDatatype {
	switch {
	case s.Ports:
		return nftables.TypeInetService
	case s.V6:
		return nftables.TypeIP6Addr
	}
	return nftables.TypeIPAddr
}

func (s *Set) typeName() string {
	switch {
	case s.Ports:
		return "inet_service"
	case s.V6:
		return "ipv6_addr"
	}
	return "ipv4_addr"
}

// perLine is how many elements nft lists on a line for the set's type.
func (s *Set) perLine() int {
	switch {
	case s.Ports:
		return 5
	case s.V6:
		return 1
	}
	return 2
}

// text is the element as nft lists it.
func (e Element) text() string {
	switch {
	case e.Prefix.IsValid() && e.Prefix.IsSingleIP():
		return e.Prefix.Addr().String()
	case e.Prefix.IsValid():
		return e.Prefix.String()
	case e.last.IsValid():
		return e.Addr.String() + "-" + e.last.String()
	case e.Addr.IsValid():
		return e.Addr.String()
	}
	return fmt.Sprint(e.Port)
}

// kernelElements are s's elements as the kernel stores them: an interval
// set's prefix is its first address and an interval-end element at the
// address after its last (none when it ends at the family's last address).
func kernelElements(s *Set) []nftables.SetElement {
	var out []nftables.SetElement
	for _, e := range s.Elements {
		switch {
		case s.Ports:
			out = append(out, nftables.SetElement{Key: binary.BigEndian.AppendUint16(nil, e.Port), Comment: e.Comment})
		case s.Interval:
			out = append(out, nftables.SetElement{Key: e.Prefix.Addr().AsSlice(), Comment: e.Comment})
			if next := lastAddr(e.Prefix).Next(); next.IsValid() {
				out = append(out, nftables.SetElement{Key: next.AsSlice(), IntervalEnd: true})
			}
		default:
			out = append(out, nftables.SetElement{Key: e.Addr.AsSlice(), Comment: e.Comment})
		}
	}
	return out
}

// elementKeys are kernel elements as comparable text, sorted.
func elementKeys(els []nftables.SetElement) []string {
	out := make([]string, len(els))
	for i, e := range els {
		out[i] = fmt.Sprintf("%s end=%v %q", hex.EncodeToString(e.Key), e.IntervalEnd, e.Comment)
	}
	slices.Sort(out)
	return out
}

// lastAddr is the last address of a masked prefix.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// setFromKernel is the model of a set as the kernel returns it, for Live:
// an interval set's start and end elements paired back into prefixes (a
// range that is no prefix, written by someone else, keeps its bounds).
func setFromKernel(s *nftables.Set, els []nftables.SetElement) *Set {
	ms := &Set{Name: s.Name, V6: s.KeyType == nftables.TypeIP6Addr, Ports: s.KeyType == nftables.TypeInetService,
		Interval: s.Interval, Comment: s.Comment}
	els = slices.Clone(els)
	// By key; at an equal key (adjacent intervals) the end of one before
	// the start of the next.
	slices.SortFunc(els, func(a, b nftables.SetElement) int {
		if c := slices.Compare(a.Key, b.Key); c != 0 || a.IntervalEnd == b.IntervalEnd {
			return c
		}
		if a.IntervalEnd {
			return -1
		}
		return 1
	})
	for i, e := range els {
		switch {
		case ms.Ports:
			if len(e.Key) >= 2 {
				ms.Elements = append(ms.Elements, Element{Port: binary.BigEndian.Uint16(e.Key), Comment: e.Comment})
			}
		case ms.Interval:
			if e.IntervalEnd {
				continue
			}
			start, _ := netip.AddrFromSlice(e.Key)
			last := maxAddr(start)
			if i+1 < len(els) && els[i+1].IntervalEnd {
				end, _ := netip.AddrFromSlice(els[i+1].Key)
				last = end.Prev()
			}
			ms.Elements = append(ms.Elements, rangeElement(start, last, e.Comment))
		default:
			a, _ := netip.AddrFromSlice(e.Key)
			ms.Elements = append(ms.Elements, Element{Addr: a, Comment: e.Comment})
		}
	}
	return ms
}

// rangeElement is [first, last] as a prefix when it is one.
func rangeElement(first, last netip.Addr, comment string) Element {
	for bits := 0; bits <= first.BitLen(); bits++ {
		if p := netip.PrefixFrom(first, bits); p.Masked().Addr() == first && lastAddr(p) == last {
			return Element{Prefix: p, Comment: comment}
		}
	}
	return Element{Addr: first, last: last, Comment: comment}
}

func maxAddr(a netip.Addr) netip.Addr {
	if a.Is4() {
		return netip.AddrFrom4([4]byte{255, 255, 255, 255})
	}
	return netip.AddrFrom16([16]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
}

// elementDrift says how two sorted element key lists differ ("" when they
// do not), naming at most a few elements each way: a set may hold
// thousands.
func elementDrift(have, want []string) string {
	var missing, extra []string
	i, j := 0, 0
	for i < len(have) || j < len(want) {
		switch {
		case j == len(want) || i < len(have) && have[i] < want[j]:
			extra = append(extra, have[i])
			i++
		case i == len(have) || want[j] < have[i]:
			missing = append(missing, want[j])
			j++
		default:
			i, j = i+1, j+1
		}
	}
	if len(missing)+len(extra) == 0 {
		return ""
	}
	first := func(l []string) []string { return l[:min(len(l), 3)] }
	return fmt.Sprintf("%d missing %v, %d not ours %v (of %d wanted)", len(missing), first(missing), len(extra), first(extra), len(want))
}

// maxElementsBytes bounds the elements of one netlink message: they go in
// one nested attribute, whose length field is 16 bits (google/nftables
// v0.3.0 neither splits nor checks, and an overflowing length makes the
// kernel read a few hundred elements of thousands).
const maxElementsBytes = 32 << 10

// elementChunks splits els into lists that each fit one message; there is
// always at least one (maybe empty) list.
func elementChunks(els []nftables.SetElement) [][]nftables.SetElement {
	out := [][]nftables.SetElement{nil}
	size := 0
	for _, e := range els {
		n := 64 + len(e.Key) + len(e.Comment) // attribute headers, flags, key, comment
		if size+n > maxElementsBytes && len(out[len(out)-1]) > 0 {
			out = append(out, nil)
			size = 0
		}
		out[len(out)-1] = append(out[len(out)-1], e)
		size += n
	}
	return out
}
