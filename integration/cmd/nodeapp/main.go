// Command nodeapp is the node tests' workload. It reports what it reached
// so a test needs no kubectl exec:
//
//	nodeapp serve   HTTP on :8080 (/healthz for kubelet's probes, /probes:
//	                the last probe's source, /dial?addr=H:P: the first line
//	                the peer at H:P sends) and a banner "app:8081" on :8081
//	nodeapp check H:P  an init container's proof: exit 0 only if a
//	                connection to H:P lands on ztunnel's outbound port
//
// With LOOP=H:P, serve also connects to H:P every 20 ms and /loop reports
// "captured=N escaped=N failed=N": greeted by ztunnel, by the real server,
// or not at all; and "first_captured_ms=N", the time from the process's
// start to its first captured connection (-1: none yet).
//
// ztunnel's stand-in greets every connection with "ztunnel:<port> …".
package main

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	if len(os.Args) == 3 && os.Args[1] == "check" {
		line, err := firstLine(os.Args[2])
		if err != nil || !strings.HasPrefix(line, "ztunnel:15001") {
			fmt.Printf("NOT CAPTURED: %s -> %q %v\n", os.Args[2], line, err)
			os.Exit(1)
		}
		fmt.Printf("captured: %s -> %q\n", os.Args[2], line)
		return
	}
	if len(os.Args) != 2 || os.Args[1] != "serve" {
		fmt.Fprintln(os.Stderr, "usage: nodeapp serve | nodeapp check HOST:PORT")
		os.Exit(2)
	}
	go banner()
	var captured, escaped, failed atomic.Int64
	var firstCaptured atomic.Int64
	firstCaptured.Store(-1)
	start := time.Now()
	if addr := os.Getenv("LOOP"); addr != "" {
		go func() {
			for ; ; time.Sleep(20 * time.Millisecond) {
				line, _ := firstLine(addr)
				switch {
				case strings.HasPrefix(line, "ztunnel:"):
					if captured.Add(1) == 1 {
						firstCaptured.Store(time.Since(start).Milliseconds())
					}
				case line != "":
					escaped.Add(1)
				default:
					failed.Add(1)
				}
			}
		}()
	}
	http.HandleFunc("/loop", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "captured=%d escaped=%d failed=%d first_captured_ms=%d", captured.Load(), escaped.Load(), failed.Load(), firstCaptured.Load())
	})
	var mu sync.Mutex
	lastProbe := ""
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		lastProbe = r.RemoteAddr
		mu.Unlock()
		fmt.Fprintln(w, "ok")
	})
	http.HandleFunc("/probes", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprint(w, lastProbe)
	})
	http.HandleFunc("/dial", func(w http.ResponseWriter, r *http.Request) {
		line, err := firstLine(r.URL.Query().Get("addr"))
		if err != nil {
			fmt.Fprintf(w, "error: %v", err)
			return
		}
		fmt.Fprint(w, line)
	})
	fmt.Fprintln(os.Stderr, http.ListenAndServe(":8080", nil))
	os.Exit(1)
}

func firstLine(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func banner() {
	l, err := net.Listen("tcp", ":8081")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		fmt.Fprintln(c, "app:8081")
		c.Close()
	}
}
