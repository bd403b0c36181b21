package readiness

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestParseTaint(t *testing.T) {
	for in, want := range map[string]corev1.Taint{
		DefaultTaint:                     {Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule},
		"example.com/cni=wait:NoExecute": {Key: "example.com/cni", Value: "wait", Effect: corev1.TaintEffectNoExecute},
	} {
		got, err := ParseTaint(in)
		if err != nil || *got != want {
			t.Errorf("ParseTaint(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"no-effect", ":NoSchedule", "k:Sometimes"} {
		if _, err := ParseTaint(bad); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("ParseTaint(%q): %v, want an error naming it", bad, err)
		}
	}
}
