// Command nftcni is the chained CNI plugin the container runtime executes
// for every pod sandbox; the verbs live in package plugin.
package main

import (
	"os"

	"github.com/nftcni/nftcni/plugin"
)

func main() {
	os.Exit(plugin.New().Main(os.Getenv, os.Stdin, os.Stdout, os.Stderr))
}
