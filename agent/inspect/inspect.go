// Package inspect is the verdict of `nftcni-agent inspect`: a pod's or
// the host's live ruleset read through netlink, compared with what the
// agent's record of it asks for, and what the running agent knows of it
// (asked over its socket). It only reads.
package inspect

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// ErrDrift is a netns that does not hold what its decision asks for
// (inspect exits 1).
var ErrDrift = errors.New("drift found")

// Inspector reads what the agent recorded and what the kernel holds,
// without changing anything, and asks the running agent for the rest.
type Inspector struct {
	RunDir, HostNetns string
	Host              capture.HostSpec
	// Kernel reads the netns (nil: the kernel, through netlink).
	Kernel nft.Interface
}

func (i *Inspector) kernel() nft.Interface {
	if i.Kernel == nil {
		i.Kernel = nft.NewKernel(nil)
	}
	return i.Kernel
}

// Target prints one pod (namespace/name or its netns path) or "host".
func (i *Inspector) Target(out io.Writer, target string) error {
	recs, bad, err := records.Read(i.RunDir)
	if err != nil {
		return fmt.Errorf("reading the agent's pod records in %s: %w", filepath.Join(i.RunDir, records.DirName), err)
	}
	for _, b := range bad {
		fmt.Fprintf(out, "warning: unreadable pod record %v\n", b)
	}
	if target == "host" {
		return i.host(out, recs)
	}
	var match []records.Record
	for _, r := range recs {
		if r.Pod.Key() == target || (r.Pod.Netns != "" && r.Pod.Netns == target) {
			match = append(match, r)
		}
	}
	if len(match) == 0 {
		if strings.HasPrefix(target, "/") {
			return i.unknownNetns(out, target)
		}
		if ns, name, ok := strings.Cut(target, "/"); ok {
			if in := i.ask(&wire.Pod{Namespace: ns, Name: name}); in.Pod != nil {
				return i.unrecorded(out, in)
			}
		}
		return fmt.Errorf("the agent has no record of pod %s in %s: it was not started through nftcni on this node, or it is gone (a sidecar pod programmed from runtime annotations is never recorded: inspect it by its netns path)",
			target, filepath.Join(i.RunDir, records.DirName))
	}
	var errs error
	for _, r := range match {
		errs = errors.Join(errs, i.pod(out, r))
	}
	return errs
}

// pod prints one recorded pod and checks its netns against its decision.
func (i *Inspector) pod(out io.Writer, r records.Record) error {
	d := r.Decision
	if d == nil {
		d = &enablement.Decision{Mode: wire.ModeNone}
	}
	fmt.Fprintf(out, "pod %s (uid %s, sandbox %s, %s)\n", r.Pod.Key(), r.UID, short(r.Pod.ContainerID), r.Pod.IfName)
	fmt.Fprintf(out, "  netns:     %s\n", r.Pod.Netns)
	fmt.Fprintf(out, "  IPs:       %s\n", strings.Join(r.Pod.IPs, ", "))
	fmt.Fprintf(out, "  enrolment: %s\n", withReason(string(d.Mode), d.Reason))
	ag := i.ask(&wire.Pod{UID: r.UID})
	fmt.Fprintf(out, "  ztunnel:   %s\n", ag.ZDS)
	if d.Mode != wire.ModeNone {
		fmt.Fprintf(out, "  verified:  %s\n", verified(ag))
	}
	want, err := d.Ruleset()
	if err != nil {
		return fmt.Errorf("pod %s: its recorded decision gives no ruleset: %w", r.Pod.Key(), err)
	}
	fd, err := unix.Open(r.Pod.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintf(out, "  ruleset:   cannot look: %v (the pod is gone, or its netns is not visible from here: run inspect where /var/run/netns is the host's)\n", err)
		return fmt.Errorf("pod %s: %w", r.Pod.Key(), err)
	}
	defer unix.Close(fd)
	return i.check(out, fd, nft.PodTable, want)
}

// unrecorded prints a pod the running agent tracks without a record: one
// found through /proc that it did not enrol (istio-cni's rules with
// someone else's beside them, left as they were, say).
func (i *Inspector) unrecorded(out io.Writer, in *wire.Inspect) error {
	p := in.Pod
	fmt.Fprintf(out, "pod %s (uid %s, no record: known to the running agent only)\n", p.Key(), p.UID)
	fmt.Fprintf(out, "  netns:     %s\n", p.Netns)
	fmt.Fprintf(out, "  IPs:       %s\n", strings.Join(p.IPs, ", "))
	fmt.Fprintf(out, "  enrolment: %s\n", in.Enrolment)
	fmt.Fprintf(out, "  ztunnel:   %s\n", in.ZDS)
	fd, err := unix.Open(p.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintf(out, "  ruleset:   cannot look: %v\n", err)
		return nil
	}
	defer unix.Close(fd)
	return i.uncompared(out, fd)
}

// unknownNetns prints the ruleset of a netns the agent has no record of.
func (i *Inspector) unknownNetns(out io.Writer, path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	fmt.Fprintf(out, "netns %s\n  enrolment: no record in %s (not seen by the agent; sidecar pods programmed from runtime annotations are not recorded)\n",
		path, filepath.Join(i.RunDir, records.DirName))
	return i.uncompared(out, fd)
}

// uncompared prints our table in the netns behind fd as it is: with no
// recorded decision there is nothing to compare it with.
func (i *Inspector) uncompared(out io.Writer, fd int) error {
	live, err := i.kernel().Live(fd, nft.PodTable, nil)
	if err != nil {
		return err
	}
	if live == "" {
		fmt.Fprintf(out, "  ruleset:   none (no table inet %s)\n", nft.PodTable)
		return nil
	}
	fmt.Fprintf(out, "  ruleset:   present, not compared (no recorded decision); rule texts need a decision to be named\n%s", live)
	return nil
}

// host checks the probe table against the pods recorded as ambient.
func (i *Inspector) host(out io.Writer, recs []records.Record) error {
	var members []nft.Member
	for _, r := range recs {
		if r.Decision == nil || r.Decision.Mode != wire.ModeAmbient {
			continue
		}
		m := nft.Member{UID: r.UID}
		for _, s := range r.Pod.IPs {
			if p, err := netip.ParsePrefix(s); err == nil {
				m.IPs = append(m.IPs, p.Addr())
			}
		}
		members = append(members, m)
	}
	fd, err := unix.Open(i.HostNetns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the host netns %s (--host-netns): %w", i.HostNetns, err)
	}
	defer unix.Close(fd)
	fmt.Fprintf(out, "host (netns %s)\n  enrolled ambient pods recorded: %d\n", i.HostNetns, len(members))
	return i.check(out, fd, nft.HostTable, capture.HostProbe(i.Host, members))
}

// check prints the verdict and the live table; drift is errDrift.
func (i *Inspector) check(out io.Writer, fd int, table string, want *nft.Ruleset) error {
	live, err := i.kernel().Live(fd, table, want)
	if err != nil {
		return err
	}
	var verr error
	if want == nil {
		if live != "" {
			verr = &nft.DriftError{Problems: []string{"table inet " + table + " exists but the pod is not enrolled"}}
		}
	} else {
		verr = i.kernel().Verify(fd, want)
	}
	var drift *nft.DriftError
	switch {
	case errors.As(verr, &drift):
		fmt.Fprintf(out, "  ruleset:   DRIFT\n")
		for _, p := range drift.Problems {
			fmt.Fprintf(out, "             - %s\n", p)
		}
	case verr != nil:
		return verr
	case want == nil:
		fmt.Fprintf(out, "  ruleset:   none, as expected for a pod outside the mesh\n")
	default:
		fmt.Fprintf(out, "  ruleset:   matches the decision (tables, hooks, sets, every rule, policy routes)\n")
	}
	if live != "" {
		fmt.Fprintf(out, "  live (read through netlink):\n%s", indent(live))
	}
	if drift != nil {
		return ErrDrift
	}
	return nil
}

// ask asks the running agent what it knows of the pod beyond its record.
func (i *Inspector) ask(pod *wire.Pod) *wire.Inspect {
	sock := filepath.Join(i.RunDir, wire.SocketName)
	unknown := func(why string) *wire.Inspect { return &wire.Inspect{ZDS: "unknown: " + why} }
	c, err := wire.Dial(sock, time.Second)
	if err != nil {
		return unknown(fmt.Sprintf("the agent at %s is not reachable (%v)", sock, err))
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Send(&wire.Message{Kind: wire.KindInspect, Pod: pod}, nil); err != nil {
		return unknown(err.Error())
	}
	m, fd, err := c.Recv()
	if fd != nil {
		fd.Close()
	}
	switch {
	case err != nil:
		return unknown(err.Error())
	case m.Kind == wire.KindError:
		return unknown("the agent says " + m.Error)
	case m.Inspect == nil:
		return unknown("the agent sent no answer")
	}
	return m.Inspect
}

// verified says when the agent last found the pod's ruleset intact.
func verified(in *wire.Inspect) string {
	var s string
	switch {
	case strings.HasPrefix(in.ZDS, "unknown:"):
		return "unknown: the agent is not reachable"
	case in.Verified.IsZero():
		s = "not yet by this agent (its first pass runs right after it starts)"
	default:
		s = fmt.Sprintf("%s ago (%s)", time.Since(in.Verified).Round(time.Second), in.Verified.UTC().Format(time.RFC3339))
	}
	if in.Repairs > 0 {
		s += fmt.Sprintf("; put back %d times, last drift: %s", in.Repairs, in.Drift)
	}
	return s
}

// withReason prints "what (why)", or "what" when there is no why.
func withReason(what, why string) string {
	if why == "" {
		return what
	}
	return what + " (" + why + ")"
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func indent(s string) string {
	return "    " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n    ") + "\n"
}
