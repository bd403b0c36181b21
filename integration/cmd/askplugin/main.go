// Command askplugin is the least a chained CNI plugin written in Go can do
// that asks someone before it answers: nullplugin plus one round trip on a
// unix seqpacket socket (its config's "socket"), carrying the pod's netns
// as a descriptor and its namespace and name, and waiting for any answer. Benchmarks chain it to
// measure the floor under an ADD that must ask an agent, as nftcni's does
// for every pod it does not pass straight through: the pod's labels, which
// decide its enrolment, are not in anything the runtime hands a plugin.
package main

import (
	"io"
	"os"
	"strings"

	"github.com/tidwall/gjson"
	"golang.org/x/sys/unix"
)

func main() {
	if os.Getenv("CNI_COMMAND") == "VERSION" {
		os.Stdout.WriteString(`{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}` + "\n")
		return
	}
	in, _ := io.ReadAll(os.Stdin)
	prev := gjson.GetBytes(in, "prevResult")
	if os.Getenv("CNI_COMMAND") != "ADD" || !prev.Exists() {
		return
	}
	if err := ask(gjson.GetBytes(in, "socket").String(), os.Getenv("CNI_NETNS")); err != nil {
		os.Stdout.WriteString(`{"cniVersion":"1.1.0","code":999,"msg":` + string(gjson.AppendJSONString(nil, err.Error())) + "}\n")
		os.Exit(1)
	}
	os.Stdout.WriteString(prev.Raw + "\n")
}

// ask sends a 200-byte question (the pod's "namespace/name" from the
// runtime's CNI_ARGS, zero-padded) with the netns descriptor and reads the
// answer, on plain blocking calls.
func ask(path, netns string) error {
	ns, err := unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(ns)
	s, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	if err := unix.Connect(s, &unix.SockaddrUnix{Name: path}); err != nil {
		return err
	}
	var q [200]byte
	copy(q[:], podKey(os.Getenv("CNI_ARGS")))
	if err := unix.Sendmsg(s, q[:], unix.UnixRights(ns), nil, 0); err != nil {
		return err
	}
	var a [512]byte
	for {
		_, _, err = unix.Recvfrom(s, a[:], 0)
		if err != unix.EINTR {
			return err
		}
	}
}

// podKey is "K8S_POD_NAMESPACE/K8S_POD_NAME" from CNI_ARGS, or "" outside
// Kubernetes.
func podKey(args string) string {
	var ns, name string
	for _, kv := range strings.Split(args, ";") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "K8S_POD_NAMESPACE":
			ns = v
		case "K8S_POD_NAME":
			name = v
		}
	}
	if ns == "" || name == "" {
		return ""
	}
	return ns + "/" + name
}
