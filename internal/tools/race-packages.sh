#!/bin/sh
# race-packages.sh prints the packages `make test` runs under the race
# detector, one per line (./dir): every package of the module whose files or
# tests start a goroutine (a `go` statement) or use sync or sync/atomic.
# A package with neither has no data race for the detector to find.
set -eu
cd "$(dirname "$0")/../.."
top=$(pwd)
${GO:-go} list -f '{{.Dir}}{{range .GoFiles}} {{.}}{{end}}{{range .TestGoFiles}} {{.}}{{end}}{{range .XTestGoFiles}} {{.}}{{end}}' ./... |
while read -r dir files; do
	[ -n "$files" ] || continue
	# shellcheck disable=SC2086 # files is a list
	if (cd "$dir" && grep -qE '^[[:space:]]+go [[:alnum:]_(]|^[[:space:]]*"sync(/atomic)?"$|^import "sync(/atomic)?"$' $files); then
		echo "./${dir#"$top"/}"
	fi
done
