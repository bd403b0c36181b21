package nft

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Generation is the netns's nf_tables ruleset generation: the kernel adds
// one with every committed transaction, whoever sends it. While it stays
// the same, no table, chain, set or rule in that netns has changed, which
// lets a periodic verification skip listing a ruleset it has already seen
// intact.
func Generation(fd int) (uint32, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: fd})
	if err != nil {
		return 0, fmt.Errorf("netlink: %w", err)
	}
	defer c.Close()
	msgs, err := c.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		Data:   []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return 0, fmt.Errorf("reading the ruleset generation: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return ad.Uint32(), nil
			}
		}
	}
	return 0, errors.New("the kernel sent no ruleset generation")
}

// Check is Verify for a ruleset already seen intact at generation gen:
// while the netns's nf_tables generation is still gen nothing there can
// have changed, so only the policy routes are listed. gen 0 always lists
// everything. It returns the generation read before looking, so a change
// made while it looks is caught the next time.
func Check(fd int, rs *Ruleset, gen uint32) (uint32, error) {
	now, err := Generation(fd)
	if err != nil {
		return 0, err
	}
	if gen == 0 || now != gen {
		return now, Verify(fd, rs)
	}
	if err := routesPresent(fd, rs.Routes, rs.LoopbackAddrs); err != nil {
		return now, &DriftError{Problems: []string{err.Error()}}
	}
	return now, nil
}
