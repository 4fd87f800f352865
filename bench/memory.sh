#!/usr/bin/env bash
# Measures what an authenticated client can make `sandgate serve` hold:
# serve's resident memory before and after 1,000 chatty commands and 20
# concurrent module uploads, against the bound README.md states (its
# "Limits" section). Starts a real serve (built from this checkout, or
# -bin FILE for another build, e.g. an older one for the figures before)
# on loopback with its state in a temporary directory. Needs root
# (sandboxes). Extra arguments go to the bench program (-commands,
# -parallel, -output, -uploads, -sandboxes, -module, -bound, -bin).
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/memory "$@"
