package nft

import (
	"sync"
	"time"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// Interface is the kernel of a pod's netns as the agent uses it: program a
// batch, remove what any pod ruleset left, check a ruleset against the
// live one, survey what istio-cni left and take it over. Kernel is the
// real one; Fake keeps it in memory for the callers' tests.
type Interface interface {
	// Program writes b into the netns behind fd, replacing our table.
	Program(fd int, b *Batch) error
	// Remove deletes our table and every policy route any pod ruleset
	// makes; nothing there is no error.
	Remove(fd int) error
	// Check verifies rs in the netns, skipping the listing of nf_tables
	// objects when the ruleset generation is still gen (0: always list);
	// it returns the generation it saw (Check).
	Check(fd int, rs *Ruleset, gen uint32) (uint32, error)
	// Survey says what of istio-cni's state the netns holds, and what
	// iptables-legacy tables.
	Survey(fd int) (*IstioState, error)
	// TakeOver replaces istio-cni's state with b's ruleset in one
	// transaction and says what it replaced (nothing: there was none).
	TakeOver(fd int, b *Batch) (replaced []string, err error)
	// Verify is Check listing everything: nil, or a *DriftError.
	Verify(fd int, rs *Ruleset) error
	// Live prints table as the netns holds it ("" when it is not there),
	// rules named from want where they match (Live).
	Live(fd int, table string, want *Ruleset) (string, error)
}

var (
	_ Interface = (*Kernel)(nil)
	_ Interface = (*Fake)(nil)
)

// Kernel is Interface through netlink.
type Kernel struct {
	cleanup func() (*nlsend.Removal, error)
}

// NewKernel returns the kernel whose Remove deletes what cleanup names
// (capture.PodCleanup: every pod ruleset's table and policy routes; nil
// for a caller that never removes).
func NewKernel(cleanup *Ruleset) *Kernel {
	if cleanup == nil {
		cleanup = &Ruleset{}
	}
	return &Kernel{cleanup: sync.OnceValues(func() (*nlsend.Removal, error) { return EncodeRemoval(cleanup) })}
}

// Program is Program.
func (*Kernel) Program(fd int, b *Batch) error { return Program(fd, b) }

// Remove deletes what the kernel's cleanup names. Its sockets are closed
// afterwards, by closeLater.
func (k *Kernel) Remove(fd int) error {
	r, err := k.cleanup()
	if err != nil {
		return err
	}
	socks, err := nlsend.Dial(fd, nlsend.RemovalProtos(r)...)
	if err != nil {
		return err
	}
	defer closeLater(socks)
	return nlsend.RemoveOn(socks, r)
}

// closing holds netlink sockets to close a while after the caller has
// answered. The last close of an nf_tables socket that deleted something
// waits until the kernel has destroyed it: nf_tables' release handler
// flushes its destroy work (an RCU grace period, 7 ms and more here), and
// holds the netns's nf_tables mutex meanwhile, which the removal of the
// pod's interface (the primary's DEL, right after ours) takes too. By
// closeDelay the work has run on its own and the close costs nothing.
// One goroutine, there only while there is something to close, keeps
// them; past maxClosing queued, the caller closes in place.
var closing struct {
	mu      sync.Mutex
	queue   []queued
	running bool
}

type queued struct {
	socks []int
	at    time.Time
}

const (
	maxClosing = 256
	closeDelay = 200 * time.Millisecond
)

func closeLater(socks []int) {
	closing.mu.Lock()
	defer closing.mu.Unlock()
	if len(closing.queue) >= maxClosing {
		nlsend.CloseAll(socks)
		return
	}
	closing.queue = append(closing.queue, queued{socks, time.Now().Add(closeDelay)})
	if !closing.running {
		closing.running = true
		go closeQueued()
	}
}

func closeQueued() {
	for {
		closing.mu.Lock()
		if len(closing.queue) == 0 {
			closing.running = false
			closing.mu.Unlock()
			return
		}
		q := closing.queue[0]
		closing.queue = closing.queue[1:]
		closing.mu.Unlock()
		time.Sleep(time.Until(q.at))
		nlsend.CloseAll(q.socks)
	}
}

// Check is Check.
func (*Kernel) Check(fd int, rs *Ruleset, gen uint32) (uint32, error) { return Check(fd, rs, gen) }

// Verify is Verify.
func (*Kernel) Verify(fd int, rs *Ruleset) error { return Verify(fd, rs) }

// Live is Live.
func (*Kernel) Live(fd int, table string, want *Ruleset) (string, error) {
	return Live(fd, table, want)
}

// Survey is SurveyPod.
func (*Kernel) Survey(fd int) (*IstioState, error) { return SurveyPod(fd) }

// TakeOver is TakeOver of what a fresh survey finds.
func (*Kernel) TakeOver(fd int, b *Batch) ([]string, error) {
	s, err := SurveyPod(fd)
	if err != nil || !s.Found() {
		return nil, err
	}
	return s.What(), TakeOver(fd, b, s)
}
