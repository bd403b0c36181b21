// Command ztunnel-gate is the least an ambient CNI can do on a node: hold
// a mesh pod's ADD until ztunnel is connected. The reboot benchmark runs it
// as the machine's bound beside nftcni. Not part of the product.
//
// As a chained CNI plugin (CNI_COMMAND set) its ADD, for a pod in the
// entry's "namespace", waits until the entry's "gate" file exists (up to
// "wait_seconds"), then hands prevResult back; every other call does
// nothing. It captures nothing and tells ztunnel nothing of the pod.
//
// As "ztunnel-gate serve SOCKET GATE" it is the ZDS end ztunnel connects
// to, started with the node's services: it answers ztunnel's hello with an
// empty snapshot and creates GATE once ztunnel has acked it.
package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tidwall/gjson"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

// poll is how often a held ADD looks for the gate file.
const poll = 100 * time.Millisecond

func main() {
	if len(os.Args) == 4 && os.Args[1] == "serve" {
		if err := serve(os.Args[2], os.Args[3]); err != nil {
			fmt.Fprintln(os.Stderr, "ztunnel-gate:", err)
			os.Exit(1)
		}
		return
	}
	switch os.Getenv("CNI_COMMAND") {
	case "VERSION":
		os.Stdout.WriteString(`{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}` + "\n")
	case "ADD":
		in, _ := io.ReadAll(os.Stdin)
		conf := gjson.ParseBytes(in)
		if conf.Get("namespace").String() == podNamespace() && !await(conf.Get("gate").String(), conf.Get("wait_seconds").Float()) {
			fmt.Printf(`{"cniVersion":%q,"code":11,"msg":"ztunnel-gate: no ztunnel connected"}`+"\n", conf.Get("cniVersion").String())
			os.Exit(1)
		}
		if prev := conf.Get("prevResult"); prev.Exists() {
			os.Stdout.WriteString(prev.Raw + "\n")
		}
	}
}

// podNamespace is K8S_POD_NAMESPACE from CNI_ARGS.
func podNamespace() string {
	for _, kv := range strings.Split(os.Getenv("CNI_ARGS"), ";") {
		if v, ok := strings.CutPrefix(kv, "K8S_POD_NAMESPACE="); ok {
			return v
		}
	}
	return ""
}

// await waits up to seconds for path to exist.
func await(path string, seconds float64) bool {
	for deadline := time.Now().Add(time.Duration(seconds * float64(time.Second))); ; time.Sleep(poll) {
		if _, err := os.Stat(path); err == nil {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// serve accepts ztunnel's connections on socket for good, opening the gate
// at the first one that acks its snapshot.
func serve(socket, gate string) error {
	if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
		return err
	}
	_ = os.Remove(socket) // a dead one of the previous variant
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return err
	}
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return err
		}
		go func() {
			defer c.Close()
			if err := greet(c); err != nil {
				fmt.Fprintln(os.Stderr, "ztunnel-gate:", err)
				return
			}
			if err := os.MkdirAll(filepath.Dir(gate), 0o755); err != nil {
				fmt.Fprintln(os.Stderr, "ztunnel-gate:", err)
				return
			}
			if err := os.WriteFile(gate, nil, 0o644); err != nil {
				fmt.Fprintln(os.Stderr, "ztunnel-gate:", err)
				return
			}
			_, _ = io.Copy(io.Discard, c) // until ztunnel hangs up
		}()
	}
}

// greet reads ztunnel's hello, sends an empty snapshot and reads its ack.
func greet(c *net.UnixConn) error {
	buf := make([]byte, 1024)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	var hello zdsapi.ZdsHello
	if err := proto.Unmarshal(buf[:n], &hello); err != nil {
		return fmt.Errorf("ztunnel's hello: %w", err)
	}
	snap, err := proto.Marshal(&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}})
	if err != nil {
		return err
	}
	if _, err := c.Write(snap); err != nil {
		return err
	}
	if n, err = c.Read(buf); err != nil {
		return err
	}
	var ack zdsapi.WorkloadResponse
	if err := proto.Unmarshal(buf[:n], &ack); err != nil || ack.GetAck() == nil || ack.GetAck().GetError() != "" {
		return fmt.Errorf("ztunnel's answer to the snapshot: %v %v", &ack, err)
	}
	return nil
}
