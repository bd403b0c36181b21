package main

import (
	"net/netip"
	"os"
	"github.com/nftcni/nftcni/nft"
	"golang.org/x/sys/unix"
)

func main() {
	fd, _ := unix.Open(os.Args[1], unix.O_RDONLY, 0)
	if err := nft.Apply(fd, nft.HostProbe(true, []nft.Member{{UID: "u", IPs: []netip.Addr{netip.MustParseAddr("fd77:f::2")}}})); err != nil { panic(err) }
}
