// Command nftcni is the chained CNI plugin the container runtime executes
// for every pod sandbox; the verbs live in package plugin.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
	bv "github.com/containernetworking/plugins/pkg/utils/buildversion"

	"github.com/nftcni/nftcni/plugin"
)

func main() {
	skel.PluginMainFuncs(plugin.New().Funcs(), version.All, bv.BuildString("nftcni"))
}
