// Package hostprobe keeps the host probe SNAT table (capture.HostProbe): the
// sets of enrolled pod IPs whose kubelet probes are SNATed to
// 169.254.7.127, each element owned by a pod UID.
//
// The agent is the table's only writer, so the owners live in memory and a
// pod's change is computed there and sent as one batch over a connection
// kept open in the host netns: no read before a write. Anyone else's
// change (a flushed ruleset, a firewall reload: istio#60607) is found by
// Assert, which the agent runs on an interval, and put right atomically.
package hostprobe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
)

// Table is the host probe table of one node.
type Table struct {
	k    nft.Host
	spec capture.HostSpec
	log  *slog.Logger

	mu     sync.Mutex
	owners map[netip.Addr]string // what the kernel's sets hold, as we wrote it
}

// Open connects to the host netns behind host and reads what the table
// holds now (nothing if it is not there yet).
func Open(host *os.File, spec capture.HostSpec, log *slog.Logger) (*Table, error) {
	fd := int(host.Fd())
	k, err := nft.OpenHost(fd)
	if err != nil {
		return nil, err
	}
	t, err := New(k, spec, log)
	if err != nil {
		k.Close()
	}
	return t, err
}

// New is a Table on k, holding what k holds now.
func New(k nft.Host, spec capture.HostSpec, log *slog.Logger) (*Table, error) {
	t := &Table{k: k, spec: spec, log: log}
	var err error
	if t.owners, _, err = k.Elements(); err != nil {
		return nil, err
	}
	if t.owners == nil {
		t.owners = map[netip.Addr]string{}
	}
	return t, nil
}

// Close closes the connection.
func (t *Table) Close() error { return t.k.Close() }

// keep says whether the table holds ip at all (IPv6 off: no v6 set).
func (t *Table) keep(ip netip.Addr) bool { return ip.Is4() || t.spec.IPv6 }

// Add gives a pod's IPs to uid. An IP still held by another UID (reused
// after a pod died without cleanup) is taken over by this pod.
func (t *Table) Add(uid string, ips []netip.Addr) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var dels []netip.Addr
	var adds []nft.Element
	for _, ip := range ips {
		ip = ip.Unmap()
		owner, present := t.owners[ip]
		if !t.keep(ip) || (present && owner == uid) {
			continue
		}
		if present {
			dels = append(dels, ip)
		}
		adds = append(adds, nft.Element{Addr: ip, Comment: uid})
	}
	if err := t.k.Update(dels, adds); err != nil {
		return t.lost(err)
	}
	for _, e := range adds {
		t.owners[e.Addr] = uid
	}
	return nil
}

// Remove takes a pod's IPs out, but only those uid owns: an IP reused by
// another pod stays (Istio's rule).
func (t *Table) Remove(uid string, ips []netip.Addr) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var dels []netip.Addr
	for _, ip := range ips {
		ip = ip.Unmap()
		if owner, present := t.owners[ip]; present && owner == uid {
			dels = append(dels, ip)
		}
	}
	if err := t.k.Update(dels, nil); err != nil {
		return t.lost(err)
	}
	for _, ip := range dels {
		delete(t.owners, ip)
	}
	return nil
}

// lost re-reads the kernel's sets after a failed change: the memory was
// wrong (someone changed the table), and the next Assert puts it right.
func (t *Table) lost(err error) error {
	if owners, ok, rerr := t.k.Elements(); rerr == nil && ok {
		t.owners = owners
	}
	return fmt.Errorf("host probe set: %w", err)
}

// Assert makes the table hold exactly members plus, with keepPresent, the
// elements already in it that no member accounts for (pods enrolled before
// this agent started, while it cannot yet tell which are gone). It
// verifies the table through netlink and replaces it atomically when
// anything differs; it reports whether it had to.
func (t *Table) Assert(members []nft.Member, keepPresent bool) (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	owners := map[netip.Addr]string{}
	if keepPresent {
		present, _, err := t.k.Elements()
		if err != nil {
			return false, err
		}
		for ip, uid := range present {
			owners[ip] = uid
		}
	}
	for _, m := range members {
		for _, ip := range m.IPs {
			if ip = ip.Unmap(); t.keep(ip) {
				owners[ip] = m.UID // one element per IP; members win
			}
		}
	}
	want := capture.HostProbe(t.spec, nft.Members(owners))
	err := t.k.Verify(want)
	var drift *nft.DriftError
	switch {
	case err == nil:
		t.owners = owners
		return false, nil
	case !errors.As(err, &drift):
		return false, err
	}
	if err := t.k.Apply(want); err != nil {
		return false, fmt.Errorf("re-asserting the host probe table: %w", err)
	}
	t.owners = owners
	return true, nil
}

// Repair checks the kernel's table against what the agent wrote (the
// owners in memory: nothing else writes it) and puts it back atomically
// when anyone changed it. It reports whether it had to.
func (t *Table) Repair() (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	want := capture.HostProbe(t.spec, nft.Members(t.owners))
	err := t.k.Verify(want)
	var drift *nft.DriftError
	switch {
	case err == nil:
		return false, nil
	case !errors.As(err, &drift):
		return false, err
	}
	if err := t.k.Apply(want); err != nil {
		return false, fmt.Errorf("re-asserting the host probe table: %w", err)
	}
	t.log.Warn("host probe table had drifted (flushed or edited by someone else); put back", "table", "inet "+nft.HostTable, "drift", err)
	return true, nil
}

// Guard runs Repair every interval until ctx ends.
func (t *Table) Guard(ctx context.Context, every time.Duration) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if _, err := t.Repair(); err != nil {
			t.log.Error("host probe table", "err", err)
		}
	}
}

// Owners returns a copy of the table's elements as the agent wrote them.
func (t *Table) Owners() map[netip.Addr]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[netip.Addr]string, len(t.owners))
	for ip, uid := range t.owners {
		out[ip] = uid
	}
	return out
}

// Delete removes the whole table (uninstall).
func (t *Table) Delete() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.owners = map[netip.Addr]string{}
	return t.k.Delete(capture.HostProbe(t.spec, nil))
}
