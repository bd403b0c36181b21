// Package plugin is the nftcni chained CNI plugin: every verb of CNI 1.1.
//
// ADD asks the agent what the pod gets, handing it the pod's netns fd, then
// programs the pod's ruleset in that netns and reports back; the agent marks
// the pod enrolled only after the rules are in place. The plugin never
// talks to Kubernetes: identity comes from CNI_ARGS and prevResult, pod
// annotations from the runtime's io.kubernetes.cri.pod-annotations
// capability, everything else from the agent.
//
// Failure policy: a pod that would be enrolled never starts un-captured (ADD
// fails and the runtime retries); a pod that would not be enrolled is never
// blocked because the agent is down. Without the agent, the policy snapshot
// it keeps in the run dir decides which is which.
package plugin

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Plugin runs the CNI verbs.
type Plugin struct {
	// DialTimeout bounds connecting to the agent's socket.
	DialTimeout time.Duration
	// Timeout bounds the whole conversation with the agent in one call,
	// including its wait for ztunnel.
	Timeout time.Duration
}

// New returns a Plugin with the production timeouts.
func New() *Plugin { return &Plugin{DialTimeout: time.Second, Timeout: 5 * time.Second} }

// Funcs is what skel dispatches to.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, GC: p.GC, Status: p.Status}
}

// call is one invocation: its config, its log buffer, its agent connection.
type call struct {
	p     *Plugin
	conf  *Config
	args  *skel.CmdArgs
	k8s   *K8sArgs
	recs  records
	log   *slog.Logger
	agent *wire.Conn
	began time.Time
}

// since is the time from the call's start, in ms, for log records.
func (c *call) since() float64 { return float64(time.Since(c.began).Microseconds()) / 1000 }

func (p *Plugin) start(args *skel.CmdArgs) (*call, error) {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "nftcni: "+err.Error(), "")
	}
	c := &call{p: p, conf: conf, args: args, began: time.Now()}
	c.log = newLogger(conf.level, &c.recs).With("containerID", args.ContainerID)
	if c.k8s, err = parseArgs(args.Args); err != nil {
		c.finish()
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "nftcni: "+err.Error(), "")
	}
	if ns := string(c.k8s.K8S_POD_NAMESPACE); ns != "" {
		c.log = c.log.With("pod", ns+"/"+string(c.k8s.K8S_POD_NAME))
	}
	return c, nil
}

// finish ships the call's log records and closes the agent connection.
func (c *call) finish() {
	recs := c.recs.take()
	if c.agent != nil {
		defer c.agent.Close()
		for len(recs) > 0 {
			n, size := 0, 0
			for n < len(recs) && size+len(recs[n]) < wire.MaxMessage/2 {
				size += len(recs[n]) + 1
				n++
			}
			n = max(n, 1) // a single oversized record fails to send and goes to the file
			if err := c.agent.Send(&wire.Message{Kind: wire.KindLog, Logs: recs[:n]}, nil); err != nil {
				break
			}
			recs = recs[n:]
		}
	}
	writeLogFile(c.conf.RunDir, recs)
}

// passThrough says why this call needs nothing from nftcni, or "".
func (c *call) passThrough() string {
	ns, name := string(c.k8s.K8S_POD_NAMESPACE), string(c.k8s.K8S_POD_NAME)
	switch {
	case ns == "" || name == "":
		return "not a Kubernetes pod (no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS)"
	case slices.Contains(c.conf.ExcludeNamespaces, ns):
		return "namespace " + ns + " is excluded"
	case c.conf.PodNamespace != "" && ns == c.conf.PodNamespace && strings.HasPrefix(name, AgentPodPrefix):
		return "the nftcni agent's own pod"
	case c.args.Netns != "" && sameNetns(c.args.Netns, "/proc/self/ns/net"):
		return "host network"
	}
	return ""
}

// sameNetns says whether two netns paths name the same namespace.
func sameNetns(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

func (c *call) pod(prev *current.Result) *wire.Pod {
	return &wire.Pod{
		Namespace:   string(c.k8s.K8S_POD_NAMESPACE),
		Name:        string(c.k8s.K8S_POD_NAME),
		UID:         string(c.k8s.K8S_POD_UID),
		Attachment:  wire.Attachment{ContainerID: c.args.ContainerID, IfName: c.args.IfName},
		IPs:         podIPs(prev, c.args.IfName),
		Netns:       c.args.Netns,
		Annotations: c.conf.RuntimeConfig.PodAnnotations,
	}
}

// result prints prevResult unchanged, in the config's cniVersion.
func (c *call) result(prev *current.Result) error {
	return types.PrintResult(prev, c.conf.CNIVersion)
}

// dial connects to the agent; the connection is bounded by p.Timeout.
func (c *call) dial() error {
	conn, err := wire.Dial(c.conf.SocketPath(), c.p.DialTimeout)
	if err != nil {
		return err
	}
	if err := conn.SetDeadline(time.Now().Add(c.p.Timeout)); err != nil {
		conn.Close()
		return err
	}
	c.agent = conn
	return nil
}

// ask sends m (with fd when not nil) and returns the agent's reply, which
// must be of kind want; an error reply becomes an error.
func (c *call) ask(m *wire.Message, fd *os.File, want wire.Kind) (*wire.Message, error) {
	if c.agent == nil {
		if err := c.dial(); err != nil {
			return nil, err
		}
	}
	if err := c.agent.Send(m, fd); err != nil {
		return nil, err
	}
	r, rfd, err := c.agent.Recv()
	if rfd != nil {
		rfd.Close()
	}
	switch {
	case err != nil:
		return nil, fmt.Errorf("waiting for the agent's answer to %s: %w", m.Kind, err)
	case r.Kind == wire.KindError:
		return nil, &agentError{msg: r.Error}
	case r.Kind != want:
		return nil, fmt.Errorf("agent answered %s with %s, want %s", m.Kind, r.Kind, want)
	}
	return r, nil
}

// agentError is a refusal from a reachable agent, as opposed to not
// reaching it.
type agentError struct{ msg string }

func (e *agentError) Error() string { return "agent: " + e.msg }

// Add handles CNI ADD.
func (p *Plugin) Add(args *skel.CmdArgs) (err error) {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	defer func() {
		if err != nil {
			c.log.Error("ADD failed", "err", err)
		}
	}()
	prev, err := c.conf.prevResult()
	if err != nil {
		return err
	}
	if prev == nil {
		return errors.New("nftcni: no prevResult: nftcni is a chained plugin and must come after the primary CNI plugin in the conflist")
	}
	if why := c.passThrough(); why != "" {
		c.log.Debug("passing through", "reason", why)
		return c.result(prev)
	}
	pod := c.pod(prev)
	netns, err := os.Open(args.Netns)
	if err != nil {
		return fmt.Errorf("nftcni: opening the pod's netns: %w", err)
	}
	defer netns.Close()

	if d := wire.SidecarFromAnnotations(pod.Annotations, wire.HasIPv6(pod.IPs)); d != nil {
		// Everything a sidecar ruleset needs came with the runtime's call.
		if d.Mode == wire.ModeNone {
			c.log.Debug("passing through", "reason", d.Reason)
			return c.result(prev)
		}
		if err := program(netns, d); err != nil {
			return fmt.Errorf("nftcni: pod %s: %w", pod.Key(), err)
		}
		c.log.Info("sidecar capture programmed", "source", "runtime annotations", "reason", d.Reason)
		return c.result(prev)
	}

	r, err := c.ask(&wire.Message{Kind: wire.KindAdd, Pod: pod}, netns, wire.KindDecision)
	if err != nil {
		var refused *agentError
		if errors.As(err, &refused) {
			return fmt.Errorf("nftcni: pod %s: %w", pod.Key(), err)
		}
		return c.agentDown(pod, err, prev)
	}
	d := r.Decision
	if d.Mode == wire.ModeNone {
		c.log.Debug("not enrolled", "reason", d.Reason, "ms", c.since())
		return c.result(prev)
	}
	decided := c.since()
	perr := program(netns, d)
	programmed := c.since()
	out := &wire.Message{Kind: wire.KindOutcome}
	if perr != nil {
		out.Error = perr.Error()
	}
	if _, err := c.ask(out, nil, wire.KindDone); err != nil && perr == nil {
		// Not enrolled after all (ztunnel refused it, say): leave no rules
		// that send the pod's traffic where nothing takes it.
		if derr := nft.Delete(int(netns.Fd()), nft.PodCleanup()); derr != nil {
			c.log.Warn("removing the rules of a failed enrolment", "err", derr)
		}
		return fmt.Errorf("nftcni: pod %s: enrolment failed after the rules were programmed (removed again): %w", pod.Key(), err)
	}
	if perr != nil {
		return fmt.Errorf("nftcni: pod %s: programming the %s ruleset: %w", pod.Key(), d.Mode, perr)
	}
	c.log.Info("pod enrolled", "mode", d.Mode, "reason", d.Reason,
		"ms", c.since(), "decided_ms", decided, "programmed_ms", programmed)
	return c.result(prev)
}

// program applies the decision's ruleset in the pod's netns.
func program(netns *os.File, d *wire.Decision) error {
	rs, err := d.Ruleset()
	if err != nil || rs == nil {
		return err
	}
	return nft.Apply(int(netns.Fd()), rs)
}

// wouldEnrol answers from the agent's policy snapshot whether the agent
// would enrol pod. No snapshot means no agent ever ran with this run dir,
// so nothing is enrolled.
func (c *call) wouldEnrol(pod *wire.Pod) (bool, string, error) {
	pol, err := wire.ReadPolicy(c.conf.PolicyPath())
	if errors.Is(err, os.ErrNotExist) {
		return false, "no policy snapshot at " + c.conf.PolicyPath(), nil
	}
	if err != nil {
		return false, "", err
	}
	enrol, why := pol.Fallback(pod.Namespace, pod.Key())
	return enrol, why, nil
}

// agentDown applies the failure policy when the agent could not be asked.
func (c *call) agentDown(pod *wire.Pod, cause error, prev *current.Result) error {
	sock := c.conf.SocketPath()
	enrol, why, err := c.wouldEnrol(pod)
	if err != nil {
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("nftcni: pod %s: the nftcni agent at %s cannot be reached (%v) and its policy snapshot is unreadable (%v)", pod.Key(), sock, cause, err), "")
	}
	if !enrol {
		c.log.Warn("agent unreachable; the policy snapshot does not enrol this pod, letting it through", "socket", sock, "reason", why, "err", cause)
		return c.result(prev)
	}
	return types.NewError(types.ErrTryAgainLater,
		fmt.Sprintf("nftcni: pod %s must be enrolled in the mesh (%s) but the nftcni agent at %s cannot be reached: %v; the pod will not start un-captured and the runtime will retry: check the nftcni-node pod on this node",
			pod.Key(), why, sock, cause), "")
}

// Del handles CNI DEL: remove our table and routes if the netns still
// exists, tell the agent, and succeed whatever is already gone.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	c, err := p.start(args)
	if err != nil {
		// A config we cannot read never had rules programmed by us;
		// failing DEL would only leave the pod stuck in deletion.
		fmt.Fprintln(os.Stderr, "nftcni: DEL ignoring unreadable config:", err)
		return nil
	}
	defer c.finish()
	if why := c.passThrough(); why != "" {
		c.log.Debug("passing through", "reason", why)
		return nil
	}
	if netns, err := os.Open(args.Netns); err == nil {
		if err := nft.Delete(int(netns.Fd()), nft.PodCleanup()); err != nil {
			c.log.Warn("could not remove the pod's rules; they go with the netns", "err", err)
		}
		netns.Close()
	} else if args.Netns != "" && !errors.Is(err, os.ErrNotExist) {
		c.log.Warn("could not open the pod's netns", "netns", args.Netns, "err", err)
	}
	pod := c.pod(nil)
	if _, err := c.ask(&wire.Message{Kind: wire.KindDel, Pod: pod}, nil, wire.KindDone); err != nil {
		c.log.Warn("could not tell the agent about DEL; it reconciles on its own", "err", err)
	}
	return nil
}

// Check handles CNI CHECK: the pod's ruleset must be present and intact.
func (p *Plugin) Check(args *skel.CmdArgs) (err error) {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	prev, err := c.conf.prevResult()
	if err != nil {
		return err
	}
	if prev == nil {
		return errors.New("nftcni: CHECK needs prevResult")
	}
	if why := c.passThrough(); why != "" {
		return nil
	}
	pod := c.pod(prev)
	d := wire.SidecarFromAnnotations(pod.Annotations, wire.HasIPv6(pod.IPs))
	if d == nil {
		r, err := c.ask(&wire.Message{Kind: wire.KindCheck, Pod: pod}, nil, wire.KindDecision)
		var refused *agentError
		switch {
		case errors.As(err, &refused):
			return fmt.Errorf("nftcni: pod %s: %w", pod.Key(), err)
		case err != nil:
			// Only a pod that should have rules needs the agent to check them.
			if enrol, _, perr := c.wouldEnrol(pod); perr == nil && !enrol {
				return nil
			}
			return types.NewError(types.ErrTryAgainLater, fmt.Sprintf("nftcni: pod %s: cannot verify its ruleset without the agent at %s: %v", pod.Key(), c.conf.SocketPath(), err), "")
		}
		d = r.Decision
	}
	rs, err := d.Ruleset()
	if err != nil || rs == nil {
		return err
	}
	netns, err := os.Open(args.Netns)
	if err != nil {
		return fmt.Errorf("nftcni: opening the pod's netns: %w", err)
	}
	defer netns.Close()
	if err := nft.Verify(int(netns.Fd()), rs); err != nil {
		return fmt.Errorf("nftcni: pod %s: %s ruleset: %w", pod.Key(), d.Mode, err)
	}
	return nil
}

// Status handles CNI STATUS: is the agent there to serve ADDs? It fails
// only when the entry opts in, because containerd turns a failing STATUS
// into NetworkReady=false for the whole node.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	_, err = c.ask(&wire.Message{Kind: wire.KindStatus}, nil, wire.KindDone)
	if err == nil {
		return nil
	}
	if !c.conf.StatusRequiresAgent {
		c.log.Debug("agent not ready; STATUS still succeeds (status_requires_agent is false)", "err", err)
		return nil
	}
	return types.NewError(types.ErrPluginNotAvailable, fmt.Sprintf("nftcni agent at %s is not ready: %v", c.conf.SocketPath(), err), "")
}

// GC handles CNI GC: the agent releases what it holds for attachments the
// runtime no longer has.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	valid := make([]wire.Attachment, 0, len(c.conf.ValidAttachments))
	for _, a := range c.conf.ValidAttachments {
		valid = append(valid, wire.Attachment{ContainerID: a.ContainerID, IfName: a.IfName})
	}
	if _, err := c.ask(&wire.Message{Kind: wire.KindGC, Valid: valid}, nil, wire.KindDone); err != nil {
		c.log.Warn("GC: agent unreachable; it releases stale attachments itself when it returns", "err", err)
	}
	return nil
}
