package enrol

import (
	"context"
	"fmt"
	"testing"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/plugin/wire"
)

// The state machine's table test: every state, every event, driven
// through Enroller.step on the rig's fakes, and judged by what the pod
// ends up with — its rules, ztunnel's hold, the probe set, its record,
// its annotation, the descriptor — not by the table itself.

// What a pod holds, in the observation's words.
const (
	obsKnown       = "known rules=none zt=false probe=false record=none ann=\"\" netns=true tracked=true"
	obsEnrolled    = "enrolled rules=ambient zt=true probe=true record=ambient ann=\"enabled\" netns=true tracked=true"
	obsUnannotated = "unannotated rules=ambient zt=true probe=true record=ambient ann=\"\" netns=true tracked=true"
	// gone after a DEL: the annotation stays for the pod's next sandbox.
	obsGoneAnnotated = "gone rules=none zt=false probe=false record=- ann=\"enabled\" netns=false tracked=false"
	obsGone          = "gone rules=none zt=false probe=false record=- ann=\"\" netns=false tracked=false"
)

// wantCell is each cell's outcome; a cell left out leaves the pod exactly
// as it was.
var wantCell = map[state]map[event]string{
	known: {
		evEnrol:       obsEnrolled,
		evStale:       obsKnown, // the rules a previous agent left are removed
		evDel:         obsGone,
		evReAdd:       obsGone,
		evGC:          obsGone,
		evDeletedAway: obsGone,
		evPodGone:     obsGone,
		evSandboxGone: obsGone,
		evStop:        "gone rules=none zt=false probe=false record=none ann=\"\" netns=false tracked=false",
	},
	enrolled: {
		evUnenrol:     obsKnown,
		evFinished:    obsKnown,
		evChanged:     "enrolled rules=changed zt=true probe=true record=ambient ann=\"enabled\" netns=true tracked=true",
		evDrift:       obsEnrolled, // put back
		evDel:         obsGoneAnnotated,
		evReAdd:       obsGoneAnnotated,
		evGC:          obsGoneAnnotated,
		evDeletedAway: obsGone,
		evPodGone:     obsGone,
		evSandboxGone: obsGone,
		evStop:        "gone rules=ambient zt=true probe=true record=ambient ann=\"enabled\" netns=false tracked=false",
	},
	unannotated: {
		evSync:        obsEnrolled,
		evUnenrol:     obsKnown,
		evFinished:    obsKnown,
		evChanged:     "unannotated rules=changed zt=true probe=true record=ambient ann=\"\" netns=true tracked=true",
		evDrift:       obsUnannotated,
		evDel:         obsGone,
		evReAdd:       obsGone,
		evGC:          obsGone,
		evDeletedAway: obsGone,
		evPodGone:     obsGone,
		evSandboxGone: obsGone,
		evStop:        "gone rules=ambient zt=true probe=true record=ambient ann=\"\" netns=false tracked=false",
	},
	gone: {},
}

// startOf is what a pod in each state holds before the event.
var startOf = map[state]string{known: obsKnown, enrolled: obsEnrolled, unannotated: obsUnannotated, gone: obsGoneAnnotated}

// cell puts mesh/a in state s through the real paths (ADD, a failed
// annotation, DEL), applies ev as its caller would, and says what the pod
// holds before and after.
func cell(t *testing.T, s state, ev event) (before, after string) {
	t.Helper()
	r := newRig(t)
	ctx := context.Background()
	r.namespace("mesh", s != known)
	if s == unannotated {
		r.annotator.fails = 1
	}
	if err := r.addA(nil); err != nil {
		t.Fatal(err)
	}
	r.namespace("mesh", true) // the policy enrols the pod from now on
	p := r.e.pods[wire.Attachment{ContainerID: "c-a", IfName: "eth0"}]
	if s == gone {
		p.mu.Lock()
		r.rules.Fake.Remove(p.fd()) // the DEL's removal through the plugin's descriptor
		_ = r.e.step(ctx, p, change{ev: evDel})
		p.mu.Unlock()
	}
	before = r.observe(p)
	d := r.e.policy.Decide(r.store.Pod("mesh", "a"), r.store.Namespace("mesh"), p.id.IPs)
	c := change{ev: ev, d: d, why: "test"}
	switch ev {
	case evEnrol: // a running pod, the agent programming its rules
		_, batch, err := r.e.batches.get(d)
		if err != nil {
			t.Fatal(err)
		}
		c.how = how{rules: func(context.Context) error { return r.e.rules.Program(p.fd(), batch) }}
	case evChanged:
		c.d = &enablement.Decision{Mode: wire.ModeAmbient, Reason: "test", Ambient: &capture.AmbientSpec{DNSCapture: false}}
	case evDel, evReAdd, evDeletedAway, evDrift:
		if p.netns != nil { // the rules went before: the plugin's DEL, or someone else (drift)
			r.rules.Fake.Remove(p.fd())
		}
	case evStale:
		if p.netns != nil { // a previous agent's rules
			_, batch, _ := r.e.batches.get(d)
			r.rules.Fake.Program(p.fd(), batch)
		}
	}
	p.mu.Lock()
	err := r.e.step(ctx, p, c)
	p.mu.Unlock()
	if err != nil {
		t.Logf("%s on %s: %v", ev, s, err)
	}
	return before, r.observe(p)
}

// observe says what p holds.
func (r *rig) observe(p *pod) string {
	rules := "none"
	if p.netns != nil || r.netns["a"] != nil {
		switch got := r.dump("a"); got {
		case "":
		case r.ambientRules():
			rules = "ambient"
		default:
			rules = "changed"
		}
	}
	rec := "-"
	if m, ok := r.recorded()["mesh/a"]; ok {
		rec = string(m)
	}
	ann := ""
	if kp := r.store.Pod("mesh", "a"); kp != nil {
		ann = kp.Annotations[istio.AnnRedirection]
	}
	r.e.mu.Lock()
	tracked := r.e.pods[p.id.Attachment] == p
	r.e.mu.Unlock()
	return fmt.Sprintf("%s rules=%s zt=%v probe=%v record=%s ann=%q netns=%v tracked=%v",
		p.state, rules, r.zt.Holds("uid-a"), r.probes.holds("uid-a"), rec, ann, p.netns != nil, tracked)
}

func TestStateMachine(t *testing.T) {
	for _, s := range []state{known, enrolled, unannotated, gone} {
		for ev := range nEvents {
			t.Run(fmt.Sprintf("%s/%s", s, ev), func(t *testing.T) {
				before, after := cell(t, s, ev)
				if before != startOf[s] {
					t.Fatalf("set-up: the pod holds\n  %s\nwant\n  %s", before, startOf[s])
				}
				want, ok := wantCell[s][ev]
				if !ok {
					want = before
				}
				if after != want {
					t.Errorf("%s on a %s pod (table: %+v):\n  got  %s\n  want %s", ev, s, next(s, ev), after, want)
				}
			})
		}
	}
}

// Each transition that acts is mutated in turn — made to do nothing, or
// to land in another state — and the table test must see it.
func TestStateMachineCatchesEveryMutation(t *testing.T) {
	mutants := 0
	for _, s := range []state{known, enrolled, unannotated, gone} {
		for ev := range nEvents {
			orig, ok := table[s][ev]
			if !ok {
				continue
			}
			want := wantCell[s][ev]
			for _, m := range []transition{{do: doNothing, ok: s, failed: s}, func() transition { x := orig; x.ok = (orig.ok + 1) % (gone + 1); return x }()} {
				table[s][ev] = m
				mutants++
				_, after := cell(t, s, ev)
				table[s][ev] = orig
				if after == want {
					t.Errorf("mutating %s on %s to %+v went unnoticed", ev, s, m)
				}
			}
		}
	}
	t.Logf("%d mutants of the state table, each caught", mutants)
}
