package conformance

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Case is one configuration, as Istio and nftcni each express it.
type Case struct {
	Name  string
	Shape Shape
	// The proxy's UID and GID (sidecar), which the matrix probes as.
	ProxyUID, ProxyGID uint32
	// Istio puts Istio's rules into its twin.
	Istio func(t testing.TB, tw *Twin)
	// Nftcni puts nftcni's rules into its twin; nil when nftcni cannot
	// express the configuration (NotExpressible says why).
	Nftcni         func(t testing.TB, tw *Twin)
	NotExpressible string
	// Deliberate says why a probe's fates differ on purpose ("" when they
	// must not); docs/design.md says the same.
	Deliberate func(p Probe) string
	// Extra probes beyond the matrix; Only, when set, replaces it.
	Extra, Only []Probe
}

// BackendsDisagreeOnIPv6 is why a dual-stack pod's IPv6 probes differ
// against Istio's iptables backend when Istio makes no IPv6 rules for it
// (AMBIENT_IPV6=false; a sidecar whose proxy is not dual-stack): Istio's
// nftables backend puts its rules in inet tables, and those that name no
// family catch IPv6 too; its iptables backend leaves ip6tables empty.
// nftcni, an nftables implementation, does as Istio's nftables backend.
const BackendsDisagreeOnIPv6 = "Istio's backends disagree on this IPv6 packet when Istio makes no IPv6 rules: its nftables backend's rules that name no family catch it, its iptables backend leaves it alone; nftcni does as the nftables backend"

// Diff is one probe whose fates differ.
type Diff struct {
	Probe         string
	Istio, Nftcni string
}

// Result is a case's outcome.
type Result struct {
	Case   string
	Probes int
	Diffs  []Diff
	// Deliberate differences seen (probe -> why).
	Deliberate map[string]string
	// Fates of every probe in Istio's twin, by name (for the caller's own
	// checks, e.g. that Istio's rules captured anything at all).
	IstioFates, NftcniFates map[string]string
}

// Tally counts the suite's whole run; TestMain prints it.
type Tally struct {
	mu                                sync.Mutex
	Configs, Probes, Matched, Differs int
	OnPurpose                         int // probes that differ on purpose
	NotExpressible                    []string
	Deliberate                        []string
}

// Suite is the package's tally.
var Suite = &Tally{}

func (s *Tally) add(r *Result) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.Configs++
	s.Probes += r.Probes
	s.Differs += len(r.Diffs)
	s.Matched += r.Probes - len(r.Diffs) - len(r.Deliberate)
	s.OnPurpose += len(r.Deliberate)
	byWhy := map[string][]string{}
	for p, why := range r.Deliberate {
		byWhy[why] = append(byWhy[why], p)
	}
	for why, ps := range byWhy {
		sort.Strings(ps)
		if len(ps) > 3 {
			ps = append(ps[:3], "…")
		}
		s.Deliberate = append(s.Deliberate, fmt.Sprintf("%s: %d probes (%s): %s", r.Case, len(byWhy[why]), strings.Join(ps, ", "), why))
	}
}

func (s *Tally) notExpressible(name, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.NotExpressible = append(s.NotExpressible, fmt.Sprintf("%s (%s)", name, why))
}

// String is the suite's result line, then the named cases.
func (s *Tally) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "conformance: %d configurations compared, %d probes: %d matched, %d differed, %d differ on purpose; %d configurations not expressible\n",
		s.Configs, s.Probes, s.Matched, s.Differs, s.OnPurpose, len(s.NotExpressible))
	sort.Strings(s.NotExpressible)
	for _, n := range s.NotExpressible {
		fmt.Fprintf(&b, "  not expressible: %s\n", n)
	}
	sort.Strings(s.Deliberate)
	for _, d := range s.Deliberate {
		fmt.Fprintf(&b, "  deliberate: %s\n", d)
	}
	return b.String()
}

// Compare builds Istio's and nftcni's twins for c, sends the matrix
// through both and fails the test on any probe whose fates differ,
// naming it. A case nftcni cannot express is counted and named, never
// skipped in silence.
func Compare(t *testing.T, c Case) *Result {
	t.Helper()
	if c.Nftcni == nil {
		if c.NotExpressible == "" {
			t.Fatalf("%s: no nftcni form and no reason", c.Name)
		}
		Suite.notExpressible(c.Name, c.NotExpressible)
		t.Logf("%s: not expressible in nftcni: %s", c.Name, c.NotExpressible)
		return nil
	}
	istioTwin := NewTwin(t, "istio", c.Shape)
	nftTwin := NewTwin(t, "nftcni", c.Shape)
	c.Istio(t, istioTwin)
	c.Nftcni(t, nftTwin)
	r := Differ(t, c, istioTwin, nftTwin)
	Report(t, c, r)
	return r
}

// Report counts r in the suite's tally and fails the test on every probe
// that differs, naming it.
func Report(t testing.TB, c Case, r *Result) {
	t.Helper()
	Suite.add(r)
	for _, d := range r.Diffs {
		t.Errorf("%s: probe %q: Istio %q, nftcni %q", c.Name, d.Probe, d.Istio, d.Nftcni)
	}
	for p, why := range r.Deliberate {
		t.Logf("%s: probe %q differs on purpose: %s", c.Name, p, why)
	}
}

// Print writes the suite's result to w and appends it to
// $NFTCNI_CONFORMANCE_REPORT when set (make test prints that file: go test
// shows a passing package's output only with -v). Each test binary that
// compares calls it from its TestMain.
func (s *Tally) Print(w io.Writer, what string) {
	if s.Configs+len(s.NotExpressible) == 0 {
		return
	}
	out := what + " " + s.String()
	fmt.Fprint(w, out)
	if p := os.Getenv("NFTCNI_CONFORMANCE_REPORT"); p != "" {
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err == nil {
			_, err = f.WriteString(out)
			f.Close()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}
}

// Differ sends c's matrix through two twins already programmed and
// compares the fates.
func Differ(t testing.TB, c Case, a, b *Twin) *Result {
	probes := append(Matrix(c.Shape, c.ProxyUID, c.ProxyGID), c.Extra...)
	if c.Only != nil {
		probes = c.Only
	}
	seen := map[string]bool{}
	for _, p := range probes {
		if seen[p.Name] {
			t.Fatalf("%s: two probes named %q", c.Name, p.Name)
		}
		seen[p.Name] = true
	}
	var fa, fb map[string]string
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); fa = RunAll(a, probes) }()
	go func() { defer wg.Done(); fb = RunAll(b, probes) }()
	wg.Wait()
	r := &Result{Case: c.Name, Probes: len(probes), Deliberate: map[string]string{}, IstioFates: fa, NftcniFates: fb}
	for _, p := range probes {
		// A lost SYN on a loaded machine reads as no answer: a probe that
		// differs that way is sent again, alone, before it counts.
		for try := 1; try <= 2 && fa[p.Name] != fb[p.Name] && (fa[p.Name] == NoAnswer || fb[p.Name] == NoAnswer); try++ {
			fa[p.Name], fb[p.Name] = a.Run(p, nextToken(a)), b.Run(p, nextToken(b))
		}
		if fa[p.Name] == fb[p.Name] {
			continue
		}
		if c.Deliberate != nil {
			if why := c.Deliberate(p); why != "" {
				r.Deliberate[p.Name] = why
				continue
			}
		}
		r.Diffs = append(r.Diffs, Diff{Probe: p.Name, Istio: fa[p.Name], Nftcni: fb[p.Name]})
	}
	if os.Getenv("NFTCNI_CONFORMANCE_VERBOSE") != "" {
		for _, p := range probes {
			t.Logf("%-60s %-50s %s", p.Name, fa[p.Name], fb[p.Name])
		}
	}
	return r
}

// tokens number every probe sent, so that a listener's record is never
// taken for another probe's, whichever pod of a node sent it.
var tokens atomic.Uint64

func nextToken(tw *Twin) string { return fmt.Sprintf("%s-%d", tw.Name, tokens.Add(1)) }

// RunAll sends every probe through tw, a few at a time.
func RunAll(tw *Twin, probes []Probe) map[string]string {
	out := make(map[string]string, len(probes))
	var mu sync.Mutex
	work := make(chan int)
	var wg sync.WaitGroup
	for range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				f := tw.Run(probes[i], nextToken(tw))
				mu.Lock()
				out[probes[i].Name] = f
				mu.Unlock()
			}
		}()
	}
	for i := range probes {
		work <- i
	}
	close(work)
	wg.Wait()
	return out
}
