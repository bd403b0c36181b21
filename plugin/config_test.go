package plugin

import (
	"reflect"
	"strings"
	"testing"
)

const prev = `{"cniVersion":"1.0.0","interfaces":[{"name":"cni0"},{"name":"veth1"},{"name":"eth0","sandbox":"/var/run/netns/p"}],
 "ips":[{"interface":2,"address":"10.88.0.5/24","gateway":"10.88.0.1"},{"interface":0,"address":"10.88.0.1/24"},{"address":"fd00::5/64"}]}`

func TestParseConfig(t *testing.T) {
	c, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","type":"nftcni","exclude_namespaces":["kube-system"],
		"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"a":"b"}},"prevResult":` + prev + `}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.RunDir != DefaultRunDir || c.SocketPath() != DefaultRunDir+"/plugin.sock" || c.PodAnnotations["a"] != "b" || !reflect.DeepEqual(c.ExcludeNamespaces, []string{"kube-system"}) {
		t.Errorf("parsed %+v", c)
	}
	r := c.prevResult()
	if r == nil {
		t.Fatal("no prevResult")
	}
	// Only the sandbox interface's addresses, and ones with no interface.
	want := []string{"10.88.0.5/24", "fd00::5/64"}
	if got := podIPs(r, "eth0"); !reflect.DeepEqual(got, want) {
		t.Errorf("podIPs = %v, want %v", got, want)
	}

	for in, want := range map[string]string{
		`{`:                                "parsing network config",
		`{"cni_agent_run_dir":"relative"}`: "absolute path",
		`{"plugin_log_level":"loud"}`:      "plugin_log_level",
		`{"cniVersion":"1.0.0","prevResult":{"ips":"x"}}`: "prevResult",
		`[1]`:                                  "not a JSON object",
		`{"name":7}`:                           "name: want a string",
		`{"exclude_namespaces":"kube-system"}`: "exclude_namespaces: want a list of strings",
		`{"exclude_namespaces":[1]}`:           "exclude_namespaces: want a list of strings",
		`{"status_requires_agent":"yes"}`:      "status_requires_agent: want true or false",
		`{"agent_wait_seconds":"30"}`:          "agent_wait_seconds: want a number",
		`{"agent_wait_seconds":-1}`:            "agent_wait_seconds: want a number",
		`{"agent_wait_seconds":600}`:           "agent_wait_seconds: want a number",
		`{"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"a":1}}}`: "pod-annotations.a: want a string",
		`{"prevResult":[]}`: "prevResult: want an object",
	} {
		if _, err := ParseConfig([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%s) = %v, want %q", in, err, want)
		}
	}
}

// The plugin passes addresses on as the result gives them (the agent
// parses them); one on an interface the result does not list, or not the
// sandbox's, is not the pod's.
func TestPodIPsOutOfRangeInterface(t *testing.T) {
	c, err := ParseConfig([]byte(`{"prevResult":{"interfaces":[{"name":"eth0"},{"name":"veth1"}],"ips":[{"interface":7,"address":"10.0.0.1/24"},{"interface":-1,"address":"10.0.0.2/24"},{"interface":"0","address":"10.0.0.3/24"},{"interface":1,"address":"10.0.0.4/24"},{"interface":0,"address":"10.0.0.5/24"}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := podIPs(c.prevResult(), "eth0"); !reflect.DeepEqual(got, []string{"10.0.0.5/24"}) {
		t.Errorf("podIPs = %v, want only the address on eth0", got)
	}
}

func TestParseArgs(t *testing.T) {
	a, err := parseK8sArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u;FOO=bar")
	if err != nil || a.K8S_POD_NAMESPACE != "ns" || a.K8S_POD_NAME != "p" || a.K8S_POD_UID != "u" {
		t.Errorf("parseK8sArgs = %+v, %v", a, err)
	}
	// Unknown keys are tolerated even without IgnoreUnknown: runtimes add their own.
	if _, err := parseK8sArgs("K8S_POD_NAME=p;SOMETHING=else"); err != nil {
		t.Errorf("unknown key refused: %v", err)
	}
}

// FuzzParseConfig: any stdin parses or is refused with an error; a parsed
// config always has an absolute run dir and a usable prevResult.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","type":"nftcni","prevResult":` + prev + `}`))
	f.Add([]byte(`{"cniVersion":"0.3.1","name":"n","type":"nftcni","cni_agent_run_dir":"/run/x/../y","prevResult":{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.2/24"}]}}`))
	f.Add([]byte(`{"cniVersion":"1.1.0","cni.dev/valid-attachments":[{"containerID":"c","ifname":"eth0"}]}`))
	f.Add([]byte(`{"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"sidecar.istio.io/status":"{}"}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseConfig(b)
		if err != nil {
			return
		}
		if !strings.HasPrefix(c.RunDir, "/") {
			t.Fatalf("run dir %q", c.RunDir)
		}
		if r := c.prevResult(); r != nil {
			_ = podIPs(r, "eth0")
		}
	})
}
