package install

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// BenchmarkInstallPass is one full install pass onto a freshly rewritten
// primary config: binary check, parse, patch, atomic write with fsync.
func BenchmarkInstallPass(b *testing.B) {
	n, in, orig := benchNode(b)
	if _, err := in.Install(); err != nil { // the binary, once
		b.Fatal(err)
	}
	p := filepath.Join(n.conf, "10-calico.conflist")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		if err := os.WriteFile(p, orig, 0o644); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if res, err := in.Install(); err != nil || len(res.Wrote) != 1 {
			b.Fatalf("wrote %v err %v", res.Wrote, err)
		}
	}
}

// BenchmarkInstallNoop is a pass over a correct install (what every
// wake-up costs when nothing needs doing).
func BenchmarkInstallNoop(b *testing.B) {
	_, in, _ := benchNode(b)
	if _, err := in.Install(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if res, err := in.Install(); err != nil || len(res.Wrote) != 0 {
			b.Fatalf("wrote %v err %v", res.Wrote, err)
		}
	}
}

// BenchmarkRepairLatency measures the time from another writer replacing
// the primary config to our entry being back (rate limiting lifted: it
// only matters in a fight), with the agent's default debounce and with
// the 10 ms it had before (a shell loop over -count 1 interleaves them).
func BenchmarkRepairLatency(b *testing.B) {
	for _, debounce := range []time.Duration{DefaultLoopConfig().Debounce, 10 * time.Millisecond} {
		b.Run("debounce="+debounce.String(), func(b *testing.B) { benchRepair(b, debounce) })
	}
}

func benchRepair(b *testing.B, debounce time.Duration) {
	n, in, orig := benchNode(b)
	lc := DefaultLoopConfig()
	lc.RepairRate, lc.RepairBurst = rate.Inf, 1
	lc.Debounce = debounce
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = in.Run(ctx, lc, nil, nil); close(done) }()
	defer func() { cancel(); <-done }()
	for !validInstall(n, "10-calico.conflist", in.cfg.Entry) {
		time.Sleep(time.Millisecond)
	}
	p := filepath.Join(n.conf, "10-calico.conflist")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := os.WriteFile(p, orig, 0o644); err != nil {
			b.Fatal(err)
		}
		for !validInstall(n, "10-calico.conflist", in.cfg.Entry) {
			time.Sleep(200 * time.Microsecond)
		}
	}
}

func benchNode(b *testing.B) (*node, *Installer, []byte) {
	n := newNode(b)
	if err := os.WriteFile(n.plugin, make([]byte, 4<<20), 0o755); err != nil { // plugin-sized
		b.Fatal(err)
	}
	orig, err := os.ReadFile(filepath.Join(corpusDir, "10-calico.conflist"))
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.conf, "10-calico.conflist"), orig, 0o644); err != nil {
		b.Fatal(err)
	}
	return n, n.installer(b, Chained, ""), orig
}
