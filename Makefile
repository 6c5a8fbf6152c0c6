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
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/... ./bench/cmd/...

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

# test runs every test, the privileged namespace tests included (run as root).
test: deps kube-tools build
	$(GO) vet ./...
	$(GO) test -count=1 -timeout 25m ./...
	$(GO) test -count=1 -race -timeout 10m ./nat/... ./dataplane/service/... ./dataplane
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

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

demo: deps build
	./deploy/demo.sh $(BIN)

# generate recompiles the XDP program (needs clang; installed from Debian).
generate:
	@command -v clang-14 >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 llvm-14 >/dev/null)
	$(GO) generate ./xdp/...

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParse -fuzztime 60s ./nat/packet

clean:
	rm -rf $(BIN) build
