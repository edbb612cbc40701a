# syntax=docker/dockerfile:1.7
# redlock-sidecar image: the binary on a distroless base (no shell), running as 65532.
#
#   docker build -t redlock-sidecar:0.1.0 .
#
# The binary links glibc, so the runtime base is distroless "cc" (glibc, libgcc, CA roots),
# not "static".

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# The cache mounts keep the crate registry and build artefacts between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin redlock-sidecar \
    && install -D -m 0755 target/release/redlock-sidecar /out/redlock-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/redlock-sidecar /usr/local/bin/redlock-sidecar
USER 65532:65532
EXPOSE 9707
ENTRYPOINT ["/usr/local/bin/redlock-sidecar"]
CMD ["run"]
