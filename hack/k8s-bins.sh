#!/usr/bin/env bash
# Builds etcd and kube-apiserver from the Go module proxy into a cache dir,
# once: the integration tests run a real API server with them.
# Usage: hack/k8s-bins.sh DIR   (DIR/etcd and DIR/kube-apiserver appear)
set -euo pipefail
out=${1:?usage: $0 DIR}
ETCD_VERSION=v3.6.16
K8S_VERSION=v1.37.2
STAGING_VERSION=v0.37.2
[ -x "$out/etcd" ] && [ -x "$out/kube-apiserver" ] && exit 0
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
go build -trimpath -ldflags '-s -w' -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3
mv "$out/etcd.tmp" "$out/etcd"

# kube-apiserver: k8s.io/kubernetes with its staging modules replaced by
# their published versions.
mkdir -p "$work/k8s" && cd "$work/k8s"
go mod init nftcni.local/k8s >/dev/null 2>&1
go mod download k8s.io/kubernetes@$K8S_VERSION
kmod=$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/go.mod
printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver"\n' >tools.go
args=("-require=k8s.io/kubernetes@$K8S_VERSION")
for m in $(awk '/^\tk8s.io\/[a-z-]+ v0.0.0$/{print $1}' "$kmod"); do args+=("-replace=$m=$m@$STAGING_VERSION"); done
go mod edit "${args[@]}"
go mod tidy >/dev/null 2>&1
LDF="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
go build -trimpath -ldflags "-s -w $LDF" -o "$out/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
mv "$out/kube-apiserver.tmp" "$out/kube-apiserver"
echo "built etcd $ETCD_VERSION and kube-apiserver $K8S_VERSION into $out"
