package main

import (
	"flag"
	"fmt"
	"io"
	"strings"
)

// commands lists each command's flags, registered by the same functions
// the commands parse with, so the reference cannot drift from the code.
func commands() []struct {
	name, what string
	flags      *flagSet
} {
	mk := func(name string, reg ...func(*flagSet)) *flagSet {
		f := newFlagSet(name)
		for _, r := range reg {
			r(f)
		}
		return f
	}
	var c common
	var r runFlags
	var once bool
	var i inspectFlags
	return []struct {
		name, what string
		flags      *flagSet
	}{
		{"run", "install, then watch and repair; serve the plugin, watch pods, talk to ztunnel (what the DaemonSet runs)", mk("run", c.register, r.register)},
		{"install", "install the plugin and its config (once, with --once)", mk("install", c.register, func(f *flagSet) { onceFlag(f, &once) })},
		{"uninstall", "remove exactly what install added", mk("uninstall", c.register)},
		{"inspect", "a pod's or the host's live ruleset, drift, enrolment and ztunnel state", mk("inspect", i.register)},
	}
}

// writeReference prints the configuration reference in Markdown: every
// command's flags with their env var twins, defaults and meaning.
func writeReference(w io.Writer) {
	fmt.Fprint(w, "# nftcni-agent configuration reference\n\n")
	fmt.Fprint(w, "Generated from the flag definitions by `make docs` (`nftcni-agent reference`); a test fails when it\n")
	fmt.Fprint(w, "is out of date. Every flag has an environment variable twin; a flag on the command line wins over\n")
	fmt.Fprint(w, "its variable, which wins over the default. The Helm chart sets the variables (ConfigMap `nftcni-config`).\n")
	for _, cmd := range commands() {
		fmt.Fprintf(w, "\n## `nftcni-agent %s`\n\n%s.\n\n", cmd.name, strings.TrimSpace(cmd.what))
		fmt.Fprint(w, "| flag | env | default | meaning |\n|---|---|---|---|\n")
		cmd.flags.VisitAll(func(fl *flag.Flag) {
			usage, _, _ := strings.Cut(fl.Usage, " [env ")
			def := fl.DefValue
			if def == "" {
				def = "—"
			} else {
				def = "`" + def + "`"
			}
			fmt.Fprintf(w, "| `--%s` | `%s` | %s | %s |\n", fl.Name, cmd.flags.env[fl.Name], def, strings.ReplaceAll(usage, "|", "\\|"))
		})
	}
}
