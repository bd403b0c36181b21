package nft

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// freshNetns returns an fd of a new, empty network namespace with lo up
// (as a pod's is after the loopback plugin), without touching /var/run/netns.
func freshNetns(tb testing.TB) int {
	tb.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		tb.Fatal(err)
	}
	defer orig.Close()
	h, err := netns.New()
	if err != nil {
		tb.Fatal(err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic(err)
		}
	}()
	lo, err := vnl.LinkByName("lo")
	if err == nil {
		err = vnl.LinkSetUp(lo)
	}
	if err != nil {
		tb.Fatal(err)
	}
	return int(h)
}

// ambientIptables is the same ambient ruleset (IPv4 part) in Istio's
// iptables backend form (istio-cni iptables testdata default.golden).
const ambientIptables = `*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
*nat
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
*raw
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT
`

// BenchmarkApplyFresh compares, in one run and each into a fresh netns, our
// in-process add-only apply of the default ambient ruleset with the same
// ruleset applied the way Istio's two backends do it: `nft -f` and
// iptables-restore (nft and legacy variants), each exec'd into the netns.
// The external tools are skipped when not installed (`make bench` installs
// them). Compare ns/op across sub-benchmarks; hack/bench.sh prints ratios.
func BenchmarkApplyFresh(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
	dir := b.TempDir()
	nftFile := filepath.Join(dir, "ambient.nft")
	if err := os.WriteFile(nftFile, []byte(Render(rs.Tables...)), 0o644); err != nil {
		b.Fatal(err)
	}
	iptFile := filepath.Join(dir, "ambient.iptables")
	if err := os.WriteFile(iptFile, []byte(ambientIptables), 0o644); err != nil {
		b.Fatal(err)
	}
	run := func(name string, apply func(fd int) error) {
		b.Run(name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				fd := freshNetns(b)
				b.StartTimer()
				err := apply(fd)
				b.StopTimer()
				unix.Close(fd)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
	run("nftcni-netlink", func(fd int) error { return Apply(fd, rs) })
	b.Run("kernel-floor", func(b *testing.B) { benchKernelFloor(b, rs) })
	// What entering the netns and exec'ing a binary costs before any rule:
	// the part of the tools' time that is process start, not netfilter.
	run("exec-baseline", func(fd int) error { return execIn(fd, "true") })
	for _, tool := range []struct{ name, bin, file string }{
		{"nft-f", "nft", nftFile},
		{"iptables-nft-restore", "iptables-nft-restore", iptFile},
		{"iptables-legacy-restore", "iptables-legacy-restore", iptFile},
	} {
		if _, err := exec.LookPath(tool.bin); err != nil {
			b.Logf("%s not installed; skipped", tool.bin)
			continue
		}
		args := []string{"-f", tool.file}
		if tool.bin != "nft" {
			args = []string{"-w", "5", tool.file} // wait for the xtables lock like Istio does
		}
		run(tool.name, func(fd int) error { return execIn(fd, tool.bin, args...) })
	}
}

// benchKernelFloor times only the kernel's handling of the batch Apply sends
// into a fresh netns: the one sendmsg that carries it (netfilter processes a
// batch inside that call). No userspace tool can apply this ruleset faster,
// so it bounds every ratio above: nft -f over it is the best ratio possible.
func benchKernelFloor(b *testing.B, rs *Ruleset) {
	batch := capturedBatch(b, rs)
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		fd := freshNetns(b)
		nl, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: fd})
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		_, err = nl.SendMessages(batch)
		b.StopTimer()
		nl.Close() // the acks are not read; the table's presence is the check
		if err == nil {
			err = tablePresent(fd, rs.Tables[0].Name)
		}
		unix.Close(fd)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// capturedBatch returns the netlink messages (batch begin to end) that Apply
// sends for rs into a netns without our table, recorded by google/nftables'
// test dialer instead of a socket.
func capturedBatch(tb testing.TB, rs *Ruleset) []netlink.Message {
	var batch []netlink.Message
	ack := []netlink.Message{{Header: netlink.Header{Type: netlink.Error}, Data: make([]byte, 4)}}
	c, err := nftables.New(nftables.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		if len(req) == 0 { // a Receive: every message is acked
			return ack, nil
		}
		batch = append(batch, req...)
		return nil, nil
	}))
	if err == nil {
		err = stage(c, rs)
	}
	if err == nil {
		err = c.Flush()
	}
	if err != nil {
		tb.Fatal(err)
	}
	for i := range batch { // let the real socket number them
		batch[i].Header.Sequence, batch[i].Header.PID = 0, 0
	}
	return batch
}

func tablePresent(fd int, name string) error {
	c, err := conn(fd)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	have, err := ourTables(c, []string{name})
	if err == nil && !have[name] {
		err = fmt.Errorf("table %s not created by the captured batch", name)
	}
	return err
}

// execIn runs a command inside the netns behind fd (nsenter reads it as
// /proc/self/fd/3), as a CNI plugin that execs nft or iptables would.
func execIn(fd int, bin string, args ...string) error {
	dup, err := unix.Dup(fd) // the File owns (and closes) the dup, never fd
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(dup), "netns")
	defer f.Close()
	cmd := exec.Command("nsenter", append([]string{"--net=/proc/self/fd/3", bin}, args...)...)
	cmd.ExtraFiles = []*os.File{f}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", bin, err, out)
	}
	return nil
}

// BenchmarkApply1000Concurrent programs the ambient ruleset into 1000 fresh
// pod netns with one goroutine per CPU and reports the wall time for all.
func BenchmarkApply1000Concurrent(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	const pods = 1000
	var wall []time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		fds := make([]int, pods)
		for j := range fds {
			fds[j] = freshNetns(b)
		}
		work := make(chan int, pods)
		for _, fd := range fds {
			work <- fd
		}
		close(work)
		rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		b.StartTimer()
		start := time.Now()
		for w := 0; w < runtime.GOMAXPROCS(0); w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for fd := range work {
					if err := Apply(fd, rs); err != nil {
						mu.Lock()
						firstErr = err
						mu.Unlock()
					}
				}
			}()
		}
		wg.Wait()
		wall = append(wall, time.Since(start))
		b.StopTimer()
		for _, fd := range fds {
			unix.Close(fd)
		}
		if firstErr != nil {
			b.Fatal(firstErr)
		}
		b.StartTimer()
	}
	sort.Slice(wall, func(i, j int) bool { return wall[i] < wall[j] })
	b.ReportMetric(wall[len(wall)/2].Seconds(), "s/1000pods")
	b.ReportMetric(float64(wall[len(wall)/2].Microseconds())/pods, "µs/pod")
}
