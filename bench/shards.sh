#!/usr/bin/env bash
# Measures sandgate's shards over one store, in one run, each figure
# against a baseline measured in the same run: `exec true` through another
# shard (forwarded) against through the owner (p50, p99, what forwarding
# adds); a migration (the owner SIGTERMed with a sandbox of 10 MB changed
# → its first command answered on the other shard); and the store writes
# one shard makes per second holding 1000 sandboxes' leases, against a
# lease renewed per sandbox. Two `sandgate serve` processes built from
# this checkout share a directory store under /var/tmp. Needs root.
# Extra arguments go to the bench program (-execs, -migrations,
# -changed-mb, -leases).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/shards "$@"
