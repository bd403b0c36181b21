package enrol

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/nft"
)

// This file is the continuous verification: every enrolled pod's ruleset
// and policy routes are checked through the netns descriptor the agent
// holds, on an interval, and put back when anyone changed them. A flushed
// pod ruleset would otherwise leave the pod's traffic bypassing ztunnel
// until the next restart, while the pod is still annotated as enrolled
// (istio#61182: 29 days).

// verifyState is what the verifier knows of one pod.
type verifyState struct {
	pending bool      // list everything at the next pass
	gen     uint32    // nf_tables generation last seen intact (0: none)
	at      time.Time // last found intact (or put back)
	drift   string    // the last drift found
	repairs int
}

// Metrics are the enrolment's Prometheus metrics.
type Metrics struct {
	Repairs  prometheus.Counter
	Verified prometheus.Gauge
	Pass     prometheus.Gauge
	// Handovers counts pods found with istio-cni's rules: taken over, or
	// refused (other rules beside them) and left as they were.
	Handovers *prometheus.CounterVec
	// OutsideChain counts ambient pods that started while the agent ran
	// but whose ADD never reached it: enrolled late.
	OutsideChain prometheus.Counter
}

// NewMetrics registers the metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Repairs: prometheus.NewCounter(prometheus.CounterOpts{Name: "nftcni_ruleset_repairs_total",
			Help: "Pod rulesets found changed by someone else and put back by the agent."}),
		Verified: prometheus.NewGauge(prometheus.GaugeOpts{Name: "nftcni_ruleset_verified_pods",
			Help: "Enrolled pods whose ruleset the last verification pass checked (intact, or repaired)."}),
		Pass: prometheus.NewGauge(prometheus.GaugeOpts{Name: "nftcni_ruleset_verify_pass_seconds",
			Help: "Wall time of the last verification pass over every enrolled pod."}),
		Handovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "nftcni_istio_handover_pods_total",
			Help: "Pods found with istio-cni's rules in their netns: result taken (replaced by ours in one transaction) or refused (rules of someone else beside them; left as they were)."},
			[]string{"result"}),
		OutsideChain: prometheus.NewCounter(prometheus.CounterOpts{Name: "nftcni_pods_started_outside_chain_total",
			Help: "Ambient pods that started while the agent ran but whose sandbox never reached nftcni (the runtime did not run its entry: a primary that rewrote its config without it, or a runtime that reads no drop-ins); each was enrolled late."}),
	}
	if reg != nil {
		reg.MustRegister(m.Repairs, m.Verified, m.Pass, m.Handovers, m.OutsideChain)
	}
	return m
}

// Verify runs a verification pass right away (pods restored at start get
// their first check), then one every interval, jittered by ±10% so the
// agents of many nodes do not beat together, at most concurrency pods at
// a time, until ctx ends.
func (e *Enroller) Verify(ctx context.Context, every time.Duration, concurrency int) {
	for {
		e.VerifyPass(ctx, concurrency)
		wait := every + time.Duration((rand.Float64()*0.2-0.1)*float64(every))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// VerifyPass checks every enrolled pod once and reports how many it
// checked and how many it repaired.
func (e *Enroller) VerifyPass(ctx context.Context, concurrency int) (checked, repaired int) {
	start := time.Now()
	sem := make(chan struct{}, max(concurrency, 1))
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, p := range e.snapshot() {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, r := e.verifyPod(ctx, p)
			mu.Lock()
			checked, repaired = checked+b2i(c), repaired+b2i(r)
			mu.Unlock()
		}()
	}
	wg.Wait()
	e.metrics.Verified.Set(float64(checked))
	e.metrics.Pass.Set(time.Since(start).Seconds())
	return checked, repaired
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// verifyPod checks one pod. A pod in the middle of a transition is left to
// the next pass.
func (e *Enroller) verifyPod(ctx context.Context, p *pod) (checked, repaired bool) {
	if !p.mu.TryLock() {
		return false, false
	}
	defer p.mu.Unlock()
	if !p.enrolled() || p.netns == nil {
		return false, false
	}
	if !e.netnsAlive(p) {
		// The runtime removed the sandbox without a DEL reaching the agent
		// (it was down, say).
		_ = e.step(ctx, p, change{ev: evSandboxGone, why: "its sandbox is gone without a DEL"})
		return false, false
	}
	if err := e.step(ctx, p, change{ev: evSync}); err != nil {
		e.log.Warn("could not annotate an enrolled pod; retried at the next pass", "pod", p.id.Key(), "err", err)
	}
	rs, _, err := e.batches.get(p.d)
	if err != nil || rs == nil {
		return false, false
	}
	gen := p.verify.gen
	if p.verify.pending {
		gen = 0
	}
	now, err := e.rules.Check(p.fd(), rs, gen)
	var drift *nft.DriftError
	switch {
	case err == nil:
		p.verify.pending, p.verify.gen, p.verify.at = false, now, time.Now()
		return true, false
	case !errors.As(err, &drift):
		e.log.Warn("could not verify a pod's ruleset", "pod", p.id.Key(), "uid", p.id.UID, "err", err)
		return false, false
	}
	what := strings.Join(drift.Problems, "; ")
	p.verify.drift, p.verify.gen = what, 0
	if err := e.step(ctx, p, change{ev: evDrift, why: what}); err != nil {
		e.log.Error("pod ruleset drifted and could not be put back", "pod", p.id.Key(), "uid", p.id.UID, "drift", what, "err", err)
		p.verify.pending = true
		return true, false
	}
	return true, true
}

// repair puts an enrolled pod's ruleset back after drift (step's
// doRepair); the next pass lists it again.
func (e *Enroller) repair(p *pod, drift string) error {
	_, batch, err := e.batches.get(p.d)
	if err != nil {
		return err
	}
	if err := e.rules.Program(p.fd(), batch); err != nil {
		return err
	}
	e.metrics.Repairs.Inc()
	p.verify.repairs++
	p.verify.pending, p.verify.at = true, time.Now()
	e.log.Warn("pod ruleset drifted; put back", "pod", p.id.Key(), "uid", p.id.UID, "mode", p.d.Mode, "drift", drift)
	return nil
}
