package install

import (
	"fmt"
	"strconv"
	"strings"
)

// dropInsUnread says why the node's container runtime, as Kubernetes
// reports it (Node.status.nodeInfo.containerRuntimeVersion, for example
// "containerd://1.6.20"), never reads nftcni's drop-in: drop-ins are
// libcni v1.3's, which containerd vendors from 2.1 on (2.0 has 1.2.3, 1.7
// and 1.6 older). A runtime this cannot judge (empty, another runtime, a
// version it cannot parse) is given the benefit of the doubt: nil.
func dropInsUnread(runtime string) error {
	name, version, ok := strings.Cut(runtime, "://")
	if !ok || name != "containerd" {
		return nil
	}
	major, minor, ok := majorMinor(strings.TrimPrefix(version, "v"))
	if !ok || major > 2 || (major == 2 && minor >= 1) {
		return nil
	}
	return fmt.Errorf("the node's runtime is %s, which reads no CNI drop-ins (containerd reads them from 2.1, whose libcni is v1.3): nftcni would never run; use --mode owned or chained", runtime)
}

// majorMinor reads "2.1" from "2.1.0", "2.1.0-rc.1" or "2.1".
func majorMinor(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	maj, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(strings.TrimRightFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	return maj, mi, err1 == nil && err2 == nil
}
