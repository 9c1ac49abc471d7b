# Sourced by the scripts that build test binaries from a wrapper module in
# hack/ into a cache folder (kube-assets.sh, cni-plugins.sh).
#
# Before sourcing, set PREFIX (for log lines) and DEST (the cache folder).
# Builds are static (CGO_ENABLED=0) and never use a go.work above the
# module; go.sum is complete, so -mod=readonly only downloads.

# The wrapper module stands alone: never let a go.work above it take over.
export GOWORK=off
# Static binaries, as the upstream releases are; no C toolchain needed.
export CGO_ENABLED=0

log() { echo "${PREFIX}: $*" >&2; }

# build_cached NAME PACKAGE [LDFLAGS]: builds PACKAGE of the current
# module into DEST/NAME unless it is there. The binary is written under a
# temporary name and then renamed, so an interrupted build never leaves a
# half-written binary behind.
build_cached() {
	local name="$1" pkg="$2" ldflags="${3:-}"
	local dest="${DEST}/${name}"
	if [[ -x "${dest}" ]]; then
		return 0
	fi
	mkdir -p "${DEST}"
	local tmp="${DEST}/.${name}.tmp.$$"
	# shellcheck disable=SC2064 # expand now: tmp is local to this function
	trap "rm -f -- $(printf '%q' "${tmp}")" EXIT
	log "building ${name} (${pkg}) into ${DEST}"
	local start=${SECONDS}
	go build -mod=readonly -trimpath -ldflags "${ldflags}" -o "${tmp}" "${pkg}"
	mv -f "${tmp}" "${dest}"
	trap - EXIT
	log "built ${name} in $((SECONDS - start))s"
}
