// Command nullplugin is the least a chained CNI plugin written in Go can
// do: hand prevResult back. Benchmarks chain it to measure what any Go
// plugin adds to an ADD before it does anything (its exec, its stdin, its
// result), the floor under nftcni's own figures.
package main

import (
	"io"
	"os"

	"github.com/tidwall/gjson"
)

func main() {
	if os.Getenv("CNI_COMMAND") == "VERSION" {
		os.Stdout.WriteString(`{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}` + "\n")
		return
	}
	in, _ := io.ReadAll(os.Stdin)
	if prev := gjson.GetBytes(in, "prevResult"); os.Getenv("CNI_COMMAND") == "ADD" && prev.Exists() {
		os.Stdout.WriteString(prev.Raw + "\n")
	}
}
