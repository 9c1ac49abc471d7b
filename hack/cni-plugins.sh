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
dir="${MTLSBRIDGE_CNI_PLUGINS:-${HOME}/.cache/mtlsbridge/cni-plugins-${PLUGINS_VERSION}}"

log() { echo "cni-plugins: $*" >&2; }

# The wrapper module stands alone: never let a go.work above it take over.
export GOWORK=off
# Static binaries, as the upstream releases are; no C toolchain needed.
export CGO_ENABLED=0

cd "${moddir}"

# Refuse to fill a folder named for one version with binaries of another.
got="$(go list -m -f '{{.Version}}' github.com/containernetworking/plugins)"
if [[ "${got}" != "${PLUGINS_VERSION}" ]]; then
	log "hack/cni-plugins/go.mod has plugins ${got}, but this script expects ${PLUGINS_VERSION}; update both together"
	exit 1
fi

mkdir -p "${dir}"

# build NAME PACKAGE
build() {
	local name="$1" pkg="$2"
	local dest="${dir}/${name}"
	if [[ -x "${dest}" ]]; then
		return 0
	fi
	local tmp="${dir}/.${name}.tmp.$$"
	# shellcheck disable=SC2064 # expand now: tmp is local to this function
	trap "rm -f -- $(printf '%q' "${tmp}")" EXIT
	log "building ${name} (${pkg}) into ${dir}"
	# -mod=readonly: go.sum is complete, so a clean module cache only downloads.
	go build -mod=readonly -trimpath -o "${tmp}" "${pkg}"
	mv -f "${tmp}" "${dest}"
	trap - EXIT
}

build ptp github.com/containernetworking/plugins/plugins/main/ptp
build static github.com/containernetworking/plugins/plugins/ipam/static

echo "${dir}"
