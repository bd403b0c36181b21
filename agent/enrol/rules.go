package enrol

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// NftRules is Rules on package nft.
type NftRules struct{}

var podCleanup = sync.OnceValues(func() (*nlsend.Removal, error) { return nft.EncodeRemoval(capture.PodCleanup()) })

// Program writes b into the netns behind fd.
func (NftRules) Program(fd int, b *nft.Batch) error { return nft.Program(fd, b) }

// Remove deletes our table and every policy route any pod ruleset makes.
// Its sockets are closed afterwards, by closer.
func (NftRules) Remove(fd int) error {
	r, err := podCleanup()
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

// Check is nft.Check.
func (NftRules) Check(fd int, rs *nft.Ruleset, gen uint32) (uint32, error) {
	return nft.Check(fd, rs, gen)
}

// Survey is nft.SurveyPod.
func (NftRules) Survey(fd int) (*nft.IstioState, error) { return nft.SurveyPod(fd) }

// TakeOver is nft.TakeOver of what a fresh survey finds.
func (NftRules) TakeOver(fd int, b *nft.Batch) ([]string, error) {
	s, err := nft.SurveyPod(fd)
	if err != nil || !s.Found() {
		return nil, err
	}
	return s.What(), nft.TakeOver(fd, b, s)
}

// batchCache keeps the encoded batch of each decision seen: a node's pods
// share a handful of specs, and encoding warm costs more than a lookup.
type batchCache struct {
	mu sync.Mutex
	m  map[string]*encoded
}

type encoded struct {
	rs    *nft.Ruleset
	batch *nft.Batch
}

// maxCached bounds the cache; past it, it starts over.
const maxCached = 256

// get returns the ruleset and batch of a decision (nil for ModeNone).
func (c *batchCache) get(d *enablement.Decision) (*nft.Ruleset, *nft.Batch, error) {
	if d.Mode == wire.ModeNone {
		return nil, nil, nil
	}
	key, err := json.Marshal(struct {
		M wire.Mode
		A any
		S any
	}{d.Mode, d.Ambient, d.Sidecar}) // maps marshal with sorted keys: one key per spec
	if err != nil {
		return nil, nil, err
	}
	c.mu.Lock()
	if e, ok := c.m[string(key)]; ok {
		c.mu.Unlock()
		return e.rs, e.batch, nil
	}
	c.mu.Unlock()
	rs, err := d.Ruleset()
	if err != nil {
		return nil, nil, err
	}
	b, err := nft.Encode(rs)
	if err != nil {
		return nil, nil, err
	}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxCached {
		c.m = map[string]*encoded{}
	}
	c.m[string(key)] = &encoded{rs: rs, batch: b}
	c.mu.Unlock()
	return rs, b, nil
}
