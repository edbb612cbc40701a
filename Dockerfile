# syntax=docker/dockerfile:1.7@sha256:a57df69d0ea827fb7266491f2813635de6f17269be881f696fbfdf2d83dda33e
# redlock-sidecar image: one static executable on distroless "static" (no shell, no libc),
# running as 65532, for linux/amd64 and linux/arm64 from one build:
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     -t REGISTRY/redlock-sidecar:0.1.0 --push .
#
# (one platform, loaded into the local daemon: `docker buildx build --load -t redlock-sidecar:0.1.0 .`)
# The build stage runs on the machine's own platform and cross-compiles for each target
# (scripts/build-static.sh --arch): no emulation, so an arm64 image builds as fast as an amd64 one.
# scripts/build-static.sh links glibc statically, so the same binary also runs in any job image of
# its architecture once `redlock-sidecar install DIR` has copied it there (the CronJob recipe).
# Base images are pinned by digest (the tag says what it is, the digest decides which): update
# them in one reviewed commit.

FROM --platform=$BUILDPLATFORM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS builder
ARG TARGETARCH
ARG BUILDARCH
# A cross C toolchain with glibc for the target (ring compiles C; the linker links glibc
# statically) and the Rust target, only when the target is not the build machine's.
RUN if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
      case "$TARGETARCH" in \
        arm64) pkgs="gcc-aarch64-linux-gnu libc6-dev-arm64-cross" ;; \
        amd64) pkgs="gcc-x86-64-linux-gnu libc6-dev-amd64-cross" ;; \
        *) echo "unsupported TARGETARCH $TARGETARCH" >&2; exit 1 ;; \
      esac; \
      apt-get update -qq && apt-get install -y -qq --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY . .
# The cache mounts keep the crate registry and build artefacts between builds (one per target).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=redlock-target-${TARGETARCH},sharing=locked \
    bash scripts/build-static.sh --arch "${TARGETARCH}" /out/redlock-sidecar

# distroless static: CA roots, /etc/passwd with nonroot, tzdata; nothing to execute but ours.
# Pin the digest of the multi-platform index (not of one platform's image), as for the builder.
FROM gcr.io/distroless/static-debian12:nonroot@sha256:d093aa3e30dbadd3efe1310db061a14da60299baff8450a17fe0ccc514a16639
COPY --from=builder /out/redlock-sidecar /usr/local/bin/redlock-sidecar
USER 65532:65532
EXPOSE 9707
ENTRYPOINT ["/usr/local/bin/redlock-sidecar"]
CMD ["run"]
