# xdproxy: a kube-proxy replacement on AF_XDP.
# `make demo` and `make test` are meant to work as root on a fresh Debian
# machine: they install the Debian packages they need themselves.

GO        ?= go
BIN       := $(CURDIR)/bin
KUBE_BIN  := $(CURDIR)/build/kube/bin
GOFLAGS   ?=
# VERSION is stamped into the binaries (`xdproxy version`) and tags the image:
# the nearest tag, or the commit when there is no tag, with -dirty for
# uncommitted changes; "dev" where git or its history is missing.
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
VERSION   := $(VERSION)
LDFLAGS   := -X main.version=$(VERSION)
# The container image `make image` writes; deploy/daemonset.yaml runs $(IMAGE):latest.
IMAGE     ?= ghcr.io/xdproxy/xdproxy
IMAGE_ARCH ?= $(shell $(GO) env GOARCH)
IMAGE_TAR := $(BIN)/xdproxy-image.tar
# Debian packages the tests, the demo and the benchmark use.
DEB_PKGS  := iproute2 iperf3 curl ethtool iptables nftables tcpdump procps
DEB_BINS  := ip iperf3 curl ethtool iptables nft tcpdump ps

export XDPROXY_KUBE_BIN := $(KUBE_BIN)

.PHONY: all build image test test-unit test-race bench bench-quick lint demo generate kube-tools deps fuzz clean

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/... ./bench/cmd/... ./internal/testbed/cmd/xdproxy-demo

# image writes the container image the DaemonSet runs: a static xdproxy and
# nothing else, tagged $(IMAGE):$(VERSION) and $(IMAGE):latest, as one tarball
# for `docker load -i`, `podman load -i` or `ctr -n k8s.io images import`.
# No container engine is needed: internal/tools/mkimage writes the tarball.
image:
	CGO_ENABLED=0 GOOS=linux GOARCH=$(IMAGE_ARCH) $(GO) build -trimpath -ldflags "$(LDFLAGS)" \
		-o $(BIN)/image/linux-$(IMAGE_ARCH)/xdproxy ./cmd/xdproxy
	env -u GOOS -u GOARCH $(GO) run ./internal/tools/mkimage -binary $(BIN)/image/linux-$(IMAGE_ARCH)/xdproxy \
		-arch $(IMAGE_ARCH) -tag $(IMAGE):$(VERSION) -tag $(IMAGE):latest -o $(IMAGE_TAR)

# deps installs missing Debian packages (only when one is missing, so a
# machine that has them needs no network).
deps:
	@missing=""; for b in $(DEB_BINS); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages (missing:$$missing)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEB_PKGS) >/dev/null; \
	fi

# kube-tools builds a real kube-apiserver, etcd, kubectl and kube-proxy from
# Go modules (internal/kubetools is its own module); cached in build/kube.
kube-tools:
	./internal/kubetools/build.sh $(KUBE_BIN)

# test runs `make lint`, then every test, the privileged namespace tests
# included (run as root), then the race detector over every package that
# starts goroutines or shares memory (internal/tools/race-packages.sh says
# which). The first run takes one package at a time (-p 1): the namespace
# tests forward real traffic at line rate and must not share the two CPUs
# with another package's tests; it costs little, since cmd/xdproxy's
# end-to-end tests take most of the time anyway.
test: lint deps kube-tools build
	$(GO) test -count=1 -p 1 -timeout 25m ./...
	$(GO) test -count=1 -race -timeout 25m $$(GO=$(GO) ./internal/tools/race-packages.sh)
	@echo "make test: all tests passed"

test-unit:
	$(GO) test -short ./...

# bench is the full benchmark (about 40 minutes; root): Go microbenchmarks,
# then bin/xdproxy-bench: xdproxy (the real binary, poll and busy-poll modes,
# and its I/O floor) against kube-proxy's rule shapes and the real kube-proxy
# (from kube-tools), side by side on the NIC-shaped feed, at 1 to 100,000
# services; results in bench/results/<date>/report.md. bench-quick is the
# subset that matters most in a few minutes: xdproxy against the nftables
# shape and the I/O floor at 1 and 1,000 services.
bench: deps kube-tools build
	$(GO) test -run '^$$' -bench . -benchmem ./dataplane/... ./nat/... ./control/...
	$(BIN)/xdproxy-bench --out bench/results

bench-quick: deps build
	$(BIN)/xdproxy-bench --quick --out bench/results

# lint: gofmt, go vet and staticcheck (staticcheck.conf says which checks),
# pinned in its own module, internal/tools/staticcheck, and built into bin/.
lint:
	@files=$$(git ls-files --cached --others --exclude-standard '*.go' | while read -r f; do [ -f "$$f" ] && echo "$$f"; done); \
	out=$$(gofmt -l $$files); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) build -C internal/tools/staticcheck -o $(BIN)/staticcheck honnef.co/go/tools/cmd/staticcheck
	$(BIN)/staticcheck ./...

demo: deps build
	./deploy/demo.sh $(BIN)

# generate recompiles the XDP program (needs clang; installed from Debian).
generate:
	@command -v clang-14 >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 llvm-14 >/dev/null)
	$(GO) generate ./xdp/...

# fuzz runs every fuzz target of the repository (every `func Fuzz...` in a
# _test.go file) for FUZZTIME each, one after another, and stops at the first
# failure; the failing input is written to the package's testdata/fuzz/ as
# usual, to be committed with the fix. Each package's test binary is built
# once, with the fuzzer's coverage instrumentation (-fuzz=.), and run with its
# own -test.fuzzcachedir under build/fuzz: `go test -fuzz` with the generated
# corpus in GOCACHE was seen to stall at 0 execs/s.
# The targets in xdp run the real program and need root, like make test.
FUZZTIME ?= 20s
fuzz:
	@set -e; mkdir -p $(BIN)/fuzz; \
	for dir in $$(grep -rlE --include='*_test.go' '^func Fuzz' --exclude-dir=build --exclude-dir=.git . | xargs -n1 dirname | sort -u); do \
		pkg=$${dir#./}; bin=$(BIN)/fuzz/$$(echo $$pkg | tr / _).test; \
		$(GO) test -c -fuzz=. -o $$bin ./$$pkg; \
		for name in $$(grep -hoE '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go | cut -d' ' -f2); do \
			echo "fuzz: $$pkg $$name for $(FUZZTIME)"; \
			(cd $$dir && $$bin -test.run '^$$' -test.fuzz "^$$name\$$" -test.fuzztime $(FUZZTIME) \
				-test.fuzzcachedir $(CURDIR)/build/fuzz/$$pkg/$$name) || { echo "make fuzz: $$pkg $$name failed"; exit 1; }; \
		done; \
	done; \
	echo "make fuzz: every target ran $(FUZZTIME) without a failure"

clean:
	rm -rf $(BIN) build
