#!/usr/bin/env bash
# Measures `sandgate proxy` against a direct connection to the same loopback
# HTTPS upstream, in one run: CONNECT tunnel throughput, base-URL route
# request rate, and added latency per routed request (p50, p99).
# Needs root (the upstream listens on 127.x.y.z:443, the only port the proxy
# dials). Extra arguments go to the bench program (-bulk, -duration, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/proxy "$@"
