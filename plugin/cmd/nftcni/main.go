// Command nftcni is the chained CNI plugin the container runtime executes for
// every pod sandbox. At this stage it is a pure pass-through: ADD and CHECK
// return prevResult unchanged (converted to the config's cniVersion), DEL
// succeeds. Enrolment (talking to the agent, programming the pod's ruleset)
// comes with the plugin work.
package main

import (
	"encoding/json"
	"fmt"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	bv "github.com/containernetworking/plugins/pkg/utils/buildversion"
)

func parse(stdin []byte) (*types.NetConf, error) {
	conf := &types.NetConf{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, fmt.Errorf("nftcni: parsing network config: %w", err)
	}
	if err := version.ParsePrevResult(conf); err != nil {
		return nil, fmt.Errorf("nftcni: parsing prevResult: %w", err)
	}
	return conf, nil
}

func cmdAdd(args *skel.CmdArgs) error {
	conf, err := parse(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.PrintResult(&current.Result{CNIVersion: current.ImplementedSpecVersion}, conf.CNIVersion)
	}
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

func cmdDel(*skel.CmdArgs) error { return nil }

func cmdCheck(args *skel.CmdArgs) error {
	_, err := parse(args.StdinData)
	return err
}

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: cmdAdd, Del: cmdDel, Check: cmdCheck}, version.All, bv.BuildString("nftcni"))
}
