// Command ztunnel-stub is the demo's and the node tests' stand-in for
// ztunnel: it connects to the agent's ZDS socket and, for every pod it is
// handed, opens ztunnel's listeners inside the pod's netns, greets every
// connection that lands on them with "ztunnel:<port> dst=<original
// destination>" and prints it. Like ztunnel it reconnects when the agent
// restarts, keeping the old listeners until the new snapshot is in. Not
// part of the product.
package main

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: ztunnel-stub /path/to/ztunnel.sock")
		os.Exit(2)
	}
	say := func(f string, a ...any) { fmt.Printf("  [ztunnel] "+f+"\n", a...) }
	var old *ztunnel
	for {
		z, err := ztunneltest.Dial(os.Args[1], time.Hour)
		if err != nil {
			fmt.Fprintln(os.Stderr, "ztunnel-stub:", err)
			os.Exit(1)
		}
		say("connected to %s, sent ZdsHello", os.Args[1])
		old = serveConn(say, z, old)
		say("agent hung up; reconnecting")
	}
}

type ztunnel = ztunneltest.Ztunnel

// serveConn handles one connection until the agent hangs up, closing the
// previous connection's listeners once this one's snapshot is in.
func serveConn(say func(string, ...any), z, prev *ztunnel) *ztunnel {
	for {
		select {
		case <-z.Done():
			return z
		case e := <-z.Events():
			switch e.Kind {
			case zds.KindAdd:
				name := e.UID
				if e.Info != nil {
					name = e.Info.Namespace + "/" + e.Info.Name
				}
				say("AddWorkload %s (uid %s, %d netns fd): listening on 15001/15006/15008 inside the pod", name, e.UID, e.FDs)
				if p := z.Pod(e.UID); p != nil {
					for _, l := range []net.Listener{p.Outbound, p.Inbound, p.HBONE} {
						go serve(say, name, l)
					}
				}
			case zds.KindSnapshotSent:
				say("snapshot complete")
				if prev != nil {
					prev.Close()
					prev = nil
				}
			default:
				say("%s %s", e.Kind, e.UID)
			}
		}
	}
}

// serve greets and reports each connection that lands on l.
func serve(say func(string, ...any), pod string, l net.Listener) {
	_, port, _ := net.SplitHostPort(l.Addr().String())
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		dst, _ := testnet.OriginalDst(c.(*net.TCPConn))
		fmt.Fprintf(c, "ztunnel:%s dst=%s\n", port, dst)
		say("%s: connection from %s to %s landed on %s", pod, c.RemoteAddr(), dst, c.LocalAddr())
		c.Close()
	}
}
