#!/usr/bin/env bash
# build.sh [OUTDIR] builds the real Kubernetes programs that control-plane tests and
# benchmarks run against: kube-apiserver, etcd, kubectl and kube-proxy.
#
# OUTDIR defaults to build/kube/bin at the repository root, where internal/kubetest
# looks for them. Nothing is rebuilt while every binary is newer than this module's
# go.mod, go.sum, sources and this script. A cold build takes minutes and a few GB
# of memory; the Go build cache makes later rebuilds fast.
set -euo pipefail

module_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$module_dir/../.." && pwd)
out=${1:-$repo_root/build/kube/bin}
mkdir -p "$out"
out=$(cd "$out" && pwd)

tools=(kube-apiserver etcd kubectl kube-proxy)
cd "$module_dir"
inputs=(go.mod go.sum build.sh cmd/*/*.go)

up_to_date() {
	local tool input
	for tool in "${tools[@]}"; do
		[[ -x $out/$tool ]] || return 1
		for input in "${inputs[@]}"; do
			[[ $out/$tool -nt $input ]] || return 1
		done
	done
}

if up_to_date; then
	echo "kube tools in $out are up to date"
	exit 0
fi

# Stamp the version the binaries really are, as release builds do, so that
# /version and `kubectl version` report v1.x.y rather than v0.0.0-master.
version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ { print $2; exit }' go.mod)
major=${version#v}
major=${major%%.*}
minor=${version#v*.}
minor=${minor%%.*}
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"

echo "building ${tools[*]} $version into $out"
# The machine is shared: build at low priority. Static binaries, like upstream's.
GOWORK=off CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ldflags" -o "$out/" ./cmd/...

# go build leaves a binary untouched when it is already current; touch it so the
# staleness check above sees it as newer than the inputs.
for tool in "${tools[@]}"; do
	touch "$out/$tool"
done
