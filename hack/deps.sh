#!/usr/bin/env bash
# Debian packages the tests, the demo and the benchmarks use, installed when
# missing (as root; otherwise it says what is missing). The product itself
# never runs any of them:
#   make, iproute2     build, and network namespaces for tests
#   nftables, iptables read rules back in tests; prove coexistence; compare in benchmarks
#   containerd, runc   containerd 1.6's CRI runs pods through nftcni in tests
#   util-linux         nsenter, to run a test containerd inside a test netns
set -euo pipefail
need=()
for p in make:make ip:iproute2 nft:nftables iptables-legacy:iptables containerd:containerd runc:runc nsenter:util-linux; do
	command -v "${p%%:*}" >/dev/null || need+=("${p#*:}")
done
[ "${#need[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
	echo "missing Debian packages (install as root): ${need[*]}" >&2
	exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}"
