#!/usr/bin/env bash
# make demo: nftcni on a throw-away host layout, no cluster.
# A real primary CNI config (Calico's, as it ships) is patched, the primary
# "restarts" and rewrites its file, the agent repairs it. Then pods are
# created with cnitool (libcni, as runtimes run CNI) on a node whose primary
# is the reference bridge plugin: one in an enrolled namespace gets its
# ruleset and its traffic lands on a stand-in ztunnel, one outside the mesh
# gets nothing until its namespace is labelled, and loses it again when the
# label goes; inspect shows the live state. Uninstall gives back the
# original bytes.
# Everything lives under one temp dir and a few netns, removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT=$PWD/bin/nftcni-agent
PLUGIN=$PWD/bin/nftcni
[ -x "$AGENT" ] && [ -x "$PLUGIN" ] || { echo "run 'make build' first"; exit 1; }
[ "$(id -u)" = 0 ] || { echo "make demo needs root: it creates network namespaces"; exit 1; }
[ -x "${NFTCNI_CNI_BIN:-}/bridge" ] || { echo "reference CNI plugins missing: run it as 'make demo'"; exit 1; }

HOST=$(mktemp -d /tmp/nftcni-demo.XXXXXX)
AGENT_PID=
ZTUNNEL_PID=
NETNS=()
cleanup() {
	[ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null || true
	[ -n "$ZTUNNEL_PID" ] && kill "$ZTUNNEL_PID" 2>/dev/null && wait "$ZTUNNEL_PID" 2>/dev/null || true
	for n in "${NETNS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
	rm -rf "$HOST"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
CONF=$HOST/etc/cni/net.d
BIN=$HOST/opt/cni/bin
mkdir -p "$CONF" "$BIN"
cp conflist/testdata/corpus/10-calico.conflist "$CONF/"
cp "$CONF/10-calico.conflist" "$HOST/original.conflist"
mkdir -p "$HOST/pods"
cat >"$HOST/pods/pods.yaml" <<'YAML'
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: legacy}
---
apiVersion: v1
kind: Pod
metadata: {name: cart, namespace: shop, uid: 6b1e0d2a-cart}
---
apiVersion: v1
kind: Pod
metadata: {name: batch, namespace: legacy, uid: 0c4f9a11-batch}
YAML
# The "node": a netns of its own, standing in for the host netns (the probe
# SNAT table goes there), so the demo never touches this machine's network.
NODE=nftcni-demo-node-$$; CART=nftcni-demo-cart-$$; BATCH=nftcni-demo-batch-$$
for n in "$NODE" "$CART" "$BATCH"; do ip netns add "$n"; NETNS+=("$n"); done
ip -n "$NODE" link set lo up
export CNI_CONF_DIR=$CONF CNI_BIN_DIR=$BIN PLUGIN_BINARY=$PLUGIN LOG_LEVEL=warn CNI_AGENT_RUN_DIR=$HOST/run \
	HOST_NETNS=/var/run/netns/$NODE ZTUNNEL_UDS_ADDRESS=$HOST/ztunnel/ztunnel.sock
go build -o "$HOST/ztunnel-stub" ./integration/cmd/ztunnel-stub

step "A node with Calico's primary config in $CONF"
ls -l "$CONF" "$BIN"

step "nftcni-agent install --once (flags come from env twins: CNI_CONF_DIR, CNI_BIN_DIR, ...)"
"$AGENT" install --once
ls -l "$BIN"
echo "$BIN/nftcni answers VERSION:"; CNI_COMMAND=VERSION "$BIN/nftcni" </dev/null; echo

step "The patch: our entry appended, every other byte unchanged"
diff -u "$HOST/original.conflist" "$CONF/10-calico.conflist" || true

step "Installing again is a no-op (byte-identical)"
cp "$CONF/10-calico.conflist" "$HOST/installed.conflist"
"$AGENT" install --once
cmp "$HOST/installed.conflist" "$CONF/10-calico.conflist" && echo "identical"

step "nftcni-agent run: watch and repair, and serve the plugin (pods and namespaces from $HOST/pods)"
LOG_LEVEL=info "$AGENT" run --health-addr 127.0.0.1:0 --monitoring-port 0 --on-exit keep --pod-source "$HOST/pods" 2>"$HOST/agent.log" &
AGENT_PID=$!
sleep 0.5
step "a stand-in ztunnel connects to the agent over ZDS (integration/cmd/ztunnel-stub)"
"$HOST/ztunnel-stub" "$ZTUNNEL_UDS_ADDRESS" >"$HOST/ztunnel.log" 2>&1 &
ZTUNNEL_PID=$!
sleep 0.3; cat "$HOST/ztunnel.log"

step "calico-node restarts and rewrites its config, dropping our entry"
cat "$HOST/original.conflist" >"$CONF/10-calico.conflist"
grep -q '"nftcni"' "$CONF/10-calico.conflist" || echo "(no nftcni entry now)"
start=$(date +%s%N)
for _ in $(seq 200); do
	grep -q '"type": "nftcni"' "$CONF/10-calico.conflist" && break
	sleep 0.01
done
grep -q '"type": "nftcni"' "$CONF/10-calico.conflist" || { echo "not repaired"; cat "$HOST/agent.log"; exit 1; }
echo "repaired after $(( ($(date +%s%N) - start) / 1000000 )) ms:"
cmp "$HOST/installed.conflist" "$CONF/10-calico.conflist" && echo "the file is again exactly the installed one"

step "someone deletes the plugin binary"
rm "$BIN/nftcni"
for _ in $(seq 200); do [ -x "$BIN/nftcni" ] && break; sleep 0.01; done
ls -l "$BIN/nftcni"

step "Pods: the node's primary CNI becomes the reference bridge plugin (05-bridge.conflist sorts first)"
	cat >"$CONF/05-bridge.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "demonet",
  "plugins": [
    {"type": "loopback"},
    {"type": "bridge", "bridge": "demo0", "isGateway": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.123.0.0/24"}]], "dataDir": "$HOST/ipam"}}
  ]
}
JSON
	for _ in $(seq 200); do grep -q '"type": "nftcni"' "$CONF/05-bridge.conflist" && break; sleep 0.01; done
	echo "nftcni entries in the new primary (the agent follows the file runtimes load):"; grep -c '"type": "nftcni"' "$CONF/05-bridge.conflist"
	cni() { # cni <add|check|del> <netns> <namespace> <pod>
		ip netns exec "$NODE" env CNI_PATH="$BIN:$NFTCNI_CNI_BIN" NETCONFPATH="$CONF" \
			CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=$3;K8S_POD_NAME=$4" \
			"$NFTCNI_CNI_BIN/cnitool" "$1" demonet "/var/run/netns/$2"
	}
	step "cnitool add shop/cart (namespace shop is labelled istio.io/dataplane-mode=ambient)"
	cni add "$CART" shop cart | grep -E '"address"'
	echo "ztunnel got the pod's netns (ZDS AddWorkload with the fd the plugin handed over) while the plugin programmed the rules:"
	grep AddWorkload "$HOST/ztunnel.log"
	echo "the pod's netns has our table (read back with nft, which nftcni itself never runs):"
	ip netns exec "$CART" nft list table inet nftcni | grep -E 'chain|redirect|tproxy|dnat' | head -12
	echo "policy routing: $(ip -n "$CART" rule show | grep 'lookup 100')"
	echo "and the node's probe SNAT set holds the pod IP, commented with its UID:"
	ip netns exec "$NODE" nft list set inet nftcni-host probe-v4 | grep -A1 elements
	step "shop/cart opens a TCP connection to 10.123.0.1:80: it lands on ztunnel's 15001 in the pod"
	ip netns exec "$CART" bash -c 'exec 3<>/dev/tcp/10.123.0.1/80' || true
	sleep 0.2; grep 'landed' "$HOST/ztunnel.log"
	step "cnitool add legacy/batch (not in the mesh): no rules"
	cni add "$BATCH" legacy batch | grep -E '"address"'
	ip netns exec "$BATCH" nft list tables | grep -q nftcni && { echo "unexpected table"; exit 1; } || echo "no nftcni table in legacy/batch"
	step "namespace legacy gets labelled istio.io/dataplane-mode=ambient: the running legacy/batch is enrolled"
	sed -i 's/{name: legacy}/{name: legacy, labels: {istio.io\/dataplane-mode: ambient}}/' "$HOST/pods/pods.yaml"
	for _ in $(seq 300); do ip netns exec "$BATCH" nft list tables | grep -q nftcni && break; sleep 0.01; done
	ip netns exec "$BATCH" nft list tables | grep nftcni
	sleep 0.2; grep 'AddWorkload legacy/batch' "$HOST/ztunnel.log"
	ip netns exec "$BATCH" bash -c 'exec 3<>/dev/tcp/10.123.0.1/443' || true
	sleep 0.2; grep 'legacy/batch: connection.*landed' "$HOST/ztunnel.log"
	step "the label goes again: legacy/batch leaves the mesh, rules and ztunnel state with it"
	sed -i 's/{name: legacy, labels: {istio.io\/dataplane-mode: ambient}}/{name: legacy}/' "$HOST/pods/pods.yaml"
	for _ in $(seq 300); do ip netns exec "$BATCH" nft list tables | grep -q nftcni || break; sleep 0.01; done
	ip netns exec "$BATCH" nft list tables | grep -q nftcni && { echo "table left"; exit 1; } || echo "no nftcni table in legacy/batch"
	sleep 0.2; grep 'DelWorkload' "$HOST/ztunnel.log" | tail -1

	step "nftcni-agent inspect shop/cart: live ruleset read through netlink, verdict, enrolment, ztunnel state"
	"$AGENT" inspect shop/cart | head -9
	echo "    ... (full ruleset follows in the real output)"
	step "nftcni-agent inspect host: the probe SNAT table"
	"$AGENT" inspect host | head -12

	step "CHECK passes; someone deletes the table; CHECK fails and inspect says DRIFT (exit 1)"
	cni check "$CART" shop cart && echo "check: ok"
	ip netns exec "$CART" nft delete table inet nftcni
	cni check "$CART" shop cart 2>&1 | head -3 || true
	"$AGENT" inspect shop/cart | grep -A2 ruleset || echo "inspect exit status: $?"
	step "DEL removes everything (and a second DEL is fine)"
	cni del "$CART" shop cart; cni del "$CART" shop cart; cni del "$BATCH" legacy batch
	ip netns exec "$CART" nft list tables | grep -q nftcni && { echo "table left"; exit 1; } || echo "no table left in shop/cart"
	grep DelWorkload "$HOST/ztunnel.log"
	rm "$CONF/05-bridge.conflist"

step "agent stops (a restart or upgrade: --on-exit keep leaves the install in place)"
kill "$AGENT_PID"; wait "$AGENT_PID" || true; AGENT_PID=
echo "nftcni entries still in the config: $(grep -c '"type": "nftcni"' "$CONF/10-calico.conflist")"

step "nftcni-agent uninstall: the original bytes come back"
"$AGENT" uninstall
cmp "$HOST/original.conflist" "$CONF/10-calico.conflist" && echo "byte-identical to the original"
ls -l "$CONF" "$BIN"

step "agent log"
cat "$HOST/agent.log"
echo; echo "demo done; $HOST removed"
