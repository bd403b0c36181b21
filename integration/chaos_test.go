package integration

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/agent/zds"
	"github.com/nftcni/nftcni/internal/faults"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/internal/ztunneltest"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// The fault-injection suite. Each scenario runs an agent process with the
// real plugin under libcni, a test ztunnel and a runtime stand-in that
// does what containerd does (a failed ADD is followed by its DEL, a pod
// is retried in a new sandbox), injects its fault, lets the node settle
// and then checks every sandbox it ever made against the invariant: a
// sandbox the runtime holds as started is enrolled in full — our table
// and policy route in its netns, ztunnel holding that netns, the agent's
// record, its address in the host probe set (ambient) — and any other is
// enrolled in no part. The agent's open descriptors stay bounded.
//
// make test runs one round of each scenario; make chaos runs
// NFTCNI_CHAOS_ROUNDS (default there: 5) and writes the table to
// NFTCNI_CHAOS_REPORT.

// chaosPods are the ambient pods each scenario starts.
const chaosPods = 10

// chaosSource is the pod source: the mesh's pods (and "late", which no
// storm starts), one of which carries
// 300 KiB of annotations (Kubernetes allows 256 KiB; the static source
// does not check), a plain namespace's pod, and a sidecar pod whose
// Istio annotation is invalid.
func chaosSource(t *testing.T) string {
	var b strings.Builder
	b.WriteString(meshNamespace + "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: plain}\n")
	for i := range chaosPods {
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p%d, namespace: mesh, uid: uid-p%d", i, i)
		if i == 0 {
			fmt.Fprintf(&b, ", annotations: {big: %q}", strings.Repeat("x", 300<<10))
		}
		b.WriteString("}\n")
	}
	b.WriteString("---\napiVersion: v1\nkind: Pod\nmetadata: {name: late, namespace: mesh, uid: uid-late}\n")
	b.WriteString("---\napiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: plain, uid: uid-web}\n")
	fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: bad, namespace: plain, uid: uid-bad, annotations: {%s: '%s', %s: '10.0.0.0/33'}}\nspec: {containers: [{name: app}, {name: istio-proxy, args: [proxy, sidecar]}]}\n",
		istio.AnnSidecarStatus, `{"containers":["istio-proxy"]}`, istio.AnnExcludeOutboundCIDRs)
	return podSourceDir(t, b.String())
}

// sandbox is one pod sandbox the runtime made.
type sandbox struct {
	pod, namespace string
	ns             *testnet.NS
	rt             *libcni.RuntimeConf
	ip             string
	started        bool // the runtime holds it as started: ADD succeeded, no DEL since
	ambient        bool
	// netnsGone: its netns path was removed before the DEL, as a runtime
	// does when the sandbox's processes are gone; the kernel then frees
	// the netns with its rules (the test's descriptor alone keeps it), so
	// nothing inside it is checked.
	netnsGone bool
}

// chaos is one scenario's node.
type chaos struct {
	t    *testing.T
	n    *agentNode
	list *libcni.NetworkConfigList
	src  string

	agent   *exec.Cmd
	exited  chan struct{}
	logs    *agentLog
	z       *ztunneltest.Ztunnel
	baseFDs int

	mu        sync.Mutex
	sandboxes []*sandbox
	delErrs   []string // a DEL must never fail
	refused   int      // ADDs that failed (and were DELed, then retried)
}

func newChaos(t *testing.T, subnet int) *chaos {
	c := &chaos{t: t, n: newAgentNode(t, subnet, nil), src: chaosSource(t)}
	c.start()
	c.list = c.n.installed(t)
	c.baseFDs = c.fds()
	return c
}

// start runs an agent (with the fault point env arms, if any) until ready
// and connects a new ztunnel to it.
func (c *chaos) start(env ...string) {
	c.t.Helper()
	c.n.h.env = env
	cmd, addr, logs := startAgent(c.t, c.n.h, "--pod-source", c.src, "--verify-interval", "200ms")
	c.n.h.env = nil
	c.agent, c.logs, c.exited = cmd, logs, make(chan struct{})
	go func(done chan struct{}) { _, _ = cmd.Process.Wait(); close(done) }(c.exited)
	c.t.Cleanup(func() {
		if c.t.Failed() {
			c.t.Logf("agent log:\n%s", logs)
		}
	})
	waitReady(c.t, addr)
	c.connect()
}

// connect connects a new test ztunnel, which has its snapshot on return.
func (c *chaos) connect() {
	c.t.Helper()
	c.z = ztunneltest.Connect(c.t, c.n.h.zsock)
	c.z.Wait(zds.KindSnapshotSent, "", 30*time.Second)
}

func (c *chaos) kill(sig syscall.Signal) {
	_ = c.agent.Process.Signal(sig)
	<-c.exited
}

// runtimeAdd makes a sandbox for pod and ADDs it, as the runtime does:
// a failed ADD is followed by its DEL.
func (c *chaos) runtimeAdd(namespace, pod string) (*sandbox, error) {
	s := &sandbox{pod: pod, namespace: namespace, ns: testnet.NewNS(c.t, "nftchaos"), ambient: namespace == meshNS}
	s.rt = runtimeConf(s.ns, namespace, pod, nil)
	c.mu.Lock()
	c.sandboxes = append(c.sandboxes, s)
	c.mu.Unlock()
	r, err := c.n.add(c.list, s.rt)
	if err != nil {
		c.mu.Lock()
		c.refused++
		c.mu.Unlock()
		c.runtimeDel(s)
		return s, err
	}
	if ips := podIPs(c.t, r); len(ips) > 0 {
		s.ip = ips[0].String()
	}
	c.mu.Lock()
	s.started = true
	c.mu.Unlock()
	return s, nil
}

// runtimeDel DELs a sandbox; a DEL never fails.
func (c *chaos) runtimeDel(s *sandbox) {
	c.mu.Lock()
	s.started = false
	c.mu.Unlock()
	if err := c.n.del(c.list, s.rt); err != nil {
		c.mu.Lock()
		c.delErrs = append(c.delErrs, fmt.Sprintf("DEL %s/%s: %v", s.namespace, s.pod, err))
		c.mu.Unlock()
	}
}

// removeNetns takes the sandbox's netns path away, as a runtime does
// before a late DEL (the test keeps its descriptor, so the checks still
// see inside).
func (s *sandbox) removeNetns(t *testing.T) {
	s.netnsGone = true
	if out, err := exec.Command("ip", "netns", "del", s.ns.Name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del: %v\n%s", err, out)
	}
}

// storm starts every mesh pod at once (4 workers), each retried in a new
// sandbox until it starts or until the deadline; it returns when all are
// started or the deadline passes.
func (c *chaos) storm(deadline time.Duration) {
	end := time.Now().Add(deadline)
	pods := make(chan string)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range pods {
				for time.Now().Before(end) {
					if _, err := c.runtimeAdd(meshNS, p); err == nil {
						break
					}
					time.Sleep(100 * time.Millisecond) // the runtime's back-off
				}
			}
		}()
	}
	for i := range chaosPods {
		pods <- "p" + strconv.Itoa(i)
	}
	close(pods)
	wg.Wait()
}

// started lists the sandboxes the runtime holds as started.
func (c *chaos) started() []*sandbox {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*sandbox
	for _, s := range c.sandboxes {
		if s.started {
			out = append(out, s)
		}
	}
	return out
}

// stopSome DELs every other started sandbox.
func (c *chaos) stopSome() {
	for i, s := range c.started() {
		if i%2 == 0 {
			c.runtimeDel(s)
		}
	}
}

// violations checks every sandbox once.
func (c *chaos) violations() []string {
	recs, _, err := records.Read(c.n.h.run)
	if err != nil {
		return []string{"reading the records: " + err.Error()}
	}
	recorded := map[string]bool{}
	for _, r := range recs {
		recorded[r.Pod.ContainerID] = true
	}
	probes := probeSet(c.t, c.n.h.netns)
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, s := range c.sandboxes {
		have := map[string]bool{"ztunnel": c.z.HoldsNetns("uid-"+s.pod, s.ns.FD), "record": recorded[s.rt.ContainerID]}
		if !s.netnsGone {
			have["table"], have["route"] = netnsState(s.ns.FD)
		}
		if s.started && s.ip != "" {
			have["probe"] = strings.Contains(probes, s.ip+" ")
		}
		var want []string // the parts this sandbox must have
		switch {
		case !s.started:
		case s.ambient:
			want = []string{"table", "route", "ztunnel", "record", "probe"}
		default: // a plain pod: recorded as known, nothing else
			want = []string{"record"}
		}
		for part, ok := range have {
			if ok != slices.Contains(want, part) && !(part == "record" && !s.ambient && !s.started) {
				out = append(out, fmt.Sprintf("%s/%s (%s, started %v): %s %v", s.namespace, s.pod, s.ns.Name, s.started, part, ok))
			}
		}
	}
	return append(out, c.delErrs...)
}

// settle waits for the invariant to hold (the agent's restore, its first
// verification pass and ztunnel's snapshot take a moment after a fault)
// and returns what still breaks it after 15 s, with the number of
// sandboxes checked and of ADDs refused on the way.
func (c *chaos) settle() (checked, refused int, bad []string) {
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		bad = c.violations()
		if len(bad) == 0 || time.Now().After(end) {
			break
		}
	}
	if fds := c.fds(); fds > c.baseFDs+2*len(c.started())+16 {
		bad = append(bad, fmt.Sprintf("the agent holds %d descriptors (%d at start, %d pods started)", fds, c.baseFDs, len(c.started())))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.sandboxes), c.refused, bad
}

// fds counts the running agent's open descriptors.
func (c *chaos) fds() int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", c.agent.Process.Pid))
	if err != nil {
		c.t.Fatal(err)
	}
	return len(ents)
}

// netnsState reads, through netlink, whether the netns behind fd holds our
// table and the ambient policy route.
func netnsState(fd int) (table, route bool) {
	conn, err := nftables.New(nftables.WithNetNSFd(fd))
	if err == nil {
		ts, _ := conn.ListTablesOfFamily(nftables.TableFamilyINet)
		for _, t := range ts {
			table = table || t.Name == nft.PodTable
		}
		_ = conn.CloseLasting()
	}
	h, err := netlink.NewHandleAt(netns.NsHandle(fd))
	if err == nil {
		rules, _ := h.RuleList(netlink.FAMILY_V4)
		for _, r := range rules {
			route = route || r.Table == istio.RouteTable
		}
		h.Close()
	}
	return table, route
}

// chaosScenarios: each is run on a fresh node; run injects the fault and
// leaves the node to settle.
var chaosScenarios = []struct {
	name string
	run  func(c *chaos, rnd *rand.Rand)
}{
	{"agent SIGKILL during an ADD storm", func(c *chaos, rnd *rand.Rand) { c.killDuringStorm(rnd, syscall.SIGKILL) }},
	{"agent SIGTERM during an ADD storm", func(c *chaos, rnd *rand.Rand) { c.killDuringStorm(rnd, syscall.SIGTERM) }},
	{"agent killed between the record and ztunnel's ack", func(c *chaos, rnd *rand.Rand) { c.killAt(rnd, faults.Recorded) }},
	{"agent killed between ztunnel's ack and its answer", func(c *chaos, rnd *rand.Rand) { c.killAt(rnd, faults.Acked) }},
	{"agent killed after the plugin's outcome", func(c *chaos, rnd *rand.Rand) { c.killAt(rnd, faults.Outcome) }},
	{"agent killed during a record's atomic write", func(c *chaos, rnd *rand.Rand) {
		c.killAt(rnd, faults.Renaming+":"+records.DirName)
	}},
	{"ztunnel SIGKILL during an ADD storm", func(c *chaos, rnd *rand.Rand) {
		c.during(rnd, func() {
			c.z.Close()
			time.Sleep(300 * time.Millisecond)
			c.connect()
		})
		c.stopSome()
	}},
	{"ztunnel hung on one pod's ack", func(c *chaos, rnd *rand.Rand) {
		c.z.Stall("uid-p"+strconv.Itoa(rnd.IntN(chaosPods)), 6*time.Second)
		hung := c.z
		c.during(rnd, func() {
			<-hung.Done() // the agent drops it once the ack is overdue
			c.connect()
		})
		c.stopSome()
	}},
	{"ztunnel speaking garbage", func(c *chaos, rnd *rand.Rand) {
		c.during(rnd, func() {
			_ = c.z.Garbage()
			<-c.z.Done()
			c.connect()
		})
		c.stopSome()
	}},
	{"ztunnel acking slowly", func(c *chaos, rnd *rand.Rand) {
		c.z.SlowAcks(time.Duration(200+rnd.IntN(300)) * time.Millisecond)
		c.storm(60 * time.Second)
		c.stopSome()
	}},
	{"DELs while the agent is down, netns kept or gone", func(c *chaos, rnd *rand.Rand) {
		c.storm(30 * time.Second)
		c.kill(syscall.SIGKILL)
		for i, s := range c.started() {
			switch i % 3 {
			case 0:
				c.runtimeDel(s)
			case 1:
				s.removeNetns(c.t)
				c.runtimeDel(s)
			}
		}
		c.start()
	}},
	{"duplicate and reordered ADD, DEL and CHECK", func(c *chaos, rnd *rand.Rand) {
		c.storm(30 * time.Second)
		for i, s := range c.started() {
			switch i % 4 {
			case 0: // the runtime repeats an ADD: it still holds the sandbox
				if _, err := c.n.add(c.list, s.rt); err != nil {
					c.runtimeDel(s)
				}
			case 1: // DEL, DEL again, then a CHECK (its answer is the runtime's affair)
				c.runtimeDel(s)
				c.runtimeDel(s)
				_ = c.n.check(c.withoutBridge(), s.rt)
			case 2: // CHECK of a started sandbox
				if err := c.n.check(c.withoutBridge(), s.rt); err != nil {
					c.mu.Lock()
					c.delErrs = append(c.delErrs, fmt.Sprintf("CHECK of started %s: %v", s.pod, err))
					c.mu.Unlock()
				}
			}
		}
		// A DEL before its ADD (the runtime's cleanup of a sandbox whose
		// ADD it never sent), then the ADD.
		s := &sandbox{pod: "late", namespace: meshNS, ns: testnet.NewNS(c.t, "nftchaos"), ambient: true}
		s.rt = runtimeConf(s.ns, meshNS, s.pod, nil)
		c.mu.Lock()
		c.sandboxes = append(c.sandboxes, s)
		c.mu.Unlock()
		c.runtimeDel(s)
		if r, err := c.n.add(c.list, s.rt); err == nil {
			s.ip, s.started = podIPs(c.t, r)[0].String(), true
		} else {
			c.runtimeDel(s)
		}
	}},
	{"a full run dir", func(c *chaos, rnd *rand.Rand) {
		fill := c.fillRecords()
		for i := range 3 { // each fails and leaves nothing
			if _, err := c.runtimeAdd(meshNS, "p"+strconv.Itoa(i)); err == nil {
				c.mu.Lock()
				c.delErrs = append(c.delErrs, "an ADD succeeded with no room for its record")
				c.mu.Unlock()
			}
		}
		if bad := c.violations(); len(bad) > 0 {
			c.mu.Lock()
			c.delErrs = append(c.delErrs, bad...)
			c.mu.Unlock()
		}
		fill()
		c.storm(30 * time.Second)
		c.stopSome()
	}},
	{"oversized and invalid annotations", func(c *chaos, rnd *rand.Rand) {
		c.storm(30 * time.Second) // p0 has 300 KiB of annotations
		_, err := c.runtimeAdd("plain", "bad")
		if err == nil || !strings.Contains(err.Error(), istio.AnnExcludeOutboundCIDRs) {
			c.mu.Lock()
			c.delErrs = append(c.delErrs, fmt.Sprintf("ADD of a pod with an invalid %s: %v, want a refusal naming it", istio.AnnExcludeOutboundCIDRs, err))
			c.mu.Unlock()
		}
		if _, err := c.runtimeAdd("plain", "web"); err != nil {
			c.mu.Lock()
			c.delErrs = append(c.delErrs, fmt.Sprintf("ADD of a plain pod: %v", err))
			c.mu.Unlock()
		}
	}},
}

// withoutBridge is the installed chain without the bridge plugin, for a
// CHECK of the rest: the reference bridge's CHECK fails once another port
// joins the bridge and changes its MAC, whatever we do.
func (c *chaos) withoutBridge() *libcni.NetworkConfigList {
	l := *c.list
	l.Plugins = slices.DeleteFunc(slices.Clone(l.Plugins), func(p *libcni.PluginConfig) bool { return p.Network.Type == "bridge" })
	return &l
}

// during runs a storm and, once a random number of its sandboxes (up to
// half the pods) have been made, fault.
func (c *chaos) during(rnd *rand.Rand, fault func()) {
	done := make(chan struct{})
	go func() { defer close(done); c.storm(60 * time.Second) }()
	for k := 1 + rnd.IntN(chaosPods/2); ; time.Sleep(time.Millisecond) {
		c.mu.Lock()
		made := len(c.sandboxes)
		c.mu.Unlock()
		if made >= k {
			break
		}
	}
	fault()
	<-done
}

// killDuringStorm kills the agent with sig at a random moment of a storm,
// restarts it after a while with no agent, and DELs some pods.
func (c *chaos) killDuringStorm(rnd *rand.Rand, sig syscall.Signal) {
	c.during(rnd, func() {
		c.kill(sig)
		time.Sleep(300 * time.Millisecond)
		c.start()
	})
	c.stopSome()
}

// killAt restarts the agent armed to die at point, on a random one of the
// storm's first passes through it, and starts it again once it has.
func (c *chaos) killAt(rnd *rand.Rand, point string) {
	c.kill(syscall.SIGTERM)
	c.start(fmt.Sprintf("%s=%s@%d", faults.EnvPoint, point, 1+rnd.IntN(4)))
	done := make(chan struct{})
	go func() { defer close(done); c.storm(60 * time.Second) }()
	select {
	case <-c.exited:
	case <-done:
		c.t.Errorf("the agent never reached %s", point)
		c.kill(syscall.SIGTERM)
	}
	c.start()
	<-done
	c.stopSome()
}

// fillRecords mounts a small tmpfs over the records dir and fills it;
// the returned func empties it again.
func (c *chaos) fillRecords() func() {
	dir := filepath.Join(c.n.h.run, records.DirName)
	c.kill(syscall.SIGTERM)
	// The agent's records move onto the tmpfs with it.
	saved, err := os.ReadDir(dir)
	if err != nil {
		c.t.Fatal(err)
	}
	contents := map[string][]byte{}
	for _, e := range saved {
		b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		contents[e.Name()] = b
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	for name, b := range contents {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			c.t.Fatal(err)
		}
	}
	c.start()
	filler := filepath.Join(dir, "filler")
	f, err := os.Create(filler)
	if err != nil {
		c.t.Fatal(err)
	}
	for err == nil {
		_, err = f.Write(make([]byte, 4096))
	}
	f.Close()
	return func() { _ = os.Remove(filler) }
}

func TestChaos(t *testing.T) {
	rounds := 1
	if v := os.Getenv("NFTCNI_CHAOS_ROUNDS"); v != "" {
		var err error
		if rounds, err = strconv.Atoi(v); err != nil || rounds < 1 {
			t.Fatalf("NFTCNI_CHAOS_ROUNDS=%q", v)
		}
	}
	var report strings.Builder
	fmt.Fprintf(&report, "%-52s %5s %13s %13s %10s\n", "scenario", "runs", "ADDs refused", "pods checked", "violations")
	total, totalChecked, totalRefused := 0, 0, 0
	for i, sc := range chaosScenarios {
		checked, refused, violations, ran := 0, 0, 0, false
		// No commas: the subtest's temp dirs go into CNI_BIN_DIR, a list.
		name := strings.NewReplacer(" ", "_", ",", "").Replace(sc.name)
		t.Run(name, func(t *testing.T) {
			ran = true
			for r := range rounds {
				rnd := rand.New(rand.NewPCG(uint64(i), uint64(r)))
				c := newChaos(t, 100+i)
				sc.run(c, rnd)
				n, r, bad := c.settle()
				checked += n
				refused += r
				violations += len(bad)
				for _, b := range bad {
					t.Errorf("round %d: %s", r, b)
				}
				if len(bad) > 0 {
					t.Logf("agent log:\n%s", c.logs)
				}
			}
		})
		if !ran {
			continue
		}
		total += violations
		totalChecked += checked
		totalRefused += refused
		fmt.Fprintf(&report, "%-52s %5d %13d %13d %10d\n", sc.name, rounds, refused, checked, violations)
	}
	fmt.Fprintf(&report, "%-52s %5s %13d %13d %10d\n", "all", "", totalRefused, totalChecked, total)
	t.Logf("chaos:\n%s", report.String())
	if p := os.Getenv("NFTCNI_CHAOS_REPORT"); p != "" {
		if err := os.WriteFile(p, []byte(report.String()), 0o644); err != nil {
			t.Error(err)
		}
	}
}
