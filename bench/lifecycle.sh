#!/usr/bin/env bash
# Measures the lifecycle manager on real sandboxes and a local store, in one
# run: a 650 MB template (an agent-like tree made by bench/snapshot/gentree
# inside a sandbox) and 10 MB changed by each sandbox made from it. Prints
# suspend and resume times, the suspended object's size against the bytes
# changed, create-from-template against create-from-image (p50), a full
# layer's save against `tar | zstd -1` of the same tree, and SaveAll of 4
# such sandboxes. Needs root (namespaces, overlayfs, cgroups, loop devices)
# and zstd (installed from Debian's packages if missing). Extra arguments go
# to the bench program (-mb, -changed-mb, -creates, -saveall).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v zstd >/dev/null; then
	echo "installing zstd" >&2
	apt-get install -y zstd >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y zstd >/dev/null; }
fi
exec go run ./bench/lifecycle "$@"
