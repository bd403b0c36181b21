package capture

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/nft/nlsend"
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

// BenchmarkProgramFresh programs the default ambient ruleset (IPv4 and
// IPv6, DNS capture, policy routes) into a fresh netns every way there is,
// interleaved round by round so drift on the machine hits them alike, and
// reports each way's median in ms:
//
//   - kernel-floor: a minimal program of the step alone: the same Batch
//     bytes written with one sendto per socket on sockets already open in
//     the netns, and the one ack read back. No tool can program this ruleset
//     faster; every other figure is a ratio to it (hack/bench.sh).
//   - program-warm: nft.Program of a pre-encoded Batch in a warm process:
//     the agent's own path (late enrolment, repair), sockets included.
//   - program-cold: the plugin's path at ADD, without its exec: the first
//     call of a freshly exec'd process (this test binary re-run), timed
//     inside it, writes the Batch on netlink sockets it was handed, made in
//     the netns by another process (the agent does that; making them here
//     is not timed, as in kernel-floor).
//   - program-cold-own-sockets: nft.Program as that first call, sockets
//     and the netns switch included (the plugin's path when its agent
//     hands it no sockets).
//   - apply-warm: Encode then Program (a ruleset never seen before).
//   - nft-f, iptables-nft-restore, iptables-legacy-restore: the same
//     ruleset the way Istio's two backends apply it, each exec'd into the
//     netns; exec-baseline is nsenter+true, the part of those that is
//     process start. Tools not installed are skipped (make bench installs
//     them).
func BenchmarkProgramFresh(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	rs := Ambient(AmbientSpec{DNSCapture: true, IPv6: true})
	batch, err := nft.Encode(rs)
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	nftFile := filepath.Join(dir, "ambient.nft")
	if err := os.WriteFile(nftFile, []byte(nft.Render(rs.Tables...)), 0o644); err != nil {
		b.Fatal(err)
	}
	iptFile := filepath.Join(dir, "ambient.iptables")
	if err := os.WriteFile(iptFile, []byte(ambientIptables), 0o644); err != nil {
		b.Fatal(err)
	}
	batchFile := filepath.Join(dir, "batch.json")
	if raw, err := json.Marshal(batch); err != nil {
		b.Fatal(err)
	} else if err := os.WriteFile(batchFile, raw, 0o600); err != nil {
		b.Fatal(err)
	}
	type way struct {
		name string // iptables-* and exec-baseline make no table inet nftcni
		// run programs the netns behind fd and returns the time that counts.
		run func(fd int) (time.Duration, error)
	}
	timed := func(f func(fd int) error) func(fd int) (time.Duration, error) {
		return func(fd int) (time.Duration, error) {
			start := time.Now()
			err := f(fd)
			return time.Since(start), err
		}
	}
	ways := []way{
		{"kernel-floor", func(fd int) (time.Duration, error) { return kernelFloor(fd, batch) }},
		{"program-warm", timed(func(fd int) error { return nft.Program(fd, batch) })},
		{"program-cold", func(fd int) (time.Duration, error) { return coldProgram(fd, batchFile, true) }},
		{"program-cold-own-sockets", func(fd int) (time.Duration, error) { return coldProgram(fd, batchFile, false) }},
		{"apply-warm", timed(func(fd int) error { return nft.Apply(fd, rs) })},
		{"exec-baseline", timed(func(fd int) error { return execIn(fd, "true") })},
	}
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
		ways = append(ways, way{tool.name, timed(func(fd int) error { return execIn(fd, tool.bin, args...) })})
	}
	samples := map[string][]time.Duration{}
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		for j := range ways {
			w := ways[(i+j)%len(ways)]
			fd := freshNetns(b)
			took, err := w.run(fd)
			if err == nil && !strings.HasPrefix(w.name, "iptables") && w.name != "exec-baseline" {
				err = tablePresent(fd, rs.Tables[0].Name)
			}
			unix.Close(fd)
			if err != nil {
				b.Fatalf("%s: %v", w.name, err)
			}
			samples[w.name] = append(samples[w.name], took)
		}
	}
	for _, w := range ways {
		s := samples[w.name]
		slices.Sort(s)
		b.ReportMetric(float64(s[len(s)/2])/1e6, w.name+"-ms-median")
	}
	s := samples["program-warm"]
	b.ReportMetric(float64(s[len(s)/2]), "ns/op")
}

// kernelFloor opens one socket per protocol in the netns (not timed), then
// times the two sendto calls carrying batch and the read of each ack: the
// kernel's own work on the transaction and the routes, and nothing else.
func kernelFloor(fd int, batch *nft.Batch) (time.Duration, error) {
	socks, err := nlsend.Dial(fd, unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE)
	if err != nil {
		return 0, err
	}
	defer nlsend.CloseAll(socks)
	var buf [8192]byte
	start := time.Now()
	for i, msgs := range [][]byte{batch.Tables, batch.Routes} {
		if err := unix.Sendto(socks[i], msgs, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			return 0, err
		}
		n, _, err := unix.Recvfrom(socks[i], buf[:], 0)
		if err != nil {
			return 0, err
		}
		if n < unix.SizeofNlMsghdr+4 || binary.NativeEndian.Uint16(buf[4:]) != unix.NLMSG_ERROR {
			return 0, fmt.Errorf("socket %d: no ack", i)
		}
		if errno := unix.Errno(-int32(binary.NativeEndian.Uint32(buf[16:]))); errno != 0 {
			return 0, fmt.Errorf("socket %d: %w", i, errno)
		}
	}
	return time.Since(start), nil
}

// coldChildEnv makes this test binary, re-run, program the batch in the
// file it names into the netns on fd 3, or on the netlink sockets on fds 4
// and 5 (coldSocketsEnv), and print how long that took (TestMain).
const (
	coldChildEnv   = "NFTCNI_BENCH_COLD_PROGRAM"
	coldSocketsEnv = "NFTCNI_BENCH_COLD_SOCKETS" // set: fds 4 and 5 are netfilter and route sockets
)

// coldProgram re-runs this test binary to program the netns behind fd as
// the first thing a fresh process does, on sockets made here in that netns
// when handSockets, and returns the time the child took.
func coldProgram(fd int, batchFile string, handSockets bool) (time.Duration, error) {
	dup, err := unix.Dup(fd)
	if err != nil {
		return 0, err
	}
	files := []*os.File{os.NewFile(uintptr(dup), "netns")}
	if handSockets {
		socks, err := nlsend.Dial(fd, unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE)
		if err != nil {
			files[0].Close()
			return 0, err
		}
		for _, s := range socks {
			files = append(files, os.NewFile(uintptr(s), "netlink"))
		}
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), coldChildEnv+"="+batchFile)
	if handSockets {
		cmd.Env = append(cmd.Env, coldSocketsEnv+"=1")
	}
	cmd.ExtraFiles = files
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("cold child: %v: %s", err, out)
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("cold child said %q", out)
	}
	return time.Duration(ns), nil
}

// coldChild is the child's whole work: nothing of package nft has run in
// this process before the timed call but its package init.
func coldChild(batchFile string) int {
	raw, err := os.ReadFile(batchFile)
	var batch nft.Batch
	if err == nil {
		err = json.Unmarshal(raw, &batch)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var socks []int
	if os.Getenv(coldSocketsEnv) != "" { // what coldProgram handed over
		socks = []int{4, 5}
	}
	start := time.Now()
	if len(socks) > 0 {
		err = nlsend.ProgramOn(socks, &batch.Batch)
	} else {
		err = nft.Program(3, &batch)
	}
	took := time.Since(start)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(took.Nanoseconds())
	return 0
}

func tablePresent(fd int, name string) error {
	have, err := nft.HasTable(fd, name)
	if err == nil && !have {
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
					if err := nft.Apply(fd, rs); err != nil {
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
