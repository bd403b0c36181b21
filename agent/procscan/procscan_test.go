package procscan

import (
	"testing"
)

func TestUIDFromCgroup(t *testing.T) {
	const uid = "0c4f9a11-2b3c-4d5e-8f90-a1b2c3d4e5f6"
	for name, text := range map[string]string{
		"v1 cgroupfs":            "12:pids:/kubepods/besteffort/pod" + uid + "/8e1f0c\n11:memory:/kubepods/besteffort/pod" + uid + "/8e1f0c\n",
		"v1 systemd":             "4:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0c4f9a11_2b3c_4d5e_8f90_a1b2c3d4e5f6.slice/cri-containerd-8e1f.scope\n",
		"v2 systemd crio":        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0c4f9a11_2b3c_4d5e_8f90_a1b2c3d4e5f6.slice/crio-8e1f.scope\n",
		"v2 cgroupfs guaranteed": "0::/kubepods/pod" + uid + "/8e1f0c\n",
		"k3s":                    "0::/kubepods/besteffort/pod" + uid + "/8e1f0c\n",
	} {
		if got := UIDFromCgroup(text); got != uid {
			t.Errorf("%s: %q, want %q", name, got, uid)
		}
	}
	for _, text := range []string{"0::/\n", "0::/system.slice/containerd.service\n", "4:memory:/user.slice/pod" + uid + "\n", ""} {
		if got := UIDFromCgroup(text); got != "" {
			t.Errorf("%q: found %q in a non-pod cgroup", text, got)
		}
	}
}
