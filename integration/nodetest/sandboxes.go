package nodetest

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// RemovePodSandboxes waits until containerd has stopped every pod sandbox
// of namespace ns (its containers killed, the CNI DEL run, its netns
// removed), then removes them as the kubelet's garbage collector would
// within its minute. It returns how long the stopping took from the call.
//
// The API server forgets a force-deleted pod at once, and the kubelet
// stops it after: work that, unwaited for, falls into whatever the test
// times next. The removal is the rest of a pod's cost on the node
// (containers, snapshots, and containerd's second CNI DEL, with no netns),
// which the kubelet would otherwise do at some later minute.
func (n *Node) RemovePodSandboxes(ns string, limit time.Duration) (time.Duration, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	// The node's socket by its init's root: a reboot makes a new init.
	conn, err := grpc.NewClient("unix://"+n.Path(containerdSock), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	filter := &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"io.kubernetes.pod.namespace": ns}}
	stopped := map[string]bool{} // sandbox ID -> stopped, its netns gone
	for {
		busy := 0
		l, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: filter})
		if err == nil {
			busy, err = stopping(ctx, rt, l.Items, stopped)
		}
		if err == nil && busy == 0 {
			return time.Since(start), removeSandboxes(ctx, rt, l.Items)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), fmt.Errorf("%d pod sandboxes of %s not stopped within %v (last error: %v)", busy, ns, limit, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// stopping counts the sandboxes containerd is still stopping, noting in
// stopped those it is done with (their verbose status is asked once).
func stopping(ctx context.Context, rt runtimeapi.RuntimeServiceClient, sandboxes []*runtimeapi.PodSandbox, stopped map[string]bool) (int, error) {
	busy := 0
	for _, s := range sandboxes {
		if !stopped[s.Id] {
			done, err := sandboxStopped(ctx, rt, s)
			if err != nil {
				return busy, err
			}
			stopped[s.Id] = done
		}
		if !stopped[s.Id] {
			busy++
		}
	}
	return busy, nil
}

// sandboxStopped says whether containerd is done stopping s: not ready,
// and its network torn down. containerd marks a sandbox not ready when
// its pause process exits, before it runs the CNI DEL and removes the
// netns; its verbose status says when the netns is gone.
func sandboxStopped(ctx context.Context, rt runtimeapi.RuntimeServiceClient, s *runtimeapi.PodSandbox) (bool, error) {
	if s.State == runtimeapi.PodSandboxState_SANDBOX_READY {
		return false, nil
	}
	st, err := rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: s.Id, Verbose: true})
	if err != nil {
		return false, err
	}
	if st.Status.GetLinux().GetNamespaces().GetOptions().GetNetwork() == runtimeapi.NamespaceMode_NODE {
		return true, nil // no netns of its own
	}
	var info struct {
		NetNSClosed bool `json:"netNamespaceClosed"`
	}
	if err := json.Unmarshal([]byte(st.Info["info"]), &info); err != nil {
		return false, fmt.Errorf("containerd's verbose status of sandbox %s: %w", s.Id, err)
	}
	return info.NetNSClosed, nil
}

// removeSandboxes removes every sandbox of sandboxes, again while one
// fails: the kubelet removes a dead sandbox's containers itself meanwhile,
// and containerd refuses a container already being removed.
func removeSandboxes(ctx context.Context, rt runtimeapi.RuntimeServiceClient, sandboxes []*runtimeapi.PodSandbox) error {
	for {
		var left []*runtimeapi.PodSandbox
		var err error
		for _, s := range sandboxes {
			if _, err = rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
				left = append(left, s)
			}
		}
		if len(left) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d pod sandboxes not removed, as %s's: %w", len(left), left[0].Metadata.GetName(), err)
		case <-time.After(100 * time.Millisecond):
		}
		sandboxes = left
	}
}
