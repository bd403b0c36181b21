package plugin

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// run calls Main as a runtime would and returns its exit status and stdout.
func run(t *testing.T, vars map[string]string, stdin string) (int, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := New().Main(env(vars), strings.NewReader(stdin), &out, &errOut)
	return code, out.String()
}

func TestVersion(t *testing.T) {
	code, out := run(t, map[string]string{"CNI_COMMAND": "VERSION"}, "")
	var v struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &v) != nil || v.CNIVersion != "1.1.0" ||
		strings.Join(v.SupportedVersions, ",") != strings.Join(supportedVersions[:], ",") {
		t.Errorf("VERSION: %d %q", code, out)
	}
}

// The checks skel makes, answered as CNI errors on stdout with exit 1.
func TestCallingConventionErrors(t *testing.T) {
	conf := func(v string) string { return `{"cniVersion":"` + v + `","name":"net","type":"nftcni"}` }
	add := map[string]string{"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/x", "CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin"}
	with := func(k, v string) map[string]string {
		m := map[string]string{}
		for a, b := range add {
			m[a] = b
		}
		m[k] = v
		return m
	}
	for _, tc := range []struct {
		name  string
		vars  map[string]string
		stdin string
		code  int
		msg   string
	}{
		{"missing netns", with("CNI_NETNS", ""), conf("1.0.0"), 4, "required env variables [CNI_NETNS] missing"},
		{"bad container id", with("CNI_CONTAINERID", "-x/y"), conf("1.0.0"), 4, "invalid characters in containerID"},
		{"long ifname", with("CNI_IFNAME", "a-very-long-ifname0"), conf("1.0.0"), 4, "interface name is too long"},
		{"no name", add, `{"cniVersion":"1.0.0"}`, 7, "missing network name"},
		{"bad json", add, `{`, 6, "error unmarshall network config"},
		{"old version", add, conf("0.2.0"), 1, "incompatible CNI versions"},
		{"check before 0.4.0", with("CNI_COMMAND", "CHECK"), conf("0.3.1"), 1, "config version does not allow CHECK"},
		{"status before 1.1.0", map[string]string{"CNI_COMMAND": "STATUS", "CNI_PATH": "/p"}, conf("1.0.0"), 1, "config version does not allow STATUS"},
		{"unknown verb", with("CNI_COMMAND", "REBOOT"), conf("1.0.0"), 4, "unknown CNI_COMMAND: REBOOT"},
	} {
		code, out := run(t, tc.vars, tc.stdin)
		var e struct {
			CNIVersion string `json:"cniVersion"`
			Code       int    `json:"code"`
			Msg        string `json:"msg"`
		}
		if code != 1 || json.Unmarshal([]byte(out), &e) != nil || e.Code != tc.code || !strings.Contains(e.Msg, tc.msg) || e.CNIVersion == "" {
			t.Errorf("%s: exit %d, %s; want code %d %q", tc.name, code, out, tc.code, tc.msg)
		}
	}
}

// ADD hands prevResult back byte for byte, whatever its formatting.
func TestAddEchoesPrevResult(t *testing.T) {
	vars := map[string]string{"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/proc/self/ns/net", "CNI_IFNAME": "eth0", "CNI_PATH": "/p"}
	prevResult := `{"cniVersion":"0.4.0",   "ips":[{"version":"4","address":"10.1.0.2/24"}],"dns":{}}`
	code, out := run(t, vars, `{"cniVersion":"0.4.0","name":"net","type":"nftcni","prevResult":`+prevResult+`}`)
	if code != 0 || out != prevResult+"\n" {
		t.Errorf("ADD: exit %d, %q; want prevResult unchanged", code, out)
	}
}

func TestValidName(t *testing.T) {
	for s, want := range map[string]bool{"abc": true, "a.b_c-1": true, "0x": true, "": false, "-a": false, ".a": false, "a/b": false, "a b": false} {
		if validName(s) != want {
			t.Errorf("validName(%q) = %v", s, !want)
		}
	}
}
