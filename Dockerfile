# syntax=docker/dockerfile:1.7
# redlock-sidecar image: one static executable on distroless "static" (no shell, no libc),
# running as 65532.
#
#   docker build -t redlock-sidecar:0.1.0 .
#
# scripts/build-static.sh links glibc statically (static-pie), so the same binary also runs in
# any job image once `redlock-sidecar install DIR` has copied it there (see the CronJob recipe).

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# The cache mounts keep the crate registry and build artefacts between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    bash scripts/build-static.sh /out/redlock-sidecar

# distroless static: CA roots, /etc/passwd with nonroot, tzdata; nothing to execute but ours.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=builder /out/redlock-sidecar /usr/local/bin/redlock-sidecar
USER 65532:65532
EXPOSE 9707
ENTRYPOINT ["/usr/local/bin/redlock-sidecar"]
CMD ["run"]
