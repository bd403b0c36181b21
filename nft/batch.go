package nft

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/nft/nlsend"
)

// Batch is a ruleset encoded once for the kernel (nlsend.Batch), so that
// programming it into a netns is writing bytes to two sockets there: the
// nf_tables transaction (one send, one ack) and the policy routes (one
// send, one ack). The agent encodes a pod's batch warm and hands it to the
// plugin with its decision; the plugin, a freshly exec'd process, only
// sends it, with package nlsend.
//
// Nothing here encodes an expression by hand: the nf_tables messages are
// google/nftables' own, captured through its test dialer instead of a
// socket, and the route messages come from vishvananda/netlink's request
// encoder. Two things differ from what google/nftables v0.3.0 would send:
//
//   - Only the last message before the batch end asks for an ack, and no
//     rule asks for an echo. The kernel reports every error whatever the
//     flags, and a transaction is applied whole or not at all, so the one
//     ack says it all; v0.3.0 asks an ack of every message and an echo of
//     every rule and reads them one by one.
//   - Each table is created exclusively (NLM_F_EXCL). Into a fresh netns
//     that is a plain add; a netns that already holds the table fails the
//     whole transaction with EEXIST instead of getting a second copy of
//     every rule, and the sender then sends it again behind Replace, which
//     deletes the old table in the same transaction (an atomic swap).
//     Deleting costs a kernel RCU wait when the socket closes, so a fresh
//     netns never pays for it.
type Batch struct {
	nlsend.Batch
	// source is what Encode made the batch from (never sent): the Fake
	// reads it.
	source *Ruleset
}

// Size is the batch's length in bytes, all its parts.
func (b *Batch) Size() int { return len(b.Tables) + len(b.Replace) + len(b.Routes) }

// Program writes b into the netns behind fd (nlsend.Program).
func Program(fd int, b *Batch) error { return nlsend.Program(fd, &b.Batch) }

// Encode turns rs into its Batch.
func Encode(rs *Ruleset) (*Batch, error) {
	tables, err := capture(func(c *nftables.Conn) error { return stage(c, rs) })
	if err != nil {
		return nil, err
	}
	replace, err := capture(func(c *nftables.Conn) error {
		for _, t := range rs.Tables {
			nt := &nftables.Table{Name: t.Name, Family: nftables.TableFamilyINet}
			c.AddTable(nt)
			c.DelTable(nt)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	b := &Batch{Batch: nlsend.Batch{Tables: frame(tables, 1, true, true), Routes: routeMessages(rs.Routes, rs.LoopbackAddrs, true)}, source: rs}
	if len(replace) > 2 { // without its own batch begin and end
		b.Replace = frame(replace[1:len(replace)-1], uint32(len(tables)+1), false, false)
	}
	return b, nil
}

// EncodeRemoval is the batch that removes rs's tables and policy routes.
// Each table goes in a transaction of its own, so one already gone
// (ENOENT, which the sender accepts) cannot stop another's removal.
func EncodeRemoval(rs *Ruleset) (*nlsend.Removal, error) {
	r := &nlsend.Removal{Routes: routeMessages(rs.Routes, rs.LoopbackAddrs, false)}
	for _, t := range rs.Tables {
		msgs, err := capture(func(c *nftables.Conn) error {
			c.DelTable(&nftables.Table{Name: t.Name, Family: nftables.TableFamilyINet})
			return nil
		})
		if err != nil {
			return nil, err
		}
		r.Tables = append(r.Tables, frame(msgs, 1, false, true))
	}
	return r, nil
}

// capture runs build against a google/nftables connection whose socket is
// the library's test dialer, and returns the messages Flush would have
// written, batch begin to batch end.
func capture(build func(c *nftables.Conn) error) ([]netlink.Message, error) {
	var msgs []netlink.Message
	c, err := nftables.New(nftables.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		msgs = append(msgs, req...) // a Receive passes no request: nothing to ack
		return nil, nil
	}))
	if err != nil {
		return nil, err
	}
	if err := build(c); err != nil {
		return nil, err
	}
	if err := c.Flush(); err != nil {
		return nil, fmt.Errorf("encoding: %w", err)
	}
	return msgs, nil
}

// Netlink header flags as the kernel reads them.
const (
	flagsMask = unix.NLM_F_ACK | unix.NLM_F_ECHO
	newTable  = unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWTABLE
)

// frame serialises msgs with sequence numbers from seq on (so the same
// ruleset always gives the same bytes), no acks or echoes, tables created
// exclusively when exclusive is set and, when ackLast, an ack asked of the
// last message that is not the batch end.
func frame(msgs []netlink.Message, seq uint32, exclusive, ackLast bool) []byte {
	last := len(msgs) - 1
	if last > 0 && msgs[last].Header.Type == unix.NFNL_MSG_BATCH_END {
		last--
	}
	var out []byte
	for i, m := range msgs {
		h := m.Header
		h.Flags &^= flagsMask
		if h.Type == newTable && exclusive {
			h.Flags |= netlink.Create | netlink.Excl
		}
		if ackLast && i == last {
			h.Flags |= netlink.Acknowledge
		}
		h.Sequence, h.PID = seq+uint32(i), 0
		m.Header = h
		b, err := m.MarshalBinary()
		if err != nil { // the library set a length that is not its own message's
			panic(fmt.Sprintf("nft: encoding message %d: %v", i, err))
		}
		out = append(out, b...)
	}
	return out
}
