#!/usr/bin/env bash
# Runs the agent on a folder of manifests, prints its tables, and stops it.
# Usage: hack/demo.sh BINARY MANIFEST_FOLDER
set -euo pipefail
bin="$1"
manifests="$2"
state="$(mktemp -d /tmp/mtlsbridge-demo.XXXXXX)"
log="${state}/agent.log"

# The demo's pods are manifests, not real pods: no datapath (and no pins in
# the node's bpffs when run as root).
"${bin}" agent --source="dir:${manifests}" --state-dir="${state}" --node-name=node-a \
	--grpc-listen=127.0.0.1:0 --enable-redirect=false >"${log}" 2>&1 &
agent=$!
cleanup() {
	kill "${agent}" 2>/dev/null || true
	wait "${agent}" 2>/dev/null || true
	rm -rf "${state}"
}
trap cleanup EXIT

# Wait (bounded) until every table is initialized.
for _ in $(seq 1 100); do
	if curl -sf --unix-socket "${state}/api.sock" http://agent/healthz >/dev/null 2>&1; then
		break
	fi
	if ! kill -0 "${agent}" 2>/dev/null; then
		echo "the agent exited:" >&2
		cat "${log}" >&2
		exit 1
	fi
	sleep 0.1
done

show() {
	echo "== mtlsbridge $*"
	"${bin}" "$@" --state-dir="${state}" || true
	echo
}
show db show
for table in sources policies enrollments; do
	show db show "${table}"
done
show db show enrollments --namespace=shop
# The datapath is off here: the rows say what would be steered, and that
# nothing is applied.
show db show redirects
show db show workloads --pod=shop/frontend -o yaml
show health
