package enrol

import (
	"encoding/json"
	"sync"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

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
