// Command pause is the sandbox image's only process in the containerd
// tests: it holds the pod's namespaces until it is told to stop, as
// Kubernetes' pause image does. No registry is needed to test with it.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
	os.Exit(0)
}
