# syntax=docker/dockerfile:1
#
# The image Cloud Run runs: sandgate, and the read-only root every sandbox
# sees (Google's sandbox CLI mounts the service's own image as each
# sandbox's /). So it is a good machine for coding agents, and it holds no
# secret, no credential helper and nothing of the service's configuration:
# every sandbox can read every byte of it. Configuration comes from the
# service's environment and Secret Manager at deploy time (deploy/README.md).
#
#   docker build --build-arg VERSION=v0.1.0 --build-arg COMMIT=$(git rev-parse HEAD) -t sandgate .
#
# Your own tools go in an image of yours built FROM this one (a second
# FROM, see deploy/README.md, "Your own tools"), not here.
#
# The base images are arguments so that deploy/check-image.sh can build this
# file offline, on local bases; pin them by digest in your own builds
# (golang:1.26-bookworm@sha256:..., node:24-bookworm-slim@sha256:...).
ARG GO_IMAGE=golang:1.26-bookworm
ARG RUNTIME_IMAGE=node:24-bookworm-slim

FROM ${GO_IMAGE} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# What `sandgate version` reports (the build context has no .git to read
# them from); the template namespace is a digest of the version and
# SANDBOX_IMAGE_ID.
ARG VERSION=dev
ARG COMMIT=unknown
# A static binary (no libc: it is also bind-mounted into every sandbox as
# its agent), no local paths, no symbol tables. cmd/sandgate/image_test.go
# runs the lines between the two markers exactly as written here, and
# internal/testkit/gobuild compiles the binary the tests run with the same
# CGO_ENABLED and -trimpath.
# image-build-begin
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X main.linkVersion=${VERSION} -X main.linkCommit=${COMMIT}" \
      -o /out/sandgate ./cmd/sandgate
# image-build-end

FROM ${RUNTIME_IMAGE}
# What a coding agent expects on its machine. Node.js 24 (and npm) come
# with the base image. Beside them, for `sandgate sandbox` where the image
# runs sandboxes itself (Kubernetes, deploy/kubernetes): e2fsprogs (mke2fs
# makes template images) and tini, an init to run serve under where it
# would be a container's pid 1 (it reaps the sandbox monitors that end
# there and passes signals on).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl e2fsprogs git procps python3 ripgrep tini \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/sandgate /usr/local/bin/sandgate
# Fail the build, not a sandbox, when a tool is missing.
RUN node --version && npm --version && git --version && rg --version \
 && python3 --version && curl --version && ps --version && mke2fs -V && tini --version \
 && sandgate version
# No USER: Google's sandbox CLI starts sandboxes for a service running as
# root, and `sandgate sandbox` needs root for its namespaces.
EXPOSE 8080
CMD ["sandgate", "serve"]
