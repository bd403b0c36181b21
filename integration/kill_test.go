package integration

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nftcni/nftcni/capture"
	"github.com/nftcni/nftcni/integration/kubetest"
	"github.com/nftcni/nftcni/internal/testnet"
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// netnsFDs counts the network namespace descriptors a process holds: the
// agent keeps one per pod it knows (and ZDS one per enrolled pod), so with
// no pods left it must hold none.
func netnsFDs(t *testing.T, pid int) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(dir + "/" + e.Name()); err == nil && strings.HasPrefix(l, "net:[") {
			n++
		}
	}
	return n
}

// The agent is SIGKILLed at a random moment during a burst of 50 pod ADDs,
// 20 times. The runtime's part is played as containerd does it: a failed
// ADD gets a DEL and its netns is removed. After the agent comes back,
// every pod is either fully enrolled (rules, annotation, probe entry,
// ztunnel) or not at all, and once the pods are gone the agent holds no
// netns descriptor.
func TestAgentKilledDuringAdds(t *testing.T) {
	const rounds, pods = 20, 50
	api := kubetest.Start(t)
	ctx := context.Background()
	cs := api.Client
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "burst",
		Labels: map[string]string{istio.LabelDataplaneMode: "ambient"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n := newAgentNode(t, 68, nil)
	args := []string{"--kubeconfig", api.Kubeconfig, "--node-name", "node-a"}
	cmd, z := n.start(t, args...)
	list := n.installed(t)
	hostFD := n.h.netns.FD
	rng := rand.New(rand.NewSource(1))

	for r := range rounds {
		type podRun struct {
			pod   *corev1.Pod
			netns *testnet.NS
			rt    *libcni.RuntimeConf
			err   error
		}
		runs := make([]*podRun, pods)
		for i := range runs {
			p, err := cs.CoreV1().Pods("burst").Create(ctx, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p" + strconv.Itoa(r) + "-" + strconv.Itoa(i)},
				Spec:       corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "c", Image: "c"}}}}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			ns := testnet.NewNS(t, "nftkill")
			rt := runtimeConf(ns, "burst", p.Name, nil)
			for j := range rt.Args {
				if rt.Args[j][0] == "K8S_POD_UID" {
					rt.Args[j][1] = string(p.UID)
				}
			}
			runs[i] = &podRun{pod: p, netns: ns, rt: rt}
		}
		// Let the informer see the pods first, as the scheduler binds a pod
		// well before its sandbox is made.
		time.Sleep(300 * time.Millisecond)
		// Kill once a random number of ADDs (0 to all) has completed, so
		// every round cuts the burst somewhere else.
		var wg sync.WaitGroup
		var mu sync.Mutex
		completed := 0
		for _, pr := range runs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, pr.err = n.add(list, pr.rt)
				mu.Lock()
				completed++
				mu.Unlock()
			}()
		}
		target := rng.Intn(pods + 1)
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			mu.Lock()
			c := completed
			mu.Unlock()
			if c >= target {
				break
			}
		}
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		wg.Wait()
		z.Close()
		var ok []*podRun
		for _, pr := range runs {
			if pr.err == nil {
				ok = append(ok, pr)
				continue
			}
			// containerd: DEL after a failed ADD, then the netns goes.
			if err := n.del(list, pr.rt); err != nil {
				t.Errorf("round %d: DEL after a failed ADD: %v", r, err)
			}
			testnet.IP(t, "netns", "del", pr.netns.Name)
		}

		cmd, z = n.start(t, args...)
		want := []string{}
		for _, pr := range ok {
			want = append(want, string(pr.pod.UID))
		}
		slices.Sort(want)
		eventually(t, fmt.Sprintf("round %d: annotations settle", r), func() bool {
			list, err := cs.CoreV1().Pods("burst").List(ctx, metav1.ListOptions{})
			if err != nil {
				return false
			}
			var annotated []string
			for _, p := range list.Items {
				if p.Annotations[istio.AnnRedirection] == "enabled" {
					annotated = append(annotated, string(p.UID))
				}
			}
			slices.Sort(annotated)
			return slices.Equal(annotated, want)
		})
		for _, pr := range ok {
			if err := nft.Verify(pr.netns.FD, capture.Ambient(capture.AmbientSpec{DNSCapture: true})); err != nil {
				t.Errorf("round %d: enrolled pod %s: %v", r, pr.pod.Name, err)
			}
		}
		members := probeMembers(t, hostFD)
		var inSet []string
		for _, m := range members {
			inSet = append(inSet, m.UID)
		}
		slices.Sort(inSet)
		if !slices.Equal(inSet, want) {
			t.Errorf("round %d: probe set holds %v, want %v", r, inSet, want)
		}
		got := z.UIDs()
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("round %d: ztunnel holds %d pods, want %d", r, len(got), len(want))
		}
		t.Logf("round %d: %d of %d ADDs completed before the kill", r, len(ok), pods)

		// Clean up the round through the agent, as the runtime would.
		delErrs := make([]error, len(ok))
		for i, pr := range ok {
			wg.Add(1)
			go func() { defer wg.Done(); delErrs[i] = n.del(list, pr.rt) }()
		}
		wg.Wait()
		for i, pr := range ok {
			if delErrs[i] != nil {
				t.Errorf("round %d: DEL: %v", r, delErrs[i])
			}
			testnet.IP(t, "netns", "del", pr.netns.Name)
		}
		for _, pr := range runs {
			_ = cs.CoreV1().Pods("burst").Delete(ctx, pr.pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		}
		// Every pod of the round is gone: the agent holds no netns.
		eventually(t, fmt.Sprintf("round %d: agent holds no netns", r), func() bool { return netnsFDs(t, cmd.Process.Pid) == 0 })
		if t.Failed() {
			return
		}
	}
}
