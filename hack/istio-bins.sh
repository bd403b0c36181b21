#!/usr/bin/env bash
# Builds Istio's CNI node agent (install-cni) and plugin (istio-cni) from the
# Go module proxy into a cache dir, once: `make bench` measures them through
# the same libcni harness as nftcni. Their source is built, never copied.
# Usage: hack/istio-bins.sh DIR   (DIR/install-cni and DIR/istio-cni appear)
set -euo pipefail
out=${1:?usage: $0 DIR}
# The commit the anchor figures were measured at, as go.mod pins it (the
# conformance suite reads Istio's test data from the same module version).
ISTIO_VERSION=$(cd "$(dirname "$0")/.." && go list -m -f '{{.Version}}' istio.io/istio)
[ -x "$out/install-cni" ] && [ -x "$out/istio-cni" ] && exit 0
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CGO_ENABLED=0 GOFLAGS=-mod=mod
cd "$work"
go mod init nftcni.local/istio >/dev/null 2>&1
printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "istio.io/istio/cni/cmd/install-cni"\n\t_ "istio.io/istio/cni/cmd/istio-cni"\n)\n' >tools.go
go mod edit -require=istio.io/istio@$ISTIO_VERSION
go mod tidy >/dev/null 2>&1
# Built as Istio's image builds them: static, not stripped.
for b in install-cni istio-cni; do
	go build -trimpath -o "$out/$b.tmp" istio.io/istio/cni/cmd/$b
	mv "$out/$b.tmp" "$out/$b"
done
