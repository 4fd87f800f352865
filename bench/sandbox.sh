#!/usr/bin/env bash
# Measures real sandboxes in one run, p50 and p99: appliance.Create until a
# first command has run (and the `sandgate sandbox run --detach` CLI call
# alone), an `exec true` round trip through the agent (and through the CLI),
# and egress throughput of curl inside a sandbox through the relay against
# curl on the host through the same relay.Proxy on a TCP listener.
# Needs root (namespaces, overlayfs, cgroups; the upstream listens on
# 127.x.y.z:443). Extra arguments go to the bench program (-bulk, -creates,
# -execs, -cpuprofile, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/sandbox "$@"
