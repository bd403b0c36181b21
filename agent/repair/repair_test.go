package repair

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func pod(restart corev1.RestartPolicy, st corev1.ContainerStatus) *corev1.Pod {
	st.Name = "istio-validation"
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec: corev1.PodSpec{RestartPolicy: restart}, Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{st}}}
}

func terminated(code int32, reason string) *corev1.ContainerStateTerminated {
	return &corev1.ContainerStateTerminated{ExitCode: code, Reason: reason}
}

func TestBroken(t *testing.T) {
	cfg := DefaultConfig()
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"crash-looping with 126 (Istio's case)", pod(corev1.RestartPolicyAlways, corev1.ContainerStatus{
			State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
			LastTerminationState: corev1.ContainerState{Terminated: terminated(126, "Error")}}), true},
		{"failed once, restartPolicy Never (istio#49210)", pod(corev1.RestartPolicyNever, corev1.ContainerStatus{
			State: corev1.ContainerState{Terminated: terminated(126, "Error")}}), true},
		{"failed once, will be retried", pod(corev1.RestartPolicyOnFailure, corev1.ContainerStatus{
			State: corev1.ContainerState{Terminated: terminated(126, "Error")}}), false},
		{"passed after failing", pod(corev1.RestartPolicyAlways, corev1.ContainerStatus{
			State:                corev1.ContainerState{Terminated: terminated(0, "Completed")},
			LastTerminationState: corev1.ContainerState{Terminated: terminated(126, "Error")}}), false},
		{"another exit code", pod(corev1.RestartPolicyNever, corev1.ContainerStatus{
			State: corev1.ContainerState{Terminated: terminated(1, "Error")}}), false},
	} {
		if got, why := Broken(cfg, tc.pod); got != tc.want {
			t.Errorf("%s: Broken = %v (%s), want %v", tc.name, got, why, tc.want)
		}
	}
	noSidecar := pod(corev1.RestartPolicyNever, corev1.ContainerStatus{State: corev1.ContainerState{Terminated: terminated(126, "Error")}})
	noSidecar.Annotations = nil
	if got, _ := Broken(cfg, noSidecar); got {
		t.Error("a pod without the sidecar annotation was judged broken")
	}
}
