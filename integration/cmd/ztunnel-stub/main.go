// Command ztunnel-stub is the demo's stand-in for ztunnel: it connects to
// the agent's ZDS socket and, for every pod it is handed, opens ztunnel's
// listeners inside the pod's netns and prints each connection that lands
// on them with its original destination. Not part of the product.
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
	z, err := ztunneltest.Dial(os.Args[1], 10*time.Second)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ztunnel-stub:", err)
		os.Exit(1)
	}
	say := func(f string, a ...any) { fmt.Printf("  [ztunnel] "+f+"\n", a...) }
	say("connected to %s, sent ZdsHello", os.Args[1])
	for {
		select {
		case <-z.Done():
			say("agent hung up")
			return
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
			default:
				say("%s %s", e.Kind, e.UID)
			}
		}
	}
}

// serve reports each connection that lands on l.
func serve(say func(string, ...any), pod string, l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		dst, _ := testnet.OriginalDst(c.(*net.TCPConn))
		say("%s: connection from %s to %s landed on %s", pod, c.RemoteAddr(), dst, c.LocalAddr())
		c.Close()
	}
}
