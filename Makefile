# mtlsbridge: build, test and demo. Everything here runs on a fresh machine
# with Go installed; `make test` also builds the cached kube-apiserver.

GO        ?= go
BIN       ?= bin/mtlsbridge
PKGS      ?= ./...
BENCHTIME ?= 1s

.PHONY: all build test bench fuzz soak lint demo kube-assets cni-plugins cilium image clean generate check-generate

all: build

build:
	$(GO) build -o $(BIN) ./cmd/mtlsbridge
	$(GO) build -o $(dir $(BIN))mtlsbridge-cni ./cmd/mtlsbridge-cni

# image writes the container image, built without a container engine from
# this commit's static binaries: bin/image.tar (docker load, ctr image
# import) and the OCI layout bin/image-oci. The same commit gives the same
# digest: every time in it is the commit's (SOURCE_DATE_EPOCH).
IMAGE_TAG ?= mtlsbridge:$(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
image:
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct) $(GO) run ./hack/image \
		--revision=$$(git rev-parse HEAD) --version=$$(git describe --tags --always --dirty) \
		--tag=$(IMAGE_TAG) --tarball=bin/image.tar --oci-layout=bin/image-oci

# kube-assets builds kube-apiserver and etcd once (about 10 minutes cold) and
# caches them under ~/.cache/mtlsbridge; later runs take no time.
kube-assets:
	./hack/kube-assets.sh >/dev/null

# cni-plugins builds the reference ptp and static CNI plugins once (seconds)
# and caches them under ~/.cache/mtlsbridge, for internal/cnitest.
cni-plugins:
	./hack/cni-plugins.sh >/dev/null

# cilium downloads Cilium's Go module (its Helm chart and CRDs, used by the
# Kubernetes tests; not a dependency of go.mod) into the module cache.
cilium:
	./hack/cilium.sh >/dev/null

test: kube-assets cni-plugins cilium
	MTLSBRIDGE_KUBE_ASSETS=$$(./hack/kube-assets.sh) MTLSBRIDGE_CNI_PLUGINS=$$(./hack/cni-plugins.sh) \
		MTLSBRIDGE_CILIUM=$$(./hack/cilium.sh) $(GO) test -race -count=1 $(PKGS)

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

# fuzz runs each fuzz target for FUZZTIME (e.g. make fuzz FUZZTIME=1h for a
# long run; a failing input is written under the package's testdata/fuzz).
# `make test` runs every target's seed corpus (testdata/fuzz) as a test.
FUZZTIME ?= 1m
FUZZ_TARGETS = ./xds:FuzzDeltaRequests ./cni:FuzzAPIRequests ./cni/plugin:FuzzPlugin \
	./tables/ingest:FuzzDecodeManifests ./identity:FuzzCheckRequest \
	./zds/nodeagent:FuzzClientMessages
fuzz:
	@for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; fn=$${t##*:}; echo "== $$fn ($$pkg)"; \
		$(GO) test -run '^$$' -fuzz "^$$fn$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; done

# soak runs TestSoak (not part of make test): TestNeverLeak's proof for SOAK
# (at least 50 SIGKILL restarts of the node agent with pods churning, then
# of the mTLS agent on the two-node testbed, then 10 of its API server), and
# stops by itself. As root. SOAKTIMEOUT ends a soak that hangs.
SOAK ?= 5m
SOAKTIMEOUT ?= 3h
soak: kube-assets cni-plugins
	MTLSBRIDGE_SOAK=$(SOAK) MTLSBRIDGE_REQUIRE_PRIVILEGED=1 MTLSBRIDGE_CNI_PLUGINS=$$(./hack/cni-plugins.sh) \
		MTLSBRIDGE_KUBE_ASSETS=$$(./hack/kube-assets.sh) \
		$(GO) test -count=1 -v -run '^TestSoak$$' -timeout $(SOAKTIMEOUT) ./e2e/

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

# generate rebuilds the BPF objects and their Go bindings from bpf/*.c
# (needs clang, llvm and libbpf-dev). The output is committed, so that a
# build needs no clang.
generate:
	$(GO) generate ./bpf/...

# check-generate fails when the committed BPF output is not what the sources
# generate. Without clang it says so and passes.
check-generate:
	@if ! command -v clang >/dev/null 2>&1; then \
		echo "check-generate: clang not found, skipped"; exit 0; \
	fi; \
	$(MAKE) --no-print-directory generate && \
	if ! git diff --exit-code --stat -- bpf/; then \
		echo "bpf/: generated files are stale; run make generate and commit them"; exit 1; \
	fi

# demo is the product's main job, seen: as root, the two-node testbed in
# network namespaces, mTLS on the wire between enrolled pods, one line per
# flow (hack/demo-mtls.sh; MODE=inpod for the in-pod mode); without root,
# the agent on the demo manifests and the tables it derives (hack/demo.sh).
MODE ?= l2
demo: build
	@if [ "$$(id -u)" -eq 0 ]; then ./hack/demo-mtls.sh $(MODE); \
	else echo "make demo: not root, so no network namespaces: the tables only"; ./hack/demo.sh $(BIN) testdata/demo; fi

clean:
	rm -rf bin
