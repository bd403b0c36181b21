package install

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/templates"
)

// LoopConfig tunes the watch-and-repair loop.
type LoopConfig struct {
	// Debounce collects a burst of file events into one pass; MaxDebounce
	// bounds the wait, so a writer that never stops still gets repaired.
	Debounce    time.Duration
	MaxDebounce time.Duration
	// Resync re-checks without any event, in case one was missed.
	Resync time.Duration
	// RetryBackoff is the wait after a failed pass (no primary yet, bad file).
	RetryBackoff time.Duration
	// RepairRate and RepairBurst bound how often passes run, so a component
	// fighting over the file cannot make us spin.
	RepairRate  rate.Limit
	RepairBurst int
	// FightThreshold reverts within FightWindow raise the fight warning.
	FightThreshold int
	FightWindow    time.Duration
}

// DefaultLoopConfig is what the agent runs with.
func DefaultLoopConfig() LoopConfig {
	return LoopConfig{
		Debounce:     2 * time.Millisecond,
		MaxDebounce:  200 * time.Millisecond,
		Resync:       time.Minute,
		RetryBackoff: 2 * time.Second,
		// A primary that rewrites its file without our entry leaves pods
		// starting outside the chain until the repair: a repair every
		// 50 ms keeps that window short against a fast rewriter
		// (TestNodeChainedFightingPrimary), and even a writer that reverts
		// at once costs us at most 20 small rewrites a second.
		RepairRate:     20,
		RepairBurst:    10,
		FightThreshold: 3,
		FightWindow:    time.Minute,
	}
}

// Metrics are the installer's Prometheus series; names follow istio-cni's
// where the meaning is the same.
type Metrics struct {
	Installs *prometheus.CounterVec
	Ready    prometheus.Gauge
	Repairs  prometheus.Counter
}

// NewMetrics registers the installer's metrics with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Installs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_cni_installs_total",
			Help: "Install passes that wrote something or failed, by result.",
		}, []string{"result"}),
		Ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "istio_cni_install_ready",
			Help: "1 while the plugin binary and CNI config are installed and valid.",
		}),
		Repairs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "nftcni_config_repairs_total",
			Help: "Times another writer changed a file nftcni had written and nftcni wrote it again.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.Installs, m.Ready, m.Repairs)
	}
	return m
}

// State is the installer's readiness, shared with the health server.
type State struct {
	mu     sync.Mutex
	ready  bool
	reason string
}

// Ready returns nil when the install is in place and valid.
func (s *State) Ready() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ready {
		return nil
	}
	if s.reason == "" {
		return errors.New("install not done yet")
	}
	return errors.New(s.reason)
}

func (s *State) set(ready bool, reason string) {
	s.mu.Lock()
	s.ready, s.reason = ready, reason
	s.mu.Unlock()
}

// Run installs, then watches the conf dir and bin dirs and repairs whatever
// changes, until ctx ends. It returns nil on cancellation; a failed pass is
// logged and retried, never fatal: a malformed primary config is the primary
// CNI's to fix, and we must be there to re-add ourselves when it does.
func (in *Installer) Run(ctx context.Context, lc LoopConfig, m *Metrics, st *State) error {
	if m == nil {
		m = NewMetrics(nil)
	}
	if st == nil {
		st = &State{}
	}
	for _, d := range append([]string{in.cfg.ConfDir}, in.cfg.BinDirs...) {
		if err := atomicfile.RemoveStaleTemps(d); err != nil {
			in.log.Warn("could not remove stale temp files", "dir", d, "err", err)
		}
	}
	if err := in.RemoveOtherModes(); err != nil {
		in.log.Warn("could not remove config left by another install mode", "err", err)
	}
	limiter := rate.NewLimiter(lc.RepairRate, lc.RepairBurst)
	fight := fightDetector{threshold: lc.FightThreshold, window: lc.FightWindow}
	var lastSkipped, lastErr string
	for first := true; ; first = false {
		w, dirs, res, perr := in.armAndInstall()
		if s := skippedText(res.Skipped); s != lastSkipped {
			lastSkipped = s
			for _, sk := range res.Skipped {
				in.log.Warn("SKIPPING invalid CNI config: containerd fails its whole CNI config load on a file like this, so pods on this node may not start until it is fixed or removed",
					"path", sk.Path, "err", sk.Err)
			}
		}
		switch {
		case perr != nil:
			st.set(false, perr.Error())
			m.Ready.Set(0)
			m.Installs.WithLabelValues("failure").Inc()
			if perr.Error() != lastErr {
				if errors.Is(perr, conflist.ErrNoConfig) {
					in.log.Info("waiting for the primary CNI to write its config", "dir", in.cfg.ConfDir, "detail", perr)
				} else {
					in.log.Error("install failed; will retry on the next change", "err", perr)
				}
			}
			lastErr = perr.Error()
		default:
			if lastErr != "" || first {
				in.log.Info("install in place", "mode", in.cfg.Mode, "config", res.Config, "primary", res.Primary)
			}
			lastErr = ""
			if len(res.Wrote) > 0 {
				m.Installs.WithLabelValues("success").Inc()
			}
			if res.Reverted {
				m.Repairs.Inc()
				if n, warn := fight.revert(time.Now()); warn {
					in.warnFight(res.Config, n, lc.FightWindow)
				}
			}
			st.set(true, "")
			m.Ready.Set(1)
		}
		wait := lc.Resync
		if perr != nil || w == nil {
			wait = lc.RetryBackoff
		}
		woke := in.waitForChange(ctx, w, dirs, wait, lc.Debounce, lc.MaxDebounce)
		if !woke {
			if w != nil {
				w.Close()
			}
			return nil
		}
		closeLater(w)
		if err := limiter.Wait(ctx); err != nil {
			return nil
		}
	}
}

// armAndInstall arms a watcher, then runs a pass: a change made between the
// pass and the wait is then seen by the watch (re-check after arming). When
// the pass wrote, it arms and checks once more, so the events of our own
// write do not wake the loop: only someone else's change does.
func (in *Installer) armAndInstall() (*fsnotify.Watcher, []string, Result, error) {
	var total Result
	for attempt := 0; ; attempt++ {
		w, dirs, err := in.arm()
		if err != nil {
			in.log.Error("cannot watch CNI dirs; retrying", "err", err)
		}
		res, perr := in.Install()
		res.Wrote = append(total.Wrote, res.Wrote...)
		res.Reverted = res.Reverted || total.Reverted
		total = res
		if perr != nil || len(res.Wrote) == 0 || attempt == 1 || w == nil {
			return w, dirs, total, perr
		}
		closeLater(w)
	}
}

// closeLater closes a watcher the loop is done with, off the repair's path:
// closing an inotify instance took 2.5–16 ms here (the kernel frees its
// marks after a grace period), which the pass that follows a change waited
// for before (BenchmarkRepairLatency: 11–14 ms with a 2 ms debounce).
func closeLater(w *fsnotify.Watcher) {
	if w != nil {
		go w.Close()
	}
}

// arm creates a fresh watcher on the conf dir, the drop-in dir and the bin
// dirs. A new watcher each pass re-arms after renames replaced what we watched.
func (in *Installer) arm() (*fsnotify.Watcher, []string, error) {
	if err := os.MkdirAll(in.cfg.ConfDir, 0o755); err != nil {
		return nil, nil, err
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, nil, err
	}
	dirs := append([]string{in.cfg.ConfDir}, in.cfg.BinDirs...)
	if in.cfg.Mode == DropIn {
		if ents, err := os.ReadDir(in.cfg.ConfDir); err == nil {
			for _, e := range ents {
				if e.IsDir() {
					dirs = append(dirs, filepath.Join(in.cfg.ConfDir, e.Name()))
				}
			}
		}
	}
	var added []string
	for _, d := range dirs {
		if err := w.Add(d); err != nil {
			if os.IsNotExist(err) {
				continue
			}
			w.Close()
			return nil, nil, fmt.Errorf("watching %s: %w", d, err)
		}
		added = append(added, d)
	}
	return w, added, nil
}

// waitForChange blocks until a relevant event (then drains the burst for
// debounce), the timeout, or ctx's end. It returns false only on ctx's end.
func (in *Installer) waitForChange(ctx context.Context, w *fsnotify.Watcher, dirs []string, timeout, debounce, maxDebounce time.Duration) bool {
	var events <-chan fsnotify.Event
	var errs <-chan error
	if w != nil {
		events, errs = w.Events, w.Errors
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case err := <-errs:
			in.log.Warn("file watch error; re-arming", "err", err)
			return true
		case ev := <-events:
			if !in.relevant(ev, dirs) {
				continue
			}
			quiet := time.NewTimer(debounce)
			defer quiet.Stop()
			limit := time.After(maxDebounce)
			for {
				select {
				case <-ctx.Done():
					return false
				case <-events:
					quiet.Reset(debounce)
				case <-quiet.C:
					return true
				case <-limit:
					return true
				}
			}
		}
	}
}

func (in *Installer) relevant(ev fsnotify.Event, dirs []string) bool {
	name := filepath.Base(ev.Name)
	if strings.Contains(name, atomicfile.TempMarker) || ev.Op == fsnotify.Chmod {
		return false
	}
	dir := filepath.Dir(ev.Name)
	for _, b := range in.cfg.BinDirs {
		if dir == filepath.Clean(b) {
			return name == templates.PluginType
		}
	}
	for _, d := range dirs {
		if dir == filepath.Clean(d) {
			return true
		}
	}
	return false
}

func (in *Installer) warnFight(path string, n int, window time.Duration) {
	hint := "find the component that rewrites it (a primary CNI agent restarting in a loop, or one that owns the conf dir exclusively)"
	if strings.Contains(strings.ToLower(path), "cilium") {
		hint = "Cilium with cni.exclusive=true removes other plugins' config: set cni.exclusive=false"
	}
	in.log.Warn("another component keeps reverting nftcni's CNI config; nftcni re-adds its entry each time",
		"path", path, "reverts", n, "window", window.String(), "hint", hint)
}

// fightDetector counts reverts in a sliding window and says when to warn
// (at most once per window).
type fightDetector struct {
	threshold int
	window    time.Duration
	times     []time.Time
	warned    time.Time
}

func (f *fightDetector) revert(now time.Time) (int, bool) {
	f.times = append(f.times, now)
	for len(f.times) > 0 && now.Sub(f.times[0]) > f.window {
		f.times = f.times[1:]
	}
	if len(f.times) >= f.threshold && now.Sub(f.warned) > f.window {
		f.warned = now
		return len(f.times), true
	}
	return len(f.times), false
}

func skippedText(s []conflist.Skipped) string {
	var b strings.Builder
	for _, sk := range s {
		b.WriteString(sk.Path + ": " + sk.Err.Error() + "\n")
	}
	return b.String()
}
