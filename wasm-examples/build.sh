#!/bin/sh
# Builds every example module into a directory (default: ./build), with the
# standard Go toolchain: reactors for GOOS=wasip1 GOARCH=wasm.
#
#   ./build.sh [OUTDIR]
#
# Then run one through the proxy, with its config inline after "?":
#
#   sandgate proxy --transform-module "build/add-header.wasm?$(cat add-header/config.txt)" ...
set -eu
cd "$(dirname "$0")"
out=${1:-build}
mkdir -p "$out"
case $out in /*) ;; *) out=$(pwd)/$out ;; esac
for dir in add-header deny-path redact-body audit-tag budget; do
	GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared -o "$out/$dir.wasm" "./$dir"
	echo "$out/$dir.wasm"
done
