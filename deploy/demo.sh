#!/bin/bash
# make demo: run the demo program against the freshly built binaries.
set -euo pipefail
bin=${1:-bin}
exec "$bin/xdproxy-demo" --bin "$bin"
