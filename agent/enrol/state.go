package enrol

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/nftcni/nftcni/agent/enablement"
)

// This file is the enrolment state machine: the states an attachment can
// be in, the events that move it, and the one table that says, for each
// state and event, what is done and where the pod ends up. Every change of
// a pod's enrolment, and every rule write into a pod the agent tracks,
// goes through Enroller.step.

// state is where one attachment is in its enrolment.
type state uint8

const (
	// known: the agent holds the pod's netns (or its record); the pod is
	// not in the mesh.
	known state = iota
	// enrolled: captured — rules, ztunnel's hold, the probe set entry,
	// the record and the annotation are in place.
	enrolled
	// unannotated: captured, but the annotation that reports the capture
	// to istiod could not be written yet; it is owed.
	unannotated
	// gone: released for good, or dropped as the agent stops; whoever
	// waited for the pod's lock finds nothing to do.
	gone
)

var stateNames = [...]string{known: "known", enrolled: "enrolled", unannotated: "unannotated", gone: "gone"}

func (s state) String() string { return stateNames[s] }

// event is what happened to a pod.
type event uint8

const (
	// evEnrol: the policy enrols the pod (the plugin's ADD, late
	// enrolment, adoption through /proc, a restored record).
	evEnrol event = iota
	// evUnenrol: the policy no longer enrols it (labels, annotations).
	evUnenrol
	// evFinished: its phase is Succeeded or Failed; its sandbox may stay.
	evFinished
	// evChanged: still enrolled, with another ruleset (annotations).
	evChanged
	// evDrift: the verifier found its rules changed by someone else.
	evDrift
	// evSync: nothing changed; whatever is owed is paid.
	evSync
	// evDel: the runtime's DEL (the rules are removed through the
	// descriptor the plugin handed over).
	evDel
	// evReAdd: the runtime ran ADD again for the same attachment.
	evReAdd
	// evGC: the runtime no longer has the attachment.
	evGC
	// evDeletedAway: the runtime's DEL ran while no agent did; the plugin
	// removed the rules.
	evDeletedAway
	// evPodGone: deleted from the pod source, or replaced by a newer pod
	// of the same name.
	evPodGone
	// evSandboxGone: its netns went without a DEL.
	evSandboxGone
	// evStale: a pod found through /proc, annotated as enrolled by an
	// agent that left no record, that the policy no longer enrols.
	evStale
	// evStop: the agent stops (or a newer find replaces the attachment):
	// the descriptor is closed, the rules and ztunnel's snapshot stay.
	evStop
	nEvents
)

var eventNames = [...]string{evEnrol: "enrol", evUnenrol: "unenrol", evFinished: "finished", evChanged: "changed",
	evDrift: "drift", evSync: "sync", evDel: "DEL", evReAdd: "ADD again", evGC: "GC", evDeletedAway: "DEL while away",
	evPodGone: "pod gone", evSandboxGone: "sandbox gone", evStale: "stale capture", evStop: "stop"}

func (e event) String() string { return eventNames[e] }

// action is what a transition does.
type action uint8

const (
	doNothing   action = iota
	doEnrol            // Enroller.enrol, as the change's how says
	doReprogram        // replace the ruleset atomically (Enroller.reprogram)
	doRepair           // put the ruleset back (Enroller.repair)
	doAnnotate         // write the owed annotation
	doRelease          // out of the mesh, the pod kept known (Enroller.release)
	doForget           // out of the mesh and forgotten (release, forget)
	doClear            // remove the rules from the netns, touch nothing else
	doDrop             // close the descriptor, touch nothing else
)

var actionNames = [...]string{doNothing: "nothing", doEnrol: "enrol", doReprogram: "reprogram", doRepair: "repair",
	doAnnotate: "annotate", doRelease: "release", doForget: "forget", doClear: "clear", doDrop: "drop"}

func (a action) String() string { return actionNames[a] }

// transition is one cell of the table: the action, and the state the pod
// is in once it succeeded or failed.
type transition struct {
	do         action
	ok, failed state
	// For doRelease and doForget: the caller removed the rules already
	// (DEL), and the annotation stays (the sandbox goes, the pod may get
	// a new one).
	rulesGone, keepAnnotation bool
}

// leaving are the events that end a pod's tracking whatever state it is
// in (but gone): the sandbox or the pod went, or the agent stops.
var leaving = map[event]transition{
	evDel:         {do: doForget, ok: gone, failed: gone, rulesGone: true, keepAnnotation: true},
	evReAdd:       {do: doForget, ok: gone, failed: gone, rulesGone: true, keepAnnotation: true},
	evGC:          {do: doForget, ok: gone, failed: gone, keepAnnotation: true},
	evDeletedAway: {do: doForget, ok: gone, failed: gone, rulesGone: true},
	evPodGone:     {do: doForget, ok: gone, failed: gone},
	evSandboxGone: {do: doForget, ok: gone, failed: gone},
	evStop:        {do: doDrop, ok: gone, failed: gone},
}

// row is a state's own cells, with the leaving ones.
func row(own map[event]transition) map[event]transition {
	r := maps.Clone(leaving)
	maps.Copy(r, own)
	return r
}

// captured is the row of enrolled and unannotated pods (self).
func captured(self state) map[event]transition {
	return row(map[event]transition{
		evUnenrol:  {do: doRelease, ok: known, failed: self},
		evFinished: {do: doRelease, ok: known, failed: self},
		evChanged:  {do: doReprogram, ok: self, failed: self},
		evDrift:    {do: doRepair, ok: self, failed: self},
	})
}

// table is the state machine. A missing cell does nothing and leaves the
// state as it is.
var table = func() map[state]map[event]transition {
	t := map[state]map[event]transition{
		known: row(map[event]transition{
			evEnrol: {do: doEnrol, ok: enrolled, failed: known},
			evStale: {do: doClear, ok: known, failed: known},
		}),
		enrolled:    captured(enrolled),
		unannotated: captured(unannotated),
		gone:        {},
	}
	t[unannotated][evSync] = transition{do: doAnnotate, ok: enrolled, failed: unannotated}
	return t
}()

// next is the transition for s and ev.
func next(s state, ev event) transition {
	if t, ok := table[s][ev]; ok {
		return t
	}
	return transition{do: doNothing, ok: s, failed: s}
}

// change is an event with what acting on it needs.
type change struct {
	ev  event
	d   *enablement.Decision // evEnrol, evChanged
	how how                  // evEnrol: who puts the rules in place
	why string               // why the pod is released or repaired (logs, its decision's reason)
}

// errAnnotationOwed is an enrolment that captured the pod but could not
// annotate it: the pod is unannotated, and the caller succeeded.
var errAnnotationOwed = errors.New("captured; the annotation is owed")

// step moves p as c says. Called with p.mu held.
func (e *Enroller) step(ctx context.Context, p *pod, c change) error {
	t := next(p.state, c.ev)
	var err error
	switch t.do {
	case doNothing:
	case doEnrol:
		err = e.enrol(ctx, p, c.d, c.how)
	case doReprogram:
		err = e.reprogram(ctx, p, c.d)
	case doRepair:
		err = e.repair(p, c.why)
	case doAnnotate:
		err = e.annotate(ctx, p, RedirectionEnabled)
	case doRelease, doForget:
		err = e.release(ctx, p, releaseHow{why: c.why, rulesGone: t.rulesGone, forget: t.do == doForget, keepAnnotation: t.keepAnnotation})
	case doClear:
		err = e.rules.Remove(p.fd())
	case doDrop:
		e.drop(p)
	default:
		panic(fmt.Sprintf("enrol: no action %d", t.do))
	}
	switch {
	case err == nil:
		p.state = t.ok
	case errors.Is(err, errAnnotationOwed):
		p.state, err = unannotated, nil
	default:
		p.state = t.failed
	}
	if p.state == gone {
		e.untrack(p)
	}
	return err
}

// untrack forgets p, unless a newer attachment took its place already.
func (e *Enroller) untrack(p *pod) {
	e.mu.Lock()
	if e.pods[p.id.Attachment] == p {
		delete(e.pods, p.id.Attachment)
	}
	e.mu.Unlock()
}

// drop closes p's descriptor and leaves everything else as it is.
func (e *Enroller) drop(p *pod) {
	if p.netns != nil {
		p.netns.Close()
		p.netns = nil
	}
}
