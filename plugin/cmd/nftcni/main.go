// Command nftcni is the chained CNI plugin the container runtime executes
// for every pod sandbox; the verbs live in package plugin.
//
// A plugin process lives a few milliseconds on one thread: the runtime's
// cgroup-aware GOMAXPROCS (reading /proc/self/cgroup and mountinfo at
// start-up) buys it nothing.
//
//go:debug containermaxprocs=0
package main

import (
	"os"

	"github.com/nftcni/nftcni/plugin"
)

func main() {
	os.Exit(plugin.New().Main(os.Getenv, os.Stdin, os.Stdout, os.Stderr))
}
