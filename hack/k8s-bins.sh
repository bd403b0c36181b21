#!/usr/bin/env bash
# Builds etcd and the Kubernetes components from the Go module proxy into a
# cache dir, once: the integration tests run a real API server with them,
# and the node tests a whole one-node cluster (kubelet, controller manager,
# scheduler).
# Usage: hack/k8s-bins.sh DIR   (DIR/etcd, DIR/kube-apiserver, DIR/kubelet,
# DIR/kube-controller-manager and DIR/kube-scheduler appear)
set -euo pipefail
out=${1:?usage: $0 DIR}
ETCD_VERSION=v3.6.16
K8S_VERSION=v1.37.2
STAGING_VERSION=v0.37.2
K8S_CMDS="kube-apiserver kubelet kube-controller-manager kube-scheduler"
done=1
for b in etcd $K8S_CMDS; do [ -x "$out/$b" ] || done=0; done
[ $done = 1 ] && exit 0
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod

# etcd's server module has replace directives, so `go install pkg@v` is
# refused: build it from a scratch module that requires its five modules.
mkdir -p "$work/etcd" && cd "$work/etcd"
go mod init nftcni.local/etcd >/dev/null 2>&1
printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >tools.go
args=()
for m in server api client/pkg client pkg; do args+=("-require=go.etcd.io/etcd/$m/v3@$ETCD_VERSION"); done
go mod edit "${args[@]}"
go mod tidy >/dev/null 2>&1
if [ ! -x "$out/etcd" ]; then
	go build -trimpath -ldflags '-s -w' -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3
	mv "$out/etcd.tmp" "$out/etcd"
fi

# The Kubernetes commands: k8s.io/kubernetes with its staging modules
# replaced by their published versions, all from one module so the later
# commands reuse the API server's compiled packages.
mkdir -p "$work/k8s" && cd "$work/k8s"
go mod init nftcni.local/k8s >/dev/null 2>&1
go mod download k8s.io/kubernetes@$K8S_VERSION
kmod=$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/go.mod
{
	printf '//go:build tools\n\npackage tools\n\nimport (\n'
	for c in $K8S_CMDS; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c"; done
	printf ')\n'
} >tools.go
args=("-require=k8s.io/kubernetes@$K8S_VERSION")
for m in $(awk '/^\tk8s.io\/[a-z-]+ v0.0.0$/{print $1}' "$kmod"); do args+=("-replace=$m=$m@$STAGING_VERSION"); done
go mod edit "${args[@]}"
go mod tidy >/dev/null 2>&1
LDF="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
for c in $K8S_CMDS; do
	[ -x "$out/$c" ] && continue
	go build -trimpath -ldflags "-s -w $LDF" -o "$out/$c.tmp" "k8s.io/kubernetes/cmd/$c"
	mv "$out/$c.tmp" "$out/$c"
done
echo "built etcd $ETCD_VERSION and $K8S_CMDS $K8S_VERSION into $out"
