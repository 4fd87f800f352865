#!/usr/bin/env bash
# Checks that the Dockerfile builds and that its image is what it promises,
# without pulling a base image: the bases are made here, from Debian's
# packages, and given to the Dockerfile through its GO_IMAGE and
# RUNTIME_IMAGE arguments.
#
#   deploy/check-image.sh            as root; needs debootstrap and podman
#                                    (apt-get install debootstrap podman)
#
# The local bases stand in for the real ones: a Debian bookworm root made
# with debootstrap (the release node:24-bookworm-slim and golang:1.26-bookworm
# are built on), with Debian's nodejs and npm in place of Node.js 24, and
# this machine's Go toolchain copied in for the build stage. So a pass says:
# the Dockerfile builds, its build stage makes a static sandgate that reports
# the version it was given, its runtime stage installs and finds every tool,
# runs `sandgate serve` by default, and sets no environment or credential
# helper of its own. It does not say anything about the real base images'
# own contents (pin those by digest where you build).
#
# Where it cannot run (not root, no debootstrap or podman, no network to a
# Debian mirror), it says so and exits 0, unless CHECK_IMAGE_STRICT=1 (then 2).
#
# Environment: MIRROR (default http://deb.debian.org/debian), SUITE (default
# bookworm), STORAGE_DRIVER (a podman storage driver, e.g. vfs where overlay
# does not work), KEEP_IMAGES=1 to keep the images it built, REUSE_BASES=1
# to keep the local bases and use them again next time.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
	echo "check-image: SKIPPED: $*" >&2
	if [ "${CHECK_IMAGE_STRICT:-0}" = 1 ]; then exit 2; fi
	exit 0
}
fail() {
	echo "check-image: FAILED: $*" >&2
	exit 1
}

[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, and podman's storage)"
command -v debootstrap >/dev/null || skip "needs debootstrap (apt-get install debootstrap)"
command -v podman >/dev/null || skip "needs podman (apt-get install podman)"
command -v go >/dev/null || skip "needs a Go toolchain on this machine, for the local build base"

MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
PODMAN=(podman --cgroup-manager=cgroupfs --events-backend=file ${STORAGE_DRIVER:+--storage-driver="$STORAGE_DRIVER"})
TAG=localhost/sandgate-check
VERSION=check-$(date -u +%Y%m%dT%H%M%SZ)
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
WORK=$(mktemp -d /tmp/sandgate-check-image-XXXXXX)
cleanup() {
	rm -rf "$WORK"
	if [ "${KEEP_IMAGES:-0}" != 1 ]; then
		"${PODMAN[@]}" rmi -f "$TAG/image:latest" >/dev/null 2>&1 || true
		if [ "${REUSE_BASES:-0}" != 1 ]; then
			"${PODMAN[@]}" rmi -f "$TAG/go-base:latest" "$TAG/runtime-base:latest" >/dev/null 2>&1 || true
		fi
	fi
}
trap cleanup EXIT

if [ "${REUSE_BASES:-0}" = 1 ] && "${PODMAN[@]}" image exists "$TAG/go-base:latest" && "${PODMAN[@]}" image exists "$TAG/runtime-base:latest"; then
	echo "check-image: reusing the local bases (REUSE_BASES=1)"
else
echo "check-image: making a Debian $SUITE root from $MIRROR (debootstrap)"
if ! debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$WORK/root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
	tail -20 "$WORK/debootstrap.log" >&2
	if grep -qiE "couldn't download|failed getting release|unable to fetch|temporary failure resolving" "$WORK/debootstrap.log"; then
		skip "debootstrap could not reach $MIRROR; log above"
	fi
	fail "debootstrap failed; log above"
fi
# Node.js and npm in the root, as node:24-bookworm-slim has them (Debian's
# are older: they stand in). Installed in a chroot of its own mount
# namespace, with this machine's resolver.
cp /etc/resolv.conf "$WORK/root/etc/resolv.conf"
unshare --mount --fork sh -ec '
	mount -t proc proc "$1/proc"
	chroot "$1" sh -ec "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null"
' sh "$WORK/root" >"$WORK/nodejs.log" 2>&1 || { tail -20 "$WORK/nodejs.log" >&2; fail "installing nodejs and npm in the local base; log above"; }
rm -rf "$WORK/root/var/lib/apt/lists/"* "$WORK/root/var/cache/apt/"*.bin
: >"$WORK/root/etc/resolv.conf"

echo "check-image: importing the local bases"
tar -C "$WORK/root" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$TAG/runtime-base:latest" >/dev/null \
	|| fail "podman import of the runtime base"
# The build base trusts what this machine trusts (a TLS-inspecting proxy
# may stand between it and the Go module proxy): its extra CAs, in the
# local build base only, never in the image.
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
	cp /usr/local/share/ca-certificates/*.crt "$WORK/root/usr/local/share/ca-certificates/"
	chroot "$WORK/root" update-ca-certificates >/dev/null 2>&1 || fail "update-ca-certificates in the build base"
fi
goroot=$(go env GOROOT)
mkdir -p "$WORK/root/usr/local/go"
cp -a "$goroot/." "$WORK/root/usr/local/go/"
tar -C "$WORK/root" -c . | "${PODMAN[@]}" import \
	--change 'ENV PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	--change 'CMD ["/bin/bash"]' - "$TAG/go-base:latest" >/dev/null \
	|| fail "podman import of the build base"
fi

echo "check-image: building the Dockerfile (version $VERSION)"
# chroot isolation: RUN steps need no OCI runtime or cgroup controllers
# (which a host in cgroup hybrid mode, or a container, may not give).
"${PODMAN[@]}" build --isolation=chroot --network=host --pull=never \
	--build-arg GO_IMAGE="$TAG/go-base:latest" \
	--build-arg RUNTIME_IMAGE="$TAG/runtime-base:latest" \
	--build-arg VERSION="$VERSION" --build-arg COMMIT="$COMMIT" \
	-t "$TAG/image:latest" -f Dockerfile . || fail "the Dockerfile does not build"

echo "check-image: checking the image"
# The image's files, run in a chroot without network: no OCI runtime, which
# a host in a container may not let set its limits.
mnt=$("${PODMAN[@]}" image mount "$TAG/image:latest") || fail "podman image mount"
unmount() { "${PODMAN[@]}" image unmount "$TAG/image:latest" >/dev/null 2>&1 || true; }
trap 'unmount; cleanup' EXIT
run() { unshare --net --mount --pid --fork --mount-proc="$mnt/proc" chroot "$mnt" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }
out=$(run sandgate version) || fail "sandgate version does not run in the image"
grep -qx "sandgate version $VERSION" <<<"$out" || fail "sandgate version printed: $out"
grep -qx "commit $COMMIT" <<<"$out" || fail "sandgate version printed: $out"
run sh -ec 'node --version; npm --version; git --version; rg --version | head -1; python3 --version; curl --version | head -1; ps --version; mke2fs -V; tini --version' \
	|| fail "a tool is missing from the image"
# Static: it runs as every sandbox's agent whatever libc the image has.
run sh -ec 'head -c 4096 /usr/local/bin/sandgate | grep -q "ld-linux" && exit 1 || true' \
	|| fail "sandgate in the image is dynamically linked"
cmd=$("${PODMAN[@]}" image inspect --format '{{json .Config.Cmd}}' "$TAG/image:latest")
[ "$cmd" = '["sandgate","serve"]' ] || fail "the image's command is $cmd, want [\"sandgate\",\"serve\"]"
envs=$("${PODMAN[@]}" image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$TAG/image:latest" | grep -v '^PATH=' | grep -v '^$' || true)
[ -z "$envs" ] || fail "the image sets environment beyond PATH (every sandbox reads it): $envs"
run sh -ec '! git config --system --get-regexp "^credential" && ! git config --global --get-regexp "^credential" && [ ! -e /root/.config/gcloud ] && [ ! -e /root/.docker/config.json ]' \
	|| fail "the image holds a credential helper or credentials"

echo "check-image: OK: the Dockerfile builds on local $SUITE bases, sandgate $VERSION is static, the tools are there, nothing is configured"
