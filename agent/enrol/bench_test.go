package enrol

import (
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/agent/hostprobe"
	"github.com/nftcni/nftcni/agent/records"
	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/plugin/wire"
)

// BenchmarkCompletion times the agent's own steps of an ambient ADD beside
// the plugin's rules and ztunnel's ack: the pod's IPs into the host probe
// set (one netlink batch over the connection kept in the host netns) and
// its record (a file written and renamed, in a directory on a tmpfs as the
// run dir is on a node's /run: its fsyncs cost nothing there, a journal
// commit each on this machine's ext4 /tmp). Reported: medians in ms, each
// step and both.
func BenchmarkCompletion(b *testing.B) {
	testnet.RequireRoot(b)
	host := testnet.NewNS(b, "nftcomp")
	f, err := os.Open(host.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	tb, err := hostprobe.Open(f, capture.HostSpec{IPv6: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	defer tb.Close()
	if _, err := tb.Assert(nil, false); err != nil {
		b.Fatal(err)
	}
	dir, err := os.MkdirTemp("/dev/shm", "nftcni-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	recs, err := records.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	var probe, record, both []time.Duration
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		uid := fmt.Sprintf("uid-%d", i)
		ips := []netip.Addr{netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}), netip.MustParseAddr(fmt.Sprintf("fd00::9:%x", i))}
		r := &records.Record{Pod: wire.Pod{Namespace: "ns", Name: uid, UID: uid,
			Attachment: wire.Attachment{ContainerID: "c-" + uid, IfName: "eth0"}}, UID: uid, Decision: &enablement.Decision{Mode: wire.ModeAmbient}}
		start := time.Now()
		err := tb.Add(uid, ips)
		mid := time.Now()
		if err == nil {
			err = recs.Save(r)
		}
		end := time.Now()
		if err != nil {
			b.Fatal(err)
		}
		probe, record, both = append(probe, mid.Sub(start)), append(record, end.Sub(mid)), append(both, end.Sub(start))
		if err := tb.Remove(uid, ips); err != nil {
			b.Fatal(err)
		}
		if err := recs.Drop(r.Pod.Attachment); err != nil {
			b.Fatal(err)
		}
	}
	median := func(s []time.Duration) float64 { slices.Sort(s); return float64(s[len(s)/2]) / 1e6 }
	b.ReportMetric(median(probe), "probe-ms-median")
	b.ReportMetric(median(record), "record-ms-median")
	b.ReportMetric(median(both), "completion-ms-median")
}
