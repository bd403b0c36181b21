package inspect

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// The inspector's verdicts on nft's Fake: the netns is a plain file, the
// agent is not running (its socket is absent), the records are real.

type scene struct {
	t      *testing.T
	run    string
	recs   *records.Dir
	kernel *nft.Fake
	in     *Inspector
}

func newScene(t *testing.T) *scene {
	t.Helper()
	run := t.TempDir()
	recs, err := records.Open(run)
	if err != nil {
		t.Fatal(err)
	}
	host := file(t, "host")
	s := &scene{t: t, run: run, recs: recs, kernel: nft.NewFake()}
	s.in = &Inspector{RunDir: run, HostNetns: host, Host: capture.HostSpec{}, Kernel: s.kernel}
	return s
}

// file is a plain file standing in for a netns.
func file(t *testing.T, name string) string {
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

var ambient = &enablement.Decision{Mode: wire.ModeAmbient, Reason: "namespace label", Ambient: &capture.AmbientSpec{DNSCapture: true}}

// pod records mesh/<name> with d; its netns holds rs (nil: nothing).
func (s *scene) pod(name string, d *enablement.Decision, rs *nft.Ruleset) string {
	s.t.Helper()
	netns := file(s.t, name)
	r := &records.Record{Pod: wire.Pod{Namespace: "mesh", Name: name, UID: "uid-" + name, IPs: []string{"10.0.0.5/32"}, Netns: netns,
		Attachment: wire.Attachment{ContainerID: "c-" + name, IfName: "eth0"}}, UID: "uid-" + name, Decision: d}
	if err := s.recs.Save(r); err != nil {
		s.t.Fatal(err)
	}
	if rs != nil {
		s.program(netns, rs)
	}
	return netns
}

func (s *scene) program(path string, rs *nft.Ruleset) {
	s.t.Helper()
	f, err := os.Open(path)
	if err != nil {
		s.t.Fatal(err)
	}
	defer f.Close()
	b, err := nft.Encode(rs)
	if err != nil {
		s.t.Fatal(err)
	}
	if err := s.kernel.Program(int(f.Fd()), b); err != nil {
		s.t.Fatal(err)
	}
}

func (s *scene) tamper(path string, edit func(*nft.Ruleset)) {
	f, err := os.Open(path)
	if err != nil {
		s.t.Fatal(err)
	}
	defer f.Close()
	s.kernel.Tamper(int(f.Fd()), edit)
}

func (s *scene) inspect(target string) (string, error) {
	var out bytes.Buffer
	err := s.in.Target(&out, target)
	return out.String(), err
}

func want(t *testing.T, out string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(out, l) {
			t.Errorf("output lacks %q:\n%s", l, out)
		}
	}
}

func TestInspectEnrolledPod(t *testing.T) {
	s := newScene(t)
	want0, _ := ambient.Ruleset()
	netns := s.pod("a", ambient, want0)
	out, err := s.inspect("mesh/a")
	if err != nil {
		t.Fatalf("inspect of an intact pod: %v\n%s", err, out)
	}
	want(t, out, "pod mesh/a (uid uid-a", "netns:     "+netns, "enrolment: ambient (namespace label)",
		"ztunnel:   unknown: the agent at", "ruleset:   matches the decision", "table inet nftcni {")
	// By its netns path, the same.
	if out2, err := s.inspect(netns); err != nil || out2 != out {
		t.Errorf("inspect by netns path: %v\n%s\nwant what inspect by name gave", err, out2)
	}

	s.tamper(netns, func(rs *nft.Ruleset) { rs.Tables[0].Chains[0].Rules = nil })
	out, err = s.inspect("mesh/a")
	if !errors.Is(err, ErrDrift) {
		t.Fatalf("inspect after someone emptied a chain: %v, want ErrDrift\n%s", err, out)
	}
	want(t, out, "ruleset:   DRIFT", "- line ")
}

func TestInspectPodOutsideTheMesh(t *testing.T) {
	s := newScene(t)
	none := &enablement.Decision{Mode: wire.ModeNone, Reason: "namespace not enrolled"}
	netns := s.pod("b", none, nil)
	out, err := s.inspect("mesh/b")
	if err != nil {
		t.Fatalf("inspect of a plain pod: %v\n%s", err, out)
	}
	want(t, out, "enrolment: none (namespace not enrolled)", "ruleset:   none, as expected")
	if strings.Contains(out, "verified:") {
		t.Errorf("a pod outside the mesh has no verification line:\n%s", out)
	}
	// Someone left our table in a pod we never enrolled.
	rs, _ := ambient.Ruleset()
	s.program(netns, rs)
	out, err = s.inspect("mesh/b")
	if !errors.Is(err, ErrDrift) {
		t.Fatalf("inspect of a plain pod holding our table: %v\n%s", err, out)
	}
	want(t, out, "exists but the pod is not enrolled")
}

func TestInspectUnknownTargets(t *testing.T) {
	s := newScene(t)
	if _, err := s.inspect("mesh/nobody"); err == nil || !strings.Contains(err.Error(), "no record of pod mesh/nobody") {
		t.Errorf("inspect of an unknown pod: %v", err)
	}
	netns := file(t, "stray")
	rs, _ := ambient.Ruleset()
	s.program(netns, rs)
	out, err := s.inspect(netns)
	if err != nil {
		t.Fatal(err)
	}
	want(t, out, "netns "+netns, "enrolment: no record", "ruleset:   present, not compared", "table inet nftcni {")
	if _, err := s.inspect(filepath.Join(t.TempDir(), "absent")); err == nil {
		t.Error("inspect of a netns path that does not exist succeeded")
	}
}

func TestInspectHost(t *testing.T) {
	s := newScene(t)
	rs, _ := ambient.Ruleset()
	s.pod("a", ambient, rs)
	s.pod("c", &enablement.Decision{Mode: wire.ModeNone}, nil)
	s.program(s.in.HostNetns, capture.HostProbe(s.in.Host, []nft.Member{{UID: "uid-a", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}}))
	out, err := s.inspect("host")
	if err != nil {
		t.Fatalf("inspect host: %v\n%s", err, out)
	}
	want(t, out, "enrolled ambient pods recorded: 1", "ruleset:   matches the decision", `10.0.0.5 comment "uid-a"`)

	// A probe set that lost the pod.
	s.program(s.in.HostNetns, capture.HostProbe(s.in.Host, nil))
	out, err = s.inspect("host")
	if !errors.Is(err, ErrDrift) {
		t.Fatalf("inspect host with the pod missing from the probe set: %v\n%s", err, out)
	}
	want(t, out, "ruleset:   DRIFT")
}
