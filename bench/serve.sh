#!/usr/bin/env bash
# Measures sandgate's HTTP service (api/server) over the lifecycle manager
# on real sandboxes, in one run, each figure against a baseline measured in
# the same run: `exec true` over the protocol 1 exec route and over the
# Cloudflare bridge's exec route (server-sent events) against Sandbox.Run
# of what each runs on the same sandbox (p50, p99, what each adds), and the
# bridge's exec in a session against it without one; create and
# create-from-template over HTTP against Manager.Create; and downloads from
# a server inside a sandbox through the port tunnel and the TCP bridge
# against a direct loopback connection to that server (and the agent's
# port dial alone). The service runs in the bench process, over
# `sandgate sandbox` built from this checkout. Needs root (namespaces,
# overlayfs, cgroups). Extra arguments go to the bench program (-execs,
# -creates, -bulk, -rounds, -port).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/serve "$@"
