// Command hello is a static Go hello-world: the benchmarks' baseline for
// what exec'ing any Go binary costs on the machine they run on.
package main

import "os"

func main() { os.Stdout.WriteString("{}\n") }
