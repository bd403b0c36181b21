#!/usr/bin/env bash
# make bench: every Go benchmark, then the comparisons as ratios measured in
# the same run. The comparison tools (nft, iptables-restore) and containerd
# come from hack/deps.sh (make deps); the product itself never runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp)
trap 'rm -f "$out"' EXIT
go test -run '^$' -bench . -benchmem -count=1 ./conflist ./agent/install | tee -a "$out"
# Rule programming: fixed iteration counts keep the fresh-netns churn bounded.
go test -run '^$' -bench 'ApplyFresh' -benchtime 300x -count=1 ./nft | tee -a "$out"
go test -run '^$' -bench 'Apply1000Concurrent' -benchtime 3x -count=1 ./nft | tee -a "$out"
# CNI ADD through libcni with the reference plugins: what nftcni adds.
go test -run '^$' -bench 'CNIAdd' -benchtime 100x -count=1 ./integration | tee -a "$out"
# Pod sandboxes through containerd's CRI (1.6 and 2.x), with and without nftcni.
go test -run '^$' -bench 'RunPodSandbox' -benchtime 60x -count=1 -timeout 30m ./integration | tee -a "$out"
# The agent with 500 enrolled pods: enrolment throughput, restart, memory.
go test -run '^$' -bench 'AgentRestart500' -benchtime 3x -count=1 -timeout 30m ./integration | tee -a "$out"

ns() { awk -v n="$1" '$1 ~ n {for (i=1;i<=NF;i++) if ($(i+1)=="ns/op") {print $i; exit}}' "$out"; }
ratio() { # name-of-comparison name-of-ours
	local a b; a=$(ns "$1"); b=$(ns "$2")
	[ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" -v x="$1" -v y="$2" 'BEGIN {printf "  %-45s %8.2f ms vs %6.2f ms  = %5.1fx\n", x" / "y, a/1e6, b/1e6, a/b}'
	return 0
}
echo
echo "== ratios (same run)"
ratio 'BenchmarkApplyFresh/nft-f' 'BenchmarkApplyFresh/nftcni-netlink'
ratio 'BenchmarkApplyFresh/iptables-nft-restore' 'BenchmarkApplyFresh/nftcni-netlink'
ratio 'BenchmarkApplyFresh/iptables-legacy-restore' 'BenchmarkApplyFresh/nftcni-netlink'
ratio 'BenchmarkApplyFresh/nft-f' 'BenchmarkApplyFresh/kernel-floor'
[ -n "$(ns 'BenchmarkApplyFresh/kernel-floor')" ] && echo "  (kernel-floor: the kernel handling the same batch, its sendmsg alone; no tool can be faster, so that line is the best ratio possible)"
ratio 'BenchmarkInsertMapRoundTrip' 'BenchmarkInsert-'
b=$(ns 'BenchmarkApplyFresh/exec-baseline'); [ -n "$b" ] && awk -v b="$b" 'BEGIN {printf "  (nsenter+exec of true, part of every tool figure: %.2f ms)\n", b/1e6}'
grep -E 's/1000pods' "$out" | awk '{for (i=1;i<=NF;i++) if ($(i+1)=="s/1000pods") printf "  1000 pod netns programmed concurrently: %s s\n", $i}'
metric() { awk -v m="$1" '/^BenchmarkCNIAdd/ {for (i=1;i<=NF;i++) if ($(i+1)==m) {print $i; exit}}' "$out"; }
if [ -n "$(metric primary-ms-median)" ]; then
	echo "  CNI ADD, loopback+bridge+host-local via libcni (ms, median / p90):"
	printf "    %-34s %6.2f / %6.2f\n" "primary chain alone" "$(metric primary-ms-median)" "$(metric primary-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, pod outside the mesh" "$(metric plain-ms-median)" "$(metric plain-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, enrolled (ambient)" "$(metric enrolled-ms-median)" "$(metric enrolled-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "added by nftcni, enrolled" "$(metric added-enrolled-ms-median)" "$(metric added-enrolled-ms-p90)"
	printf "    %-34s %6.2f\n" "added by nftcni, not enrolled" "$(metric added-plain-ms-median)"
	printf "    %-34s %6.2f\n" "added by nftcni, excluded namespace" "$(metric added-excluded-ms-median)"
	printf "    %-34s %6.2f\n" "added by reference tuning (no-op)" "$(metric added-tuning-ms-median)"
	printf "    %-34s %6.2f\n" "nftcni beyond a no-op plugin, enrolled" "$(metric own-enrolled-ms-median)"
	printf "    %-34s %6.2f\n" "nftcni beyond a no-op plugin, not enrolled" "$(metric own-plain-ms-median)"
	printf "    %-34s %6.2f\n" "exec of nftcni for VERSION (floor)" "$(metric exec-ms-median)"
fi
printf "  plugin binary (static, stripped): %s bytes\n" "$(stat -c %s bin/nftcni)"
am() { awk -v m="$1" '/^BenchmarkAgentRestart500/ {for (i=1;i<=NF;i++) if ($(i+1)==m) {print $i; exit}}' "$out"; }
if [ -n "$(am s/restart-500pods)" ]; then
	echo "  agent with 500 enrolled pods (agent process, static pod source, test ztunnel):"
	printf "    %-44s %8s\n" "enrolment through libcni, 8 at a time (pods/s)" "$(am pods/s-enrol)"
	printf "    %-44s %8s\n" "restart to ready, all 500 restored (s)" "$(am s/restart-500pods)"
	printf "    %-44s %8s\n" "agent RSS with 500 pods (MB)" "$(am MB-rss-500pods)"
	printf "    %-44s %8s\n" "agent RSS after the restart (MB)" "$(am MB-rss-after-restart)"
fi
for gen in containerd-1.6 containerd-2; do
	cm() { awk -v g="BenchmarkRunPodSandbox/$gen-" -v m="$1" 'index($1, g) == 1 {for (i=1;i<=NF;i++) if ($(i+1)==m) {print $i; exit}}' "$out"; }
	[ -n "$(cm primary-ms-median)" ] || continue
	echo "  CRI RunPodSandbox on $gen, bridge + host-local (ms, median / p90):"
	printf "    %-34s %6.2f / %6.2f\n" "bridge alone" "$(cm primary-ms-median)" "$(cm primary-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ tuning (a no-op chained plugin)" "$(cm tuning-ms-median)" "$(cm tuning-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, pod outside the mesh" "$(cm plain-ms-median)" "$(cm plain-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, enrolled (ambient)" "$(cm enrolled-ms-median)" "$(cm enrolled-ms-p90)"
	printf "    %-34s %6.2f (no-op plugin: %.2f)\n" "added by nftcni, enrolled" "$(cm added-enrolled-ms-median)" "$(cm added-tuning-ms-median)"
done
