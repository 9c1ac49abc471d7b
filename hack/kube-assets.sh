#!/usr/bin/env bash
# Builds the kube-apiserver and etcd binaries used by internal/kubetest from
# the module in hack/kube-apiserver, and prints the folder that holds them.
#
# The folder is $MTLSBRIDGE_KUBE_ASSETS, or by default
# $HOME/.cache/mtlsbridge/kube-<k8s version>-etcd-<etcd version>. A binary
# that is already there is kept, so a second run only prints the folder. Each
# binary is built under a temporary name in that folder and then renamed, so
# an interrupted build never leaves a half-written binary behind.
#
# A cold build takes about ten minutes on two cores; later runs take no time.
set -euo pipefail

# Keep these in step with hack/kube-apiserver/go.mod and with the default
# folder in internal/kubetest/kubetest.go.
K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.3

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
moddir="${here}/kube-apiserver"
PREFIX=kube-assets
DEST="${MTLSBRIDGE_KUBE_ASSETS:-${HOME}/.cache/mtlsbridge/kube-${K8S_VERSION}-etcd-${ETCD_VERSION}}"
# shellcheck source=hack/build-cached.sh
source "${here}/build-cached.sh"

cd "${moddir}"

# Refuse to fill a folder named for one version with binaries of another.
got_k8s="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
got_etcd="$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
if [[ "${got_k8s}" != "${K8S_VERSION}" || "${got_etcd}" != "${ETCD_VERSION}" ]]; then
	log "hack/kube-apiserver/go.mod has kubernetes ${got_k8s} and etcd ${got_etcd}," \
		"but this script expects ${K8S_VERSION} and ${ETCD_VERSION}; update both together"
	exit 1
fi

minor="${K8S_VERSION#v}"
minor="${minor#*.}"
minor="${minor%%.*}"
major="${K8S_VERSION#v}"
major="${major%%.*}"
# Without these the apiserver reports its version as v0.0.0.
k8s_ldflags="-X k8s.io/component-base/version.gitVersion=${K8S_VERSION}"
k8s_ldflags+=" -X k8s.io/component-base/version.gitMajor=${major}"
k8s_ldflags+=" -X k8s.io/component-base/version.gitMinor=${minor}"
k8s_ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"

# A cold build takes several minutes per binary.
build_cached etcd go.etcd.io/etcd/server/v3 ""
build_cached kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "${k8s_ldflags}"

echo "${DEST}"
