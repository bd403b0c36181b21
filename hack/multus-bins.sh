#!/usr/bin/env bash
# Builds Multus's thin plugin (the multus CNI binary that delegates to a
# pod's networks) from the Go module proxy into a cache dir, once: the
# Multus node test runs nftcni's standalone network through it, as
# OpenShift does. Its source is built, never copied.
# Usage: hack/multus-bins.sh DIR   (DIR/multus appears)
set -euo pipefail
out=${1:?usage: $0 DIR}
MULTUS_VERSION=v4.2.2
[ -x "$out/multus" ] && exit 0
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
cd "$work"
go mod init nftcni.local/multus >/dev/null 2>&1
printf '//go:build tools\n\npackage tools\n\nimport _ "gopkg.in/k8snetworkplumbingwg/multus-cni.v4/cmd/multus"\n' >tools.go
# The proxy serves this version but lists none, so it is required exactly.
go mod edit -require=gopkg.in/k8snetworkplumbingwg/multus-cni.v4@$MULTUS_VERSION
go mod tidy >/dev/null 2>&1
go build -trimpath -ldflags '-s -w' -o "$out/multus.tmp" gopkg.in/k8snetworkplumbingwg/multus-cni.v4/cmd/multus
mv "$out/multus.tmp" "$out/multus"
