package main

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
)

// TestProbeSNATFlags: Istio's defaults stay the zero value (so recorded
// decisions do not change), another address is kept, and an address of the
// wrong family is refused naming the flag.
func TestProbeSNATFlags(t *testing.T) {
	for _, c := range []struct {
		v4, v6 string
		want   capture.ProbeSNAT
		err    string
	}{
		{v4: istio.ProbeSNATv4, v6: istio.ProbeSNATv6},
		{v4: "169.254.7.128", v6: "e9ac::1", want: capture.ProbeSNAT{V4: netip.MustParseAddr("169.254.7.128"), V6: netip.MustParseAddr("e9ac::1")}},
		{v4: "fd00::1", v6: istio.ProbeSNATv6, err: "--host-probe-snat-ip"},
		{v4: istio.ProbeSNATv4, v6: "169.254.7.127", err: "--host-probe-snat-ipv6"},
		{v4: "not an address", v6: istio.ProbeSNATv6, err: "want an IPv4 address"},
	} {
		got, err := (&probeSNATFlags{v4: c.v4, v6: c.v6}).parse()
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s %s: error %v, want one naming %q", c.v4, c.v6, err, c.err)
		case c.err == "" && (err != nil || got != c.want):
			t.Errorf("%s %s: %+v %v, want %+v", c.v4, c.v6, got, err, c.want)
		}
	}
}

// TestPluginAgentWaitFlag: the default writes no field (the plugin's own
// default applies, and an older plugin reads none), another value is
// written in seconds, one past the plugin's bound is refused.
func TestPluginAgentWaitFlag(t *testing.T) {
	f := newFlagSet("test")
	c := &common{}
	c.register(f)
	if err := f.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if v, err := c.pluginValues(); err != nil || v.AgentWaitSeconds != nil {
		t.Errorf("default: %v, %v; want no agent_wait_seconds", v.AgentWaitSeconds, err)
	}
	for in, want := range map[time.Duration]float64{0: 0, 5 * time.Second: 5, 90 * time.Second: 90} {
		c.agentWait = in
		if v, err := c.pluginValues(); err != nil || v.AgentWaitSeconds == nil || *v.AgentWaitSeconds != want {
			t.Errorf("--plugin-agent-wait %v: %v, %v; want %v", in, v.AgentWaitSeconds, err, want)
		}
	}
	c.agentWait = 2 * time.Minute
	if _, err := c.pluginValues(); err == nil || !strings.Contains(err.Error(), "--plugin-agent-wait") {
		t.Errorf("--plugin-agent-wait 2m: %v, want refused", err)
	}
}
