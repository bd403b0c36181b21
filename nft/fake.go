package nft

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Fake does in memory what Program, Remove and Check do to a netns, so
// logic that programs pods can be tested without root. A netns is known by
// the file its descriptor refers to (device and inode, as a netns is), so
// a dup of a descriptor is the same netns, and any file can stand in for
// one. Dump prints what a netns holds as `nft list table`
// would (Render), and Tamper plays someone else changing it. Each change
// moves the netns's generation, as nf_tables' does, so a Check that is
// given the current generation skips its comparison just as Check skips
// listing.
type Fake struct {
	mu sync.Mutex
	ns map[[2]uint64]*fakeNetns
	// ProgramErr, RemoveErr and CheckErr, when set, are returned by every
	// call of that kind until cleared (a CheckErr is "could not look", not
	// drift).
	ProgramErr, RemoveErr, CheckErr error
}

type fakeNetns struct {
	rs  *Ruleset
	gen uint32
	// istio is what PlantIstio put there.
	istio *IstioState
}

// NewFake is a Fake whose every netns starts empty.
func NewFake() *Fake { return &Fake{ns: map[[2]uint64]*fakeNetns{}} }

func (f *Fake) netns(fd int) (*fakeNetns, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("nft.Fake: netns descriptor %d: %w", fd, err)
	}
	k := [2]uint64{st.Dev, st.Ino}
	n := f.ns[k]
	if n == nil {
		n = &fakeNetns{gen: 1}
		f.ns[k] = n
	}
	return n, nil
}

// Program puts b's ruleset in place of what the netns holds. Only batches
// made by Encode can be programmed: the Fake reads the ruleset, not bytes.
func (f *Fake) Program(fd int, b *Batch) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ProgramErr != nil {
		return f.ProgramErr
	}
	if b == nil || b.source == nil {
		return fmt.Errorf("nft.Fake: the batch was not made by Encode")
	}
	n, err := f.netns(fd)
	if err != nil {
		return err
	}
	n.rs, n.gen = b.source, n.gen+1
	return nil
}

// Remove takes the netns's ruleset away; one already gone is fine.
func (f *Fake) Remove(fd int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.RemoveErr != nil {
		return f.RemoveErr
	}
	n, err := f.netns(fd)
	if err != nil {
		return err
	}
	if n.rs != nil {
		n.rs, n.gen = nil, n.gen+1
	}
	return nil
}

// Check reports drift between the netns and rs the way Check does: a
// *DriftError naming the first line of the rendered ruleset that differs.
func (f *Fake) Check(fd int, rs *Ruleset, gen uint32) (uint32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.CheckErr != nil {
		return 0, f.CheckErr
	}
	n, err := f.netns(fd)
	if err != nil {
		return 0, err
	}
	if gen != 0 && gen == n.gen {
		return n.gen, nil
	}
	if n.rs == nil {
		return n.gen, &DriftError{Problems: []string{fmt.Sprintf("table inet %s is missing", rs.Tables[0].Name)}}
	}
	have, want := dumpRuleset(n.rs), dumpRuleset(rs)
	if have == want {
		return n.gen, nil
	}
	hl, wl := strings.Split(have, "\n"), strings.Split(want, "\n")
	for i := 0; ; i++ {
		h, w := line(hl, i), line(wl, i)
		if h != w {
			return n.gen, &DriftError{Problems: []string{fmt.Sprintf("line %d: have %q, want %q", i+1, h, w)}}
		}
	}
}

// Verify is Check listing everything.
func (f *Fake) Verify(fd int, rs *Ruleset) error {
	_, err := f.Check(fd, rs, 0)
	return err
}

// Live is what Render prints of the netns's table named table ("" when it
// holds none); rules print as they were programmed, want or not.
func (f *Fake) Live(fd int, table string, want *Ruleset) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.netns(fd)
	if err != nil || n.rs == nil {
		return "", err
	}
	for _, t := range n.rs.Tables {
		if t.Name == table {
			return Render(t), nil
		}
	}
	return "", nil
}

func line(ls []string, i int) string {
	if i < len(ls) {
		return ls[i]
	}
	return "<end>"
}

// Dump is what the netns behind fd holds: its tables as Render prints them,
// then one line per policy route; "" when it holds nothing of ours.
func (f *Fake) Dump(fd int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n, err := f.netns(fd); err == nil && n.rs != nil {
		return dumpRuleset(n.rs)
	}
	return ""
}

// PlantIstio puts istio-cni's state (as SurveyPod would find it) in the
// netns.
func (f *Fake) PlantIstio(fd int, s *IstioState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.netns(fd)
	if err != nil {
		panic(err)
	}
	n.istio, n.gen = s, n.gen+1
}

// Istio is what of istio-cni's state the netns still holds (nil: none).
func (f *Fake) Istio(fd int) *IstioState {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n, err := f.netns(fd); err == nil {
		return n.istio
	}
	return nil
}

// Survey is what SurveyPod would find: what PlantIstio put there.
func (f *Fake) Survey(fd int) (*IstioState, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.netns(fd)
	if err != nil {
		return nil, err
	}
	if n.istio == nil {
		return &IstioState{}, nil
	}
	return n.istio, nil
}

// TakeOver replaces the netns's istio-cni state with b's ruleset, as
// TakeOver does.
func (f *Fake) TakeOver(fd int, b *Batch) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.netns(fd)
	if err != nil || n.istio == nil || !n.istio.Found() {
		return nil, err
	}
	if len(n.istio.Unknown) > 0 || len(n.istio.Legacy) > 0 {
		return nil, &ForeignError{Unknown: n.istio.Unknown, Legacy: n.istio.Legacy}
	}
	if b == nil || b.source == nil {
		return nil, fmt.Errorf("nft.Fake: the batch was not made by Encode")
	}
	was := n.istio.What()
	n.istio, n.rs, n.gen = nil, b.source, n.gen+1
	return was, nil
}

// Tamper changes the netns's ruleset as someone else would: edit gets a
// copy of the tables to change (dropping a chain's rules, say); a nil edit
// deletes our tables and routes.
func (f *Fake) Tamper(fd int, edit func(*Ruleset)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.netns(fd)
	if err != nil {
		panic(err)
	}
	if edit == nil || n.rs == nil {
		n.rs = nil
	} else {
		n.rs = cloneRuleset(n.rs)
		edit(n.rs)
	}
	n.gen++
}

func dumpRuleset(rs *Ruleset) string {
	var b strings.Builder
	b.WriteString(Render(rs.Tables...))
	for _, r := range rs.Routes {
		fmt.Fprintf(&b, "route %s fwmark %#x/%#x lookup %d pref %d\n", fam(r), r.Mark, r.Mask, r.Table, r.Priority)
	}
	for _, a := range rs.LoopbackAddrs {
		fmt.Fprintf(&b, "address %s dev lo\n", a)
	}
	return b.String()
}

func cloneRuleset(rs *Ruleset) *Ruleset {
	out := &Ruleset{Routes: slices.Clone(rs.Routes), LoopbackAddrs: slices.Clone(rs.LoopbackAddrs)}
	for _, t := range rs.Tables {
		ct := *t
		ct.Chains, ct.Sets = nil, nil
		for _, s := range t.Sets {
			cs := *s
			cs.Elements = slices.Clone(s.Elements)
			ct.Sets = append(ct.Sets, &cs)
		}
		for _, c := range t.Chains {
			cc := *c
			cc.Rules = slices.Clone(c.Rules)
			ct.Chains = append(ct.Chains, &cc)
		}
		out.Tables = append(out.Tables, &ct)
	}
	return out
}
