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

# copy-binary: the distroless image has no shell and no cp, but the CronJob example needs to
# copy the binary into an emptyDir for `redlock-sidecar guard` (an init container runs
# `copy-binary /usr/local/bin/redlock-sidecar /redlock/redlock-sidecar`).
COPY <<'RS' /tmp/copy-binary.rs
use std::{env, fs, os::unix::fs::PermissionsExt, process};

fn main() {
    let args: Vec<String> = env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: copy-binary SOURCE DEST");
        process::exit(2);
    }
    let tmp = format!("{}.tmp", args[2]);
    let result = fs::copy(&args[1], &tmp)
        .and_then(|_| fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)))
        .and_then(|_| fs::rename(&tmp, &args[2]));
    if let Err(err) = result {
        eprintln!("copy-binary: {} -> {}: {}", args[1], args[2], err);
        process::exit(1);
    }
}
RS
RUN rustc -C opt-level=2 -C strip=symbols -o /out/copy-binary /tmp/copy-binary.rs

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/redlock-sidecar /usr/local/bin/redlock-sidecar
COPY --from=builder /out/copy-binary /usr/local/bin/copy-binary
USER 65532:65532
EXPOSE 9707
ENTRYPOINT ["/usr/local/bin/redlock-sidecar"]
CMD ["run"]
