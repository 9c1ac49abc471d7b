#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The mTLS demo of make demo: builds everything, brings the two-node
# testbed up (network namespaces, the built node agent with its BPF
# datapath on each node, the built mtlsbridge-proxy in its own pod, pods
# through the CNI chain, a manifest folder as the cluster), sends requests
# in each situation of issue 14, prints one line per flow and both agents'
# enrollments and workloads tables, and tears everything down.
#
# It needs root. Without it, it says so and exits 0, so that the caller
# can run the table demo (hack/demo.sh) instead.
# Usage: hack/demo-mtls.sh [l2|inpod]   (the node agents' --redirect-mode;
# default l2)
set -euo pipefail

if [[ "$(id -u)" -ne 0 ]]; then
	echo "demo-mtls: needs root (network namespaces, BPF, nftables); skipped"
	exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"
work="$(mktemp -d /tmp/mtlsbridge-demo-mtls.XXXXXX)"
trap 'rm -rf "${work}"' EXIT

# The reference CNI plugins (cached after the first build), and the demo
# itself: a test binary of e2e (its testbed builds the agent, the plugin
# and the proxy from this tree).
plugins="$(./hack/cni-plugins.sh)"
go test -c -o "${work}/e2e.test" ./e2e

MTLSBRIDGE_DEMO=1 MTLSBRIDGE_DEMO_MODE="${1:-l2}" MTLSBRIDGE_CNI_PLUGINS="${plugins}" \
	"${work}/e2e.test" -test.run '^TestDemo$' -test.count=1 -test.timeout=5m
