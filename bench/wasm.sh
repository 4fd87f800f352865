#!/usr/bin/env bash
# Measures WebAssembly transform modules on `sandgate proxy`'s base-URL
# routes, in one run: added latency per routed request (p50, p99) and
# request rate with 0, 1 and 3 modules loaded, against a direct connection to
# the same loopback HTTPS upstream; and what a module that loops forever on
# some requests costs the others. Builds the proxy and the modules from this
# checkout. Needs root (the upstream listens on 127.x.y.z:443, the only port
# the proxy dials). Extra arguments go to the bench program (-duration,
# -concurrency, -loopers, ...; -h lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/wasm "$@"
