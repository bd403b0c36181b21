package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/nftcni/nftcni/agent/inspect"
	"github.com/nftcni/nftcni/capture"
)

const inspectUsage = `usage: nftcni-agent inspect [flags] <namespace/name | /path/to/netns | host>

Prints, for a pod (by name or by its netns file) or for the host's probe
table: the live ruleset read through netlink in nft syntax, whether it is
exactly what the pod's decision asks for, the pod's enrolment as the agent
recorded it, and what ztunnel has of it (asked from the running agent).
Exit status: 0 all as expected, 1 drift, 2 usage or lookup error.
`

type inspectFlags struct {
	runDir, hostNetns string
	ipv6              bool
	probeSNAT         probeSNATFlags
}

func (i *inspectFlags) register(f *flagSet) {
	runDirFlag(f, &i.runDir)
	hostNetnsFlag(f, &i.hostNetns)
	ipv6Flag(f, &i.ipv6)
	i.probeSNAT.register(f)
}

func inspectCmd(args []string, out io.Writer) error {
	var i inspectFlags
	f := newFlagSet("inspect")
	i.register(f)
	f.Usage = func() { fmt.Fprint(f.Output(), inspectUsage, "\nflags:\n"); f.PrintDefaults() }
	if err := f.parse(args); err != nil {
		return err
	}
	if f.NArg() != 1 {
		f.Usage()
		return errors.New("inspect takes one pod (namespace/name or a netns path) or \"host\"")
	}
	snat, err := i.probeSNAT.parse()
	if err != nil {
		return err
	}
	return (&inspect.Inspector{RunDir: i.runDir, HostNetns: i.hostNetns, Host: capture.HostSpec{IPv6: i.ipv6, SNAT: snat}}).Target(out, f.Arg(0))
}
