// Package plugin is the nftcni chained CNI plugin: every verb of CNI 1.1.
//
// ADD hands the agent the pod's identity and its netns fd and gets back
// the decision with the pod's ruleset already encoded for the kernel and
// the netlink sockets, made by the agent in the pod's netns, to write it
// on; it writes that batch (one send, one ack; the policy routes likewise)
// while the agent hands the netns to ztunnel and records the pod, reads
// the agent's done and sends its outcome, with its logs, last; the agent
// marks the pod enrolled only once both sides are done. The plugin never
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
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/nft/nlsend"
	"github.com/nftcni/nftcni/plugin/wire"
)

// Plugin runs the CNI verbs.
type Plugin struct {
	// DialTimeout bounds connecting to the agent's socket.
	DialTimeout time.Duration
	// Timeout bounds the whole conversation with the agent in one call,
	// including its wait for ztunnel.
	Timeout time.Duration
	// Kernel writes and removes pod rulesets (New: through netlink).
	Kernel Kernel
	// AgentWait is how long, from its start, an ADD of a pod that must
	// wait for the agent (one to enrol, a sidecar pod, no snapshot) waits
	// for the agent's socket to answer before it fails; 0: it fails at
	// once. The entry's agent_wait_seconds overrides it.
	AgentWait time.Duration
}

// agentPoll is how often an ADD waiting for the agent tries its socket.
const agentPoll = 200 * time.Millisecond

// ztunnelPoll is how often an ADD the agent told to ask again (no ztunnel
// connected yet) asks: each is a conversation with the agent, which is
// busy starting every pod of a rebooted node meanwhile.
const ztunnelPoll = 500 * time.Millisecond

// Kernel is what the plugin asks of nf_tables in a pod's netns: the
// agent's batch programmed, or (the agent away) the snapshot's removal.
// The plugin does not link package nft: a fresh process pays for every
// package it initialises.
type Kernel interface {
	// Program writes b into the netns behind netns, on socks (the
	// agent's, made in that netns) when there are any.
	Program(netns int, b *nlsend.Batch, socks []int) error
	Remove(netns int, r *nlsend.Removal) error
}

// New returns a Plugin with the production timeouts, on the kernel.
func New() *Plugin {
	return &Plugin{DialTimeout: time.Second, Timeout: wire.PluginTimeout, Kernel: netlinkKernel{}, AgentWait: wire.DefaultAgentWait}
}

// call is one invocation: its config, its log buffer, its agent connection.
type call struct {
	p     *Plugin
	conf  *Config
	args  *Args
	k8s   *K8sArgs
	recs  records
	agent *wire.Conn
	began time.Time
}

// log records one message at lvl, with the call's identity, when the
// entry's plugin_log_level lets it through. A successful ADD logs nothing
// at the default level (its timings ride its outcome).
func (c *call) log(lvl level, msg string, args ...any) {
	if lvl < c.conf.level {
		return
	}
	pod := ""
	if c.k8s != nil && c.k8s.K8S_POD_NAMESPACE != "" {
		pod = c.k8s.K8S_POD_NAMESPACE + "/" + c.k8s.K8S_POD_NAME
	}
	c.recs.add(time.Now(), lvl, msg, c.args.ContainerID, pod, args)
}

func (c *call) debug(msg string, args ...any) { c.log(levelDebug, msg, args...) }
func (c *call) warn(msg string, args ...any)  { c.log(levelWarn, msg, args...) }

// since is the time from the call's start, in ms, for log records.
func (c *call) since() float64 { return float64(time.Since(c.began).Microseconds()) / 1000 }

func (p *Plugin) start(args *Args) (*call, error) {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return nil, newError(ErrInvalidNetworkConfig, "nftcni: "+err.Error(), "")
	}
	c := &call{p: p, conf: conf, args: args, began: time.Now()}
	if c.k8s, err = parseK8sArgs(args.Args); err != nil {
		c.finish()
		return nil, newError(ErrInvalidEnvironmentVariables, "nftcni: "+err.Error(), "")
	}
	return c, nil
}

// finish ships the log records the conversation did not carry (one-way:
// the agent does not answer) and closes the agent connection; with no
// agent they go to the run dir's log file.
func (c *call) finish() {
	recs := c.recs.take()
	if c.agent != nil {
		defer c.agent.Close()
		recs = c.sendLogs(recs)
	}
	writeLogFile(c.conf.RunDir, recs)
}

// sendLogs sends recs in log messages that fit, and returns what did not go.
func (c *call) sendLogs(recs []json.RawMessage) []json.RawMessage {
	for len(recs) > 0 {
		n := fitLogs(recs)
		if err := c.agent.Send(&wire.Message{Kind: wire.KindLog, Logs: recs[:n]}, nil); err != nil {
			return recs
		}
		recs = recs[n:]
	}
	return nil
}

// fitLogs is how many of recs fit in one message (at least one: a single
// oversized record fails to send and goes to the file).
func fitLogs(recs []json.RawMessage) int {
	n, size := 0, 0
	for n < len(recs) && size+len(recs[n]) < wire.MaxMessage/2 {
		size += len(recs[n]) + 1
		n++
	}
	return max(n, 1)
}

// passThrough says why this call needs nothing from nftcni, or "".
func (c *call) passThrough() string {
	if why := c.excluded(); why != "" {
		return why
	}
	return c.hostNetwork()
}

// excluded is passThrough as far as the call's arguments and config tell.
func (c *call) excluded() string {
	ns, name := c.k8s.K8S_POD_NAMESPACE, c.k8s.K8S_POD_NAME
	switch {
	case ns == "" || name == "":
		return "not a Kubernetes pod (no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS)"
	case slices.Contains(c.conf.ExcludeNamespaces, ns):
		return "namespace " + ns + " is excluded"
	case c.conf.PodNamespace != "" && ns == c.conf.PodNamespace && strings.HasPrefix(name, AgentPodPrefix):
		return "the nftcni agent's own pod"
	}
	return ""
}

// hostNetwork says "host network" when the sandbox is in the node's own
// netns (two stats: ADD asks it after connecting to the agent).
func (c *call) hostNetwork() string {
	if c.args.Netns != "" && sameNetns(c.args.Netns, "/proc/self/ns/net") {
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

func (c *call) pod(prev *result) *wire.Pod {
	return &wire.Pod{
		Namespace:  c.k8s.K8S_POD_NAMESPACE,
		Name:       c.k8s.K8S_POD_NAME,
		UID:        c.k8s.K8S_POD_UID,
		Attachment: wire.Attachment{ContainerID: c.args.ContainerID, IfName: c.args.IfName},
		IPs:        podIPs(prev, c.args.IfName),
		Netns:      c.args.Netns,
	}
}

// printPrev writes prevResult back as it came: it is already in the
// config's cniVersion. Without one (standalone), the result is empty, as
// istio-cni's is there: an extra network that adds no interface.
func (c *call) printPrev(w io.Writer) error {
	if c.conf.PrevResult == nil {
		_, err := fmt.Fprintf(w, "{\"cniVersion\":%q}\n", c.conf.CNIVersion)
		return err
	}
	_, err := w.Write(append(slices.Clip(c.conf.PrevResult), '\n'))
	return err
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

// ask sends m (with the descriptors in fds) and returns the agent's reply,
// which must be of kind want, with the descriptors that came with it (only
// a decision to enrol carries any: the pod's netlink sockets); an error
// reply becomes an error.
func (c *call) ask(m *wire.Message, fds []int, want wire.Kind) (*wire.Message, []int, error) {
	if c.agent == nil {
		if err := c.dial(); err != nil {
			return nil, nil, err
		}
	}
	m.Deadline = c.agent.Deadline()
	if err := c.agent.SendWith(m, fds); err != nil {
		return nil, nil, err
	}
	return c.answer(m.Kind, want)
}

// answer reads the agent's answer to the plugin's last message, of kind,
// which must be of kind want.
func (c *call) answer(kind, want wire.Kind) (*wire.Message, []int, error) {
	rb, fds, err := c.agent.RecvBytes()
	var r *wire.Message
	if err == nil {
		r, err = wire.Decode(rb)
	}
	switch {
	case err != nil:
		err = fmt.Errorf("waiting for the agent's answer to %s: %w", kind, err)
	case r.Kind == wire.KindError:
		err = &agentError{msg: r.Error, retry: r.Retry}
	case r.Kind != want:
		err = fmt.Errorf("agent answered %s with %s, want %s", kind, r.Kind, want)
	case len(fds) > 0 && (r.Kind != wire.KindDecision || r.Decision.Mode == wire.ModeNone):
		err = fmt.Errorf("agent's %s came with %d descriptors, none expected", r.Kind, len(fds))
	}
	if err != nil {
		wire.CloseAll(fds)
		return nil, nil, err
	}
	return r, fds, nil
}

// agentError is a refusal from a reachable agent, as opposed to not
// reaching it; retry: for now, ask again (wire.Message.Retry).
type agentError struct {
	msg   string
	retry bool
}

func (e *agentError) Error() string { return "agent: " + e.msg }

// Add handles CNI ADD.
func (p *Plugin) Add(args *Args, stdout io.Writer) (err error) {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	defer func() {
		if err != nil {
			c.log(levelError, "ADD failed", "err", err)
		}
	}()
	// Without prevResult nftcni is a network of its own (standalone mode,
	// Multus's extra network): the agent takes the pod's addresses from
	// its netns, and the result has nothing to add.
	prev := c.conf.prevResult()
	if why := c.excluded(); why != "" {
		c.debug("passing through", "reason", why)
		return c.printPrev(stdout)
	}
	// Connect before the rest of the add is put together: the agent, idle
	// until now, takes longer to wake up for the connection (about 0.15 ms
	// here) than the add takes to write, so its first wake-up overlaps this
	// process's work instead of following it. An error is the add's answer
	// (below), where the failure policy applies.
	dialErr := c.dial()
	if why := c.hostNetwork(); why != "" {
		c.debug("passing through", "reason", why)
		return c.printPrev(stdout)
	}
	pod := c.pod(prev)
	netns, err := openNetns(args.Netns)
	if err != nil {
		return fmt.Errorf("nftcni: opening the pod's netns: %w", err)
	}
	defer unix.Close(netns)

	// A pod whose annotations say it captures its own traffic (istio-init)
	// needs nothing. A sidecar pod's ruleset is the agent's decision like
	// any other's: it exempts the proxy's UID and GID, which only the pod
	// spec says (runAsUser; OpenShift assigns one that is not 1337).
	if inj, why := wire.SidecarInjection(c.conf.PodAnnotations); inj == wire.CapturesItself || inj == wire.NoProxy {
		c.debug("passing through", "reason", why)
		return c.printPrev(stdout)
	}

	var r *wire.Message
	var socks []int
	add := func() error {
		r, socks, err = c.ask(&wire.Message{Kind: wire.KindAdd, Pod: pod}, []int{netns}, wire.KindDecision)
		return err
	}
	if err = dialErr; err == nil {
		err = add()
	}
	if err != nil && !refusal(err) {
		// The agent cannot be reached: the failure policy says whether
		// the pod may start without it; if not, the ADD waits for it.
		down := c.agentDown(pod, err, stdout)
		if down == nil {
			return nil
		}
		if !c.awaitAgent() {
			var e *Error
			if errors.As(down, &e) && c.agentWait() > 0 {
				e.Details = fmt.Sprintf("the ADD waited %.1f s for the agent", c.since()/1000)
			}
			return down
		}
		c.debug("the agent is back", "ms", c.since())
		if err = add(); err != nil && !refusal(err) {
			return c.agentDown(pod, err, stdout)
		}
	}
	for c.askAgain(err) {
		if err = add(); err != nil && !refusal(err) {
			return c.agentDown(pod, err, stdout)
		}
	}
	defer wire.CloseAll(socks)
	if forNow(err) {
		return newError(ErrTryAgainLater, fmt.Sprintf("nftcni: pod %s: %v", pod.Key(), err),
			fmt.Sprintf("the ADD asked the agent for %.1f s", c.since()/1000))
	}
	if err != nil {
		// A refusal, or a failure of this side: never "the agent cannot
		// be reached".
		return fmt.Errorf("nftcni: pod %s: %w", pod.Key(), err)
	}
	if r.Decision.Mode == wire.ModeNone {
		c.debug("not enrolled", "reason", r.Decision.Reason, "ms", c.since())
		return c.printPrev(stdout)
	}
	return c.programAndReport(pod, netns, r, socks, stdout)
}

// programAndReport programs the agent's decision into the pod's netns,
// reads the agent's answer and sends it the outcome, its last message.
func (c *call) programAndReport(pod *wire.Pod, netns int, r *wire.Message, socks []int, stdout io.Writer) error {
	t := &wire.Timings{Decided: c.since()}
	mode := r.Decision.Mode
	var perr error
	if !r.Decision.Programmed { // else the agent wrote it itself (too large for a message)
		perr = c.p.Kernel.Program(netns, r.Batch, socks)
	}
	t.Programmed = c.since()
	errText := ""
	if perr != nil {
		errText = perr.Error()
	} else {
		c.debug("ruleset programmed", "mode", mode, "decided_ms", t.Decided, "programmed_ms", t.Programmed)
	}
	// The agent's last answer: done once ztunnel has the netns and the
	// probe set entry and record are in place, or why not. The agent
	// gives it without waiting for the outcome, so it is usually here
	// already.
	_, _, aerr := c.answer(wire.KindDecision, wire.KindDone)
	// The outcome, with the call's logs and timings, is the plugin's last
	// message: with a failure on either side the agent undoes the
	// enrolment and says when it has (ConfirmsUndo); the error waits for
	// that, so that nothing of the enrolment is left when it returns.
	// Success waits for nothing more.
	serr := c.agent.SendWith(&wire.Message{Kind: wire.KindOutcome, Error: errText, Logs: c.recs.take(), Timings: t}, nil)
	var refused *agentError
	answered := aerr == nil || errors.As(aerr, &refused) // else the agent is gone or hung: nothing to wait for
	var uerr error                                       // the undo not confirmed
	if (perr != nil || aerr != nil) && answered && serr == nil && r.Decision.ConfirmsUndo {
		_, _, uerr = c.answer(wire.KindOutcome, wire.KindDone)
	}
	switch {
	case perr != nil && uerr != nil:
		return fmt.Errorf("nftcni: pod %s: programming the %s ruleset: %w (and the agent did not confirm its undo: %v)", pod.Key(), mode, perr, uerr)
	case perr != nil:
		return fmt.Errorf("nftcni: pod %s: programming the %s ruleset: %w", pod.Key(), mode, perr)
	case aerr != nil && uerr != nil:
		return fmt.Errorf("nftcni: pod %s: enrolment failed after the rules were programmed: %w (the agent did not confirm their removal: %v)", pod.Key(), aerr, uerr)
	case aerr != nil:
		return fmt.Errorf("nftcni: pod %s: enrolment failed after the rules were programmed (removed again): %w", pod.Key(), aerr)
	case serr != nil:
		return fmt.Errorf("nftcni: pod %s: the agent did not get the outcome (it undoes the enrolment): %w", pod.Key(), serr)
	}
	return c.printPrev(stdout)
}

// netlinkKernel is Kernel through nlsend.
type netlinkKernel struct{}

func (netlinkKernel) Remove(netns int, r *nlsend.Removal) error { return nlsend.Remove(netns, r) }

// Program writes the batch into the pod's netns: on the netlink sockets
// the agent made there and handed over with the decision, once they are
// known to be in that netns; on sockets of its own when the agent sent
// none (an older agent). A process that enters a netns itself pays, on
// its first time, for the thread Go keeps for locked threads, the
// netns switches and the sockets; the agent has all of that warm.
func (netlinkKernel) Program(netns int, b *nlsend.Batch, socks []int) error {
	if len(socks) == 0 {
		return nlsend.Program(netns, b)
	}
	if err := nlsend.CheckSockets(netns, socks, nlsend.Protos(b)); err != nil {
		return fmt.Errorf("the agent's netlink sockets: %w", err)
	}
	return nlsend.ProgramOn(socks, b)
}

// errNoSnapshot: no agent has written a policy snapshot where the entry
// says (in the run dir, on /run, a tmpfs, after every boot; on persistent
// storage, before the first agent ever ran): our entry is in the conflist
// (someone installed us) but nothing says which pods are meshed, and
// letting them through would start them un-captured.
var errNoSnapshot = errors.New("no policy snapshot: no nftcni agent has written one")

// wouldEnrol answers from the agent's policy snapshot whether the agent
// would enrol pod.
func (c *call) wouldEnrol(pod *wire.Pod) (bool, string, error) {
	pol, err := wire.ReadPolicy(c.conf.PolicyPath())
	if errors.Is(err, os.ErrNotExist) {
		return false, "", fmt.Errorf("%w (%s)", errNoSnapshot, c.conf.PolicyPath())
	}
	if err != nil {
		return false, "", err
	}
	enrol, why := pol.Fallback(pod.Namespace, pod.Key())
	if pol.Stale() {
		// Written before this boot (the agent is not back yet): it still
		// tells pods outside the mesh from those in it, and never enrols
		// one; a pod it misjudges is enrolled late when the agent is back.
		why += fmt.Sprintf(" (policy snapshot of an earlier boot, written %s)", pol.Generated.Format(time.RFC3339))
	}
	return enrol, why, nil
}

// refusal: the agent answered with a refusal, or this side failed (a
// message too large); not an agent that cannot be reached.
func refusal(err error) bool {
	var refused *agentError
	return errors.As(err, &refused) || errors.Is(err, wire.ErrTooLarge)
}

// forNow: the agent refused for now (no ztunnel connected yet) and told
// the plugin to ask again (wire.Message.Retry).
func forNow(err error) bool {
	var refused *agentError
	return errors.As(err, &refused) && refused.retry
}

// agentWait is how long this ADD may wait for the agent: the entry's
// agent_wait_seconds, else the plugin's default.
func (c *call) agentWait() time.Duration {
	if c.conf.AgentWaitSet {
		return c.conf.AgentWait
	}
	return c.p.AgentWait
}

// awaitAgent waits, until agentWait after the call's start, for the
// agent's socket to take a connection.
func (c *call) awaitAgent() bool {
	if c.agent != nil { // it went away mid-conversation
		c.agent.Close()
		c.agent = nil
	}
	for deadline := c.began.Add(c.agentWait()); time.Now().Add(agentPoll).Before(deadline); {
		time.Sleep(agentPoll)
		if c.dial() == nil {
			return true
		}
	}
	return false
}

// askAgain says whether the ADD asks the agent again after err: a refusal
// for now (no ztunnel connected yet), with time left in the ADD's wait
// for the agent; it waits ztunnelPoll first.
func (c *call) askAgain(err error) bool {
	if !forNow(err) || !time.Now().Add(ztunnelPoll).Before(c.began.Add(c.agentWait())) {
		return false
	}
	if c.agent != nil { // the agent ends the conversation with its refusal
		c.agent.Close()
		c.agent = nil
	}
	time.Sleep(ztunnelPoll)
	return true
}

// agentDown applies the failure policy when the agent could not be asked.
func (c *call) agentDown(pod *wire.Pod, cause error, stdout io.Writer) error {
	sock := c.conf.SocketPath()
	if inj, why := wire.SidecarInjection(c.conf.PodAnnotations); inj == wire.Sidecar {
		return newError(ErrTryAgainLater,
			fmt.Sprintf("nftcni: pod %s has an Istio sidecar (%s): its ruleset must exempt the proxy's UID and GID, which only the pod spec says "+
				"and only the agent reads, and the nftcni agent at %s cannot be reached: %v; the pod will not start with a guessed UID, and the runtime will retry",
				pod.Key(), why, sock, cause), "")
	}
	enrol, why, err := c.wouldEnrol(pod)
	if errors.Is(err, errNoSnapshot) {
		return newError(ErrTryAgainLater,
			fmt.Sprintf("nftcni: pod %s: the nftcni agent at %s cannot be reached (%v) and %v; the pod waits for the agent rather than start outside the mesh, and the runtime will retry",
				pod.Key(), sock, cause, err), "")
	}
	if err != nil {
		return newError(ErrTryAgainLater,
			fmt.Sprintf("nftcni: pod %s: the nftcni agent at %s cannot be reached (%v) and its policy snapshot is unreadable (%v)", pod.Key(), sock, cause, err), "")
	}
	if !enrol {
		c.warn("agent unreachable; the policy snapshot does not enrol this pod, letting it through", "socket", sock, "reason", why, "err", cause)
		return c.printPrev(stdout)
	}
	return newError(ErrTryAgainLater,
		fmt.Sprintf("nftcni: pod %s must be enrolled in the mesh (%s) but the nftcni agent at %s cannot be reached: %v; the pod will not start un-captured and the runtime will retry: check the nftcni-node pod on this node",
			pod.Key(), why, sock, cause), "")
}

// Del handles CNI DEL: the agent removes our table and routes through the
// netns, handed over while it exists, and releases the pod; without the
// agent the plugin removes them itself. It succeeds whatever is already
// gone.
func (p *Plugin) Del(args *Args) error {
	c, err := p.start(args)
	if err != nil {
		// A config we cannot read never had rules programmed by us;
		// failing DEL would only leave the pod stuck in deletion.
		fmt.Fprintln(os.Stderr, "nftcni: DEL ignoring unreadable config:", err)
		return nil
	}
	defer c.finish()
	if why := c.passThrough(); why != "" {
		c.debug("passing through", "reason", why)
		return nil
	}
	var fds []int
	if netns, err := openNetns(args.Netns); err == nil {
		fds = []int{netns}
		defer unix.Close(netns)
	} else if args.Netns != "" && !errors.Is(err, os.ErrNotExist) {
		c.warn("could not open the pod's netns", "netns", args.Netns, "err", err)
	}
	m := &wire.Message{Kind: wire.KindDel, Pod: c.pod(nil), Logs: c.recs.take()}
	if _, _, err := c.ask(m, fds, wire.KindDone); err != nil {
		c.warn("could not tell the agent about DEL; it releases the pod when it is back", "err", err)
		if len(fds) > 0 {
			c.removeRules(fds[0])
		}
		c.tombstone(m.Pod.Attachment)
	}
	return nil
}

// tombstone marks an attachment deleted in the agent's records dir, so that
// a restarted agent releases it instead of restoring it (ztunnel would get
// the deleted sandbox again, and a verification pass would put back the
// rules this DEL removed). No records dir: the agent has recorded nothing.
func (c *call) tombstone(a wire.Attachment) {
	p := wire.TombstonePath(c.conf.RunDir, a)
	fd, err := unix.Open(p, unix.O_WRONLY|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) {
			c.warn("could not mark the DEL for the agent", "path", p, "err", err)
		}
		return
	}
	unix.Close(fd)
}

// removeRules takes whatever pod ruleset of ours the netns holds away,
// with the removal the agent encoded into its policy snapshot (the agent
// writes the snapshot before it installs this binary). Without a snapshot
// no agent has run since boot, so this plugin, which programs only what an
// agent encoded, has put nothing there.
func (c *call) removeRules(netns int) {
	pol, err := wire.ReadPolicy(c.conf.PolicyPath())
	switch {
	case errors.Is(err, os.ErrNotExist):
		return
	case err != nil:
		c.warn("could not remove the pod's rules; they go with the netns", "err", err)
		return
	case pol.Cleanup == nil:
		c.warn("the agent's policy snapshot has no cleanup batch (written by an older agent?); the agent removes the rules, or they go with the netns")
		return
	}
	if err := c.p.Kernel.Remove(netns, pol.Cleanup); err != nil {
		c.warn("could not remove the pod's rules; they go with the netns", "err", err)
	}
}

// Check handles CNI CHECK: the pod's ruleset must be present and intact.
// The agent checks it through the netns fd it is handed; a sidecar pod the
// plugin programmed from runtime annotations is checked here when the
// agent is away.
func (p *Plugin) Check(args *Args) (err error) {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	prev := c.conf.prevResult() // nil in standalone mode: the agent knows the pod's addresses
	if why := c.passThrough(); why != "" {
		return nil
	}
	pod := c.pod(prev)
	netns, err := openNetns(args.Netns)
	if err != nil {
		return fmt.Errorf("nftcni: opening the pod's netns: %w", err)
	}
	defer unix.Close(netns)
	_, _, err = c.ask(&wire.Message{Kind: wire.KindCheck, Pod: pod}, []int{netns}, wire.KindDone)
	var refused *agentError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &refused):
		return fmt.Errorf("nftcni: pod %s: %w", pod.Key(), err)
	}
	// Only a pod that should have rules needs the agent to check them (a
	// sidecar pod's depend on its spec, which the agent has).
	inj, _ := wire.SidecarInjection(c.conf.PodAnnotations)
	if inj == wire.CapturesItself || inj == wire.NoProxy {
		return nil
	}
	if enrol, _, perr := c.wouldEnrol(pod); inj != wire.Sidecar && perr == nil && !enrol {
		return nil
	}
	return newError(ErrTryAgainLater, fmt.Sprintf("nftcni: pod %s: cannot verify its ruleset without the agent at %s: %v", pod.Key(), c.conf.SocketPath(), err), "")
}

// Status handles CNI STATUS: is the agent there to serve ADDs? It fails
// only when the entry opts in, because containerd turns a failing STATUS
// into NetworkReady=false for the whole node.
func (p *Plugin) Status(args *Args) error {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	_, _, err = c.ask(&wire.Message{Kind: wire.KindStatus}, nil, wire.KindDone)
	if err == nil {
		return nil
	}
	if !c.conf.StatusRequiresAgent {
		c.debug("agent not ready; STATUS still succeeds (status_requires_agent is false)", "err", err)
		return nil
	}
	return newError(ErrPluginNotAvailable, fmt.Sprintf("nftcni agent at %s is not ready: %v", c.conf.SocketPath(), err), "")
}

// GC handles CNI GC: the agent releases what it holds for attachments the
// runtime no longer has.
func (p *Plugin) GC(args *Args) error {
	c, err := p.start(args)
	if err != nil {
		return err
	}
	defer c.finish()
	valid := c.conf.ValidAttachments
	if valid == nil {
		valid = []wire.Attachment{}
	}
	if _, _, err := c.ask(&wire.Message{Kind: wire.KindGC, Valid: valid}, nil, wire.KindDone); err != nil {
		c.warn("GC: agent unreachable; it releases the attachments this GC does not list when it is back", "err", err)
		c.leaveGC(valid)
	}
	return nil
}

// leaveGC leaves the runtime's list of live attachments in the agent's
// records dir: a restarted agent releases every recorded one not in it.
func (c *call) leaveGC(valid []wire.Attachment) {
	dir := filepath.Join(c.conf.RunDir, wire.RecordsDir)
	if _, err := os.Stat(dir); err != nil {
		return // nothing recorded
	}
	b, err := json.Marshal(wire.GCList{Valid: valid})
	if err == nil {
		err = atomicWrite(filepath.Join(dir, wire.GCName), b)
	}
	if err != nil {
		c.warn("could not leave the GC's list for the agent", "err", err)
	}
}

// atomicWrite replaces path with b by a rename, never through a symlink.
func atomicWrite(path string, b []byte) error {
	tmp := path + ".tmp"
	fd, err := unix.Open(tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	_, err = unix.Write(fd, b)
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Rename(tmp, path)
	}
	return err
}

// openNetns opens a netns file as a plain descriptor, which the caller
// closes. Not an os.File: os.Open would set the Go netpoller up (an epoll
// instance, an eventfd, a registration the kernel refuses for a nsfs
// file), and even os.NewFile attaches a cleanup, whose first use starts
// the runtime's cleanup goroutine, in every plugin process for nothing.
func openNetns(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return fd, nil
}
