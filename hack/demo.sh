#!/usr/bin/env bash
# make demo: nftcni's installer on a throw-away host layout, no cluster.
# A real primary CNI config (Calico's, as it ships) is patched, the primary
# "restarts" and rewrites its file, the agent repairs it, and uninstall gives
# back the original bytes. Everything lives under one temp dir, removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT=$PWD/bin/nftcni-agent
PLUGIN=$PWD/bin/nftcni
[ -x "$AGENT" ] && [ -x "$PLUGIN" ] || { echo "run 'make build' first"; exit 1; }

HOST=$(mktemp -d /tmp/nftcni-demo.XXXXXX)
AGENT_PID=
cleanup() {
	[ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null || true
	rm -rf "$HOST"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
CONF=$HOST/etc/cni/net.d
BIN=$HOST/opt/cni/bin
mkdir -p "$CONF" "$BIN"
cp conflist/testdata/corpus/10-calico.conflist "$CONF/"
cp "$CONF/10-calico.conflist" "$HOST/original.conflist"
export CNI_CONF_DIR=$CONF CNI_BIN_DIR=$BIN PLUGIN_BINARY=$PLUGIN LOG_LEVEL=warn

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

step "nftcni-agent run: watch and repair"
LOG_LEVEL=info "$AGENT" run --health-addr 127.0.0.1:0 --monitoring-port 0 --on-exit keep 2>"$HOST/agent.log" &
AGENT_PID=$!
sleep 0.5

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
