#!/usr/bin/env bash
# Downloads Cilium's Go module (its Helm chart and CRDs; nothing of it is
# compiled) into the module cache and prints its folder. Tests read
# install/kubernetes/cilium and pkg/k8s/apis/cilium.io/client/crds/v2 from it
# through $MTLSBRIDGE_CILIUM (make test sets it; internal/kubetest runs this
# script when it is unset).
#
# cilium/cilium is deliberately not a requirement of go.mod: the agent must
# not link it, and its dependency graph would pull the whole module in.
# `go mod download` verifies the zip against the checksum database, so the
# folder is Cilium's release as published.
set -euo pipefail

# Keep this in step with CiliumVersion in internal/kubetest.
CILIUM_VERSION=v1.20.0

# Outside any module: downloading must not touch this repository's go.mod.
tmp="$(mktemp -d)"
trap 'rmdir "${tmp}"' EXIT
cd "${tmp}"
export GOWORK=off GOFLAGS=-mod=mod
dir="$(go mod download -json "github.com/cilium/cilium@${CILIUM_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
if [[ -z "${dir}" || ! -d "${dir}/install/kubernetes/cilium" ]]; then
	echo "cilium: go mod download github.com/cilium/cilium@${CILIUM_VERSION} gave no module folder" >&2
	exit 1
fi
echo "${dir}"
