#!/usr/bin/env bash
# make bench: every Go benchmark, then the comparisons as ratios measured in
# the same run. The comparison tools (nft, iptables-restore) and containerd
# come from hack/deps.sh (make deps); the product itself never runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp)
trap 'rm -f "$out"' EXIT
go test -run '^$' -bench . -benchmem -count=1 ./conflist ./agent/install | tee -a "$out"
# Rule programming, every way interleaved: fixed round counts keep the
# fresh-netns churn bounded.
go test -run '^$' -bench 'ProgramFresh' -benchtime 200x -count=1 ./capture | tee -a "$out"
go test -run '^$' -bench 'Apply1000Concurrent' -benchtime 3x -count=1 ./capture | tee -a "$out"
# The agent's own steps of an enrolment (probe set entry, record).
go test -run '^$' -bench 'Completion' -benchtime 500x -count=1 ./agent/enrol | tee -a "$out"
# CNI ADD through libcni with the reference plugins: what nftcni adds.
go test -run '^$' -bench '^BenchmarkCNIAdd$' -benchtime 200x -count=1 ./integration | tee -a "$out"
# Istio's own CNI (install-cni + istio-cni from the module proxy, make
# istio-bins) through the same libcni harness, both of its backends.
go test -run '^$' -bench 'IstioCNIAdd' -benchtime 60x -count=1 -timeout 30m ./integration | tee -a "$out"
# Pod sandboxes through containerd's CRI (1.6 and 2.x), with and without nftcni.
go test -run '^$' -bench 'RunPodSandbox' -benchtime 150x -count=1 -timeout 30m ./integration | tee -a "$out"
# The agent with 500 enrolled pods: enrolment throughput, restart, memory.
go test -run '^$' -bench 'AgentRestart500' -benchtime 3x -count=1 -timeout 30m ./integration | tee -a "$out"
# The live handover from Istio's own agent: 20 pods per backend, 500 pods.
go test -run '^$' -bench 'IstioHandover' -benchtime 1x -count=1 -timeout 30m ./integration | tee -a "$out"
# Bursts of 50 and 100 pods on a real node (kubelet, containerd 2.x): the
# bare node, the bound (a Go plugin asking an agent that annotates each
# pod: the least an ambient CNI does), nftcni and Istio's CNI,
# four rounds after a warm-up round, ordered so that each variant runs once
# in each position and after each other variant (about 40 minutes); then
# the node rebooting with 100 pods, bare, the bound (ztunnel-gate), nftcni and
# Istio's CNI, two rounds after a warm-up round (about 20 minutes). -v keeps
# every round's line: Go keeps only a benchmark's first ten log lines.
go test -v -run '^$' -bench 'NodeBurst' -benchtime 4x -count=1 -timeout 120m ./integration | tee -a "$out"
go test -v -run '^$' -bench 'NodeReboot' -benchtime 2x -count=1 -timeout 120m ./integration | tee -a "$out"

ns() { awk -v n="$1" '$1 ~ n {for (i=1;i<=NF;i++) if ($(i+1)=="ns/op") {print $i; exit}}' "$out"; }
ratio() { # name-of-comparison name-of-ours
	local a b; a=$(ns "$1"); b=$(ns "$2")
	[ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" -v x="$1" -v y="$2" 'BEGIN {printf "  %-45s %8.2f ms vs %6.2f ms  = %5.1fx\n", x" / "y, a/1e6, b/1e6, a/b}'
	return 0
}
# m BENCH METRIC: a reported metric of one benchmark line.
m() { awk -v b="^$1-" -v m="$2" '$1 ~ b {for (i=1;i<=NF;i++) if ($(i+1)==m) {print $i; exit}}' "$out"; }
# vs BENCH LABEL A B: metric A over metric B, both medians of the same run.
vs() {
	local a b; a=$(m "$1" "$3"); b=$(m "$1" "$4")
	[ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" -v l="$2" 'BEGIN {printf "    %-52s %7.3f / %7.3f ms = %5.2fx\n", l, a, b, a/b}'
	return 0
}
echo
echo "== ratios (medians of interleaved rounds, same run)"
if [ -n "$(m BenchmarkProgramFresh kernel-floor-ms-median)" ]; then
	echo "  ambient ruleset (v4+v6, DNS, routes) into a fresh netns:"
	vs BenchmarkProgramFresh "nft.Program, warm process / kernel floor" program-warm-ms-median kernel-floor-ms-median
	vs BenchmarkProgramFresh "fresh process, agent's sockets (plugin) / kernel floor" program-cold-ms-median kernel-floor-ms-median
	vs BenchmarkProgramFresh "fresh process, sockets of its own / kernel floor" program-cold-own-sockets-ms-median kernel-floor-ms-median
	vs BenchmarkProgramFresh "Encode+Program, warm / kernel floor" apply-warm-ms-median kernel-floor-ms-median
	vs BenchmarkProgramFresh "nft -f / nft.Program warm" nft-f-ms-median program-warm-ms-median
	vs BenchmarkProgramFresh "nft -f / nft.Program fresh process" nft-f-ms-median program-cold-ms-median
	vs BenchmarkProgramFresh "iptables-nft-restore / nft.Program warm" iptables-nft-restore-ms-median program-warm-ms-median
	vs BenchmarkProgramFresh "iptables-legacy-restore / nft.Program warm" iptables-legacy-restore-ms-median program-warm-ms-median
	vs BenchmarkProgramFresh "nft -f / kernel floor (the best ratio possible)" nft-f-ms-median kernel-floor-ms-median
	printf "    (nsenter+exec of true, part of every tool figure: %s ms)\n" "$(m BenchmarkProgramFresh exec-baseline-ms-median)"
fi
ratio 'BenchmarkInsertMapRoundTrip' 'BenchmarkInsert-'
[ -n "$(m BenchmarkCompletion completion-ms-median)" ] && printf "  agent's completion of an ADD, median: probe set entry %s ms + record %s ms = %s ms\n" \
	"$(m BenchmarkCompletion probe-ms-median)" "$(m BenchmarkCompletion record-ms-median)" "$(m BenchmarkCompletion completion-ms-median)"
grep -E 's/1000pods' "$out" | awk '{for (i=1;i<=NF;i++) if ($(i+1)=="s/1000pods") printf "  1000 pod netns programmed concurrently: %s s\n", $i}'
if [ -n "$(m BenchmarkCNIAdd primary-ms-median)" ]; then
	echo "  CNI ADD through libcni, loopback+bridge+host-local, one plugin appended:"
	echo "   the appended plugin's exec inside the chain (libcni's own timing):"
	vs BenchmarkCNIAdd "nftcni, enrolled (ambient) / reference tuning" enrolled-exec-ms-median tuning-exec-ms-median
	vs BenchmarkCNIAdd "nftcni, pod outside the mesh / tuning" plain-exec-ms-median tuning-exec-ms-median
	for v in enrolled plain; do
		printf "    %-52s %.3fx, 90%% of resamples %.3f-%.3fx\n" "  $v / tuning, bootstrap over the rounds:" \
			"$(m BenchmarkCNIAdd $v-vs-tuning-exec-x)" "$(m BenchmarkCNIAdd $v-vs-tuning-exec-x-p5)" "$(m BenchmarkCNIAdd $v-vs-tuning-exec-x-p95)"
	done
	# NFTCNI_BENCH_BASE_PLUGIN=/path/to/another/build/nftcni: this build against that one, same run.
	if [ -n "$(m BenchmarkCNIAdd enrolled-vs-base-exec-x)" ]; then
		for v in enrolled plain; do
			printf "    %-52s %.3fx, 90%% of resamples %.3f-%.3fx\n" "  $v / the base build's, bootstrap:" \
				"$(m BenchmarkCNIAdd $v-vs-base-exec-x)" "$(m BenchmarkCNIAdd $v-vs-base-exec-x-p5)" "$(m BenchmarkCNIAdd $v-vs-base-exec-x-p95)"
		done
	fi
	vs BenchmarkCNIAdd "nftcni, excluded namespace / tuning" excluded-exec-ms-median tuning-exec-ms-median
	vs BenchmarkCNIAdd "nullplugin (least a Go plugin does) / tuning" null-exec-ms-median tuning-exec-ms-median
	vs BenchmarkCNIAdd "askplugin (nullplugin + one round trip) / tuning" ask-exec-ms-median tuning-exec-ms-median
	vs BenchmarkCNIAdd "nftcni outside the mesh / askplugin (its floor)" plain-exec-ms-median ask-exec-ms-median
	vs BenchmarkCNIAdd "nftcni enrolled / nullplugin (the Go floor)" enrolled-exec-ms-median null-exec-ms-median
	echo "   exec alone:"
	vs BenchmarkCNIAdd "nftcni VERSION / static Go hello-world" nftcni-version-exec-ms-median hello-exec-ms-median
	vs BenchmarkCNIAdd "tuning VERSION / static Go hello-world" tuning-version-exec-ms-median hello-exec-ms-median
	printf "    %-52s agent %s ms (%s ms to the annotation); plugin: decision at %s ms, rules in at %s ms from its start\n" "inside nftcni, enrolled (medians):" \
		"$(m BenchmarkCNIAdd enrolled-ready-ms-median)" "$(m BenchmarkCNIAdd enrolled-done-ms-median)" "$(m BenchmarkCNIAdd enrolled-plugin-decided-ms-median)" "$(m BenchmarkCNIAdd enrolled-plugin-programmed-ms-median)"
	echo "   whole ADD (ms, median / p90):"
	for v in primary tuning null ask excluded plain enrolled; do
		printf "    %-52s %7.3f / %7.3f\n" "$v" "$(m BenchmarkCNIAdd $v-ms-median)" "$(m BenchmarkCNIAdd $v-ms-p90)"
	done
fi
if [ -n "$(m BenchmarkIstioCNIAdd/iptables added-ambient-ms-median)" ] && [ -n "$(m BenchmarkCNIAdd added-enrolled-ms-median)" ]; then
	echo "  latency added to a CNI ADD, Istio's CNI / nftcni (each over its own primary-alone median, same harness, same run):"
	for be in iptables nftables; do
		awk -v a="$(m BenchmarkIstioCNIAdd/$be added-ambient-ms-median)" -v b="$(m BenchmarkCNIAdd added-enrolled-ms-median)" -v l="ambient pod, Istio $be backend" \
			'BEGIN {printf "    %-52s %7.2f / %5.2f ms = %5.1fx less\n", l, a, b, a/b}'
		awk -v a="$(m BenchmarkIstioCNIAdd/$be added-plain-ms-median)" -v b="$(m BenchmarkCNIAdd added-plain-ms-median)" -v l="pod outside the mesh, Istio $be backend" \
			'BEGIN {printf "    %-52s %7.2f / %5.2f ms = %5.1fx less\n", l, a, b, a/b}'
	done
fi
printf "  plugin binary (static, stripped): %s bytes\n" "$(stat -c %s bin/nftcni)"
am() { m BenchmarkAgentRestart500 "$1"; }
if [ -n "$(am s/ready-500pods)" ]; then
	echo "  agent with 500 enrolled pods (agent process, static pod source, test ztunnel; medians):"
	printf "    %-58s %8s\n" "enrolment through libcni, 8 at a time (pods/s)" "$(am pods/s-enrol)"
	printf "    %-58s %8s\n" "restart: exec to ready, all 500 in ztunnel's snapshot (s)" "$(am s/ready-500pods)"
	printf "    %-58s %8s\n" "restart: exec to the snapshot acked by the stand-in (s)" "$(am s/snapshot-acked-500pods)"
	printf "    %-58s %8s\n" "agent RSS with 500 pods (MB)" "$(am MB-rss-500pods)"
	printf "    %-58s %8s\n" "agent RSS after the restart (MB)" "$(am MB-rss-after-restart)"
	printf "    %-58s %8s\n" "first verification pass, every ruleset listed (ms wall)" "$(am ms-first-verify-pass)"
	printf "    %-58s %8s\n" "later verification passes (ms CPU each)" "$(am ms-cpu-per-verify-pass)"
fi
for gen in containerd-1.6 containerd-2; do
	cm() { m "BenchmarkRunPodSandbox/$gen" "$1"; }
	[ -n "$(cm primary-ms-median)" ] || continue
	echo "  CRI RunPodSandbox on $gen, bridge + host-local (ms, median / p90):"
	printf "    %-34s %6.2f / %6.2f\n" "bridge alone" "$(cm primary-ms-median)" "$(cm primary-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ tuning (a no-op chained plugin)" "$(cm tuning-ms-median)" "$(cm tuning-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, pod outside the mesh" "$(cm plain-ms-median)" "$(cm plain-ms-p90)"
	printf "    %-34s %6.2f / %6.2f\n" "+ nftcni, enrolled (ambient)" "$(cm enrolled-ms-median)" "$(cm enrolled-ms-p90)"
	printf "    %-34s %6.2f (no-op plugin: %.2f)\n" "added by nftcni, enrolled" "$(cm added-enrolled-ms-median)" "$(cm added-tuning-ms-median)"
	awk -v a="$(cm enrolled-ms-median)" -v b="$(cm tuning-ms-median)" 'BEGIN {printf "    %-34s %6.2fx\n", "enrolled / + tuning", a/b}'
	for v in enrolled plain; do
		printf "    %-34s %6.2fx (90%% of resamples: %.2f-%.2fx)\n" "added: $v / tuning, paired by round" \
			"$(cm $v-vs-tuning-added-x)" "$(cm $v-vs-tuning-added-x-p5)" "$(cm $v-vs-tuning-added-x-p95)"
	done
	if [ -n "$(cm enrolled-cni-setup-ms-median)" ]; then
		printf "    %-34s %6.2f / %6.2f / %6.2f / %6.2f\n" "containerd's own CNI set-up timer" "$(cm primary-cni-setup-ms-median)" \
			"$(cm tuning-cni-setup-ms-median)" "$(cm plain-cni-setup-ms-median)" "$(cm enrolled-cni-setup-ms-median)"
		printf "    %-34s (bridge alone / + tuning / + nftcni outside the mesh / enrolled, ms, medians)\n" ""
		for v in enrolled plain; do
			printf "    %-34s %6.2fx (90%% of resamples: %.2f-%.2fx)\n" "set-up added: $v / tuning, paired" \
				"$(cm $v-vs-tuning-cni-setup-added-x)" "$(cm $v-vs-tuning-cni-setup-added-x-p5)" "$(cm $v-vs-tuning-cni-setup-added-x-p95)"
		done
	fi
	if [ -n "$(cm enrolled-exec-ms-median)" ]; then
		printf "    %-34s %6.2f / %6.2f / %6.2f\n" "the appended plugin's run, exec to exit" \
			"$(cm tuning-exec-ms-median)" "$(cm plain-exec-ms-median)" "$(cm enrolled-exec-ms-median)"
		printf "    %-34s (tuning / nftcni outside the mesh / enrolled, ms, medians; kernel process events)\n" ""
		for v in enrolled plain; do
			printf "    %-34s %6.2fx (90%% of resamples: %.2f-%.2fx)\n" "run: $v / tuning, paired" \
				"$(cm $v-vs-tuning-exec-x)" "$(cm $v-vs-tuning-exec-x-p5)" "$(cm $v-vs-tuning-exec-x-p95)"
		done
	fi
	printf "    %-34s agent %s ms (%s ms to the annotation); plugin: decision at %s ms, rules in at %s ms from its start\n" "inside nftcni, enrolled (medians)" \
		"$(cm enrolled-ready-ms-median)" "$(cm enrolled-done-ms-median)" "$(cm enrolled-plugin-decided-ms-median)" "$(cm enrolled-plugin-programmed-ms-median)"
	if [ -n "$(cm enrolled-stop-ms-median)" ]; then
		printf "    %-34s %6.2f / %6.2f / %6.2f / %6.2f\n" "StopPodSandbox (the CNI DEL), ms" \
			"$(cm primary-stop-ms-median)" "$(cm tuning-stop-ms-median)" "$(cm plain-stop-ms-median)" "$(cm enrolled-stop-ms-median)"
	fi
done
for size in 20-iptables 20-nftables 500-nftables; do
	hm() { m "BenchmarkIstioHandover/$size" "$1"; }
	[ -n "$(hm handover-ms)" ] || continue
	printf "  live handover from istio-cni, %-13s nftcni's start to serving, every pod taken over: %8s ms (%s ms per pod)\n" \
		"$size:" "$(hm handover-ms)" "$(hm per-pod-ms)"
done
for size in 50 100; do
	bm() { m "BenchmarkNodeBurst/$size" "$1"; }
	[ -n "$(bm p99-nftcni/bare)" ] || continue
	printf "  burst of %3s pods on a real node, creation to running, ms:  p50 / p90 / p99 (kubelet SLI p50 / p99, bucket bounds; sandboxes failed and retried)\n" "$size"
	for v in bare bound nftcni istio-cni; do
		printf "    %-16s %8s / %8s / %8s   (%s / %s; %s)\n" "$v" "$(bm $v-ms-p50)" "$(bm $v-ms-p90)" "$(bm $v-ms-p99)" "$(bm $v-sli-ms-p50)" "$(bm $v-sli-ms-p99)" "$(bm $v-failed-sandboxes)"
	done
	printf "    p99 nftcni / bare: %sx (median over rounds; 90%% of round resamples %s-%sx)\n" "$(bm p99-nftcni/bare)" "$(bm p99-nftcni/bare-p5)" "$(bm p99-nftcni/bare-p95)"
	printf "    p99 istio-cni / bare: %sx (%s-%sx)\n" "$(bm p99-istio/bare)" "$(bm p99-istio/bare-p5)" "$(bm p99-istio/bare-p95)"
	printf "    what nftcni adds to the bare p99 over what Istio's CNI adds: %s (%s-%s)\n" "$(bm p99-added-nftcni/istio)" "$(bm p99-added-nftcni/istio-p5)" "$(bm p99-added-nftcni/istio-p95)"
	printf "    the bound (a Go plugin asking a node agent, which annotates the pod: the least an ambient CNI does):\n"
	printf "      p99 bound / bare: %sx (%s-%sx); what it adds over what Istio's CNI adds: %s (%s-%s)\n" "$(bm p99-bound/bare)" "$(bm p99-bound/bare-p5)" "$(bm p99-bound/bare-p95)" "$(bm p99-added-bound/istio)" "$(bm p99-added-bound/istio-p5)" "$(bm p99-added-bound/istio-p95)"
	printf "      p99 nftcni / bound: %sx (%s-%sx)\n" "$(bm p99-nftcni/bound)" "$(bm p99-nftcni/bound-p5)" "$(bm p99-nftcni/bound-p95)"
	echo "    CPU a pod, ms: kube-apiserver / kubelet / containerd with the CNI plugins (nftcni's agent: $(bm agent-cpu-ms/pod)); the node's teardown after the pods left the API"
	for v in bare bound nftcni istio-cni; do
		printf "    %-16s %8s / %8s / %8s; %s ms\n" "$v" "$(bm $v-kube-apiserver-cpu-ms/pod)" "$(bm $v-kubelet-cpu-ms/pod)" "$(bm $v-containerd-cpu-ms/pod)" "$(bm $v-teardown-ms)"
	done
done
rb() { m BenchmarkNodeReboot "$1"; }
if [ -n "$(rb p99-nftcni/bare)" ]; then
	echo "  node reboot with 100 pods, node down to each pod running again, ms: p50 / p90 / p99 (sandboxes failed and retried; to the first pod running, ztunnel Ready, nftcni's agent Ready)"
	for v in bare gate nftcni istio-cni; do
		printf "    %-14s %8s / %8s / %8s   (%s; %s, %s, %s)\n" "$v" "$(rb $v-ms-p50)" "$(rb $v-ms-p90)" "$(rb $v-ms-p99)" "$(rb $v-failed-sandboxes)" "$(rb $v-first-pod-ms)" "$(rb $v-ztunnel-ready-ms)" "$(rb $v-agent-ready-ms)"
	done
	for v in gate nftcni istio-cni; do
		[ -n "$(rb p99-$v/bare)" ] && printf "    p99 %s / bare: %sx (median over rounds; 90%% of round resamples %s-%sx)\n" "$v" "$(rb p99-$v/bare)" "$(rb p99-$v/bare-p5)" "$(rb p99-$v/bare-p95)"
	done
	printf "    p99 nftcni / gate (the bound: ADDs held until ztunnel is connected, nothing else): %sx (%s-%sx)\n" "$(rb p99-nftcni/gate)" "$(rb p99-nftcni/gate-p5)" "$(rb p99-nftcni/gate-p95)"
fi
