#!/usr/bin/env bash
# Measures what a CPU hog in one sandbox takes from another and from the
# service, in one run: sandbox A runs eight busy loops (each in a session of
# its own, as a hostile tenant would start them); sandbox B's `exec true`
# p50 through the API, a fixed CPU-bound loop in B and the API's p99
# (GET /v1/sandboxes/B) are each divided by the same with A idle, the two
# phases taking turns. Targets: B's loop keeps >= 0.8 of its idle
# throughput on 2 cores, the API's p99 within 2x. The service runs in the
# bench process over `sandgate sandbox` built from this checkout, with its
# default limits. Needs root. The tenants part of bench/serve; extra
# arguments go to it (-tenant-rounds, -tenant-execs, -tenant-api).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/serve -only tenants "$@"
