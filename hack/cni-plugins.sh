#!/usr/bin/env bash
# Builds the reference CNI plugins used by internal/cnitest (ptp and the
# static IPAM plugin) from the module in hack/cni-plugins, and prints the
# folder that holds them.
#
# The folder is $MTLSBRIDGE_CNI_PLUGINS, or by default
# $HOME/.cache/mtlsbridge/cni-plugins-<version>. A binary that is already
# there is kept, so a second run only prints the folder. Each binary is built
# under a temporary name in that folder and then renamed, so an interrupted
# build never leaves a half-written binary behind.
set -euo pipefail

# Keep this in step with hack/cni-plugins/go.mod.
PLUGINS_VERSION=v1.10.0

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
moddir="${here}/cni-plugins"
PREFIX=cni-plugins
DEST="${MTLSBRIDGE_CNI_PLUGINS:-${HOME}/.cache/mtlsbridge/cni-plugins-${PLUGINS_VERSION}}"
# shellcheck source=hack/build-cached.sh
source "${here}/build-cached.sh"

cd "${moddir}"

# Refuse to fill a folder named for one version with binaries of another.
got="$(go list -m -f '{{.Version}}' github.com/containernetworking/plugins)"
if [[ "${got}" != "${PLUGINS_VERSION}" ]]; then
	log "hack/cni-plugins/go.mod has plugins ${got}, but this script expects ${PLUGINS_VERSION}; update both together"
	exit 1
fi

build_cached ptp github.com/containernetworking/plugins/plugins/main/ptp
build_cached static github.com/containernetworking/plugins/plugins/ipam/static

echo "${DEST}"
