#!/usr/bin/env bash
# Builds redlock-sidecar as one static executable (static glibc, static-pie) that runs in any
# Linux container image: Alpine (musl), UBI, Ubuntu, Amazon Linux, distroless-static, scratch.
#   scripts/build-static.sh            build; print the binary's path
#   scripts/build-static.sh DEST       build, then copy the binary to DEST
# Used by the Dockerfile and by CI (scripts/e2e-static.sh), so both ship the same binary.
#
# Why these flags:
# - `+crt-static` with an explicit `--target` links glibc statically into the binary only
#   (build scripts and proc-macros, built for the host, stay dynamic).
# - `getrandom_backend="linux_getrandom"`: the getrandom crate finds the getrandom(2) wrapper
#   through dlsym(), which a static executable does not have, and would fall back to reading
#   /dev/urandom. This cfg calls the system call directly, so the binary needs no /dev node
#   for randomness.
# Name resolution: glibc >= 2.34 has its `files` and `dns` NSS modules inside libc itself, so
# /etc/hosts and /etc/resolv.conf (cluster DNS) work without any shared library.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cargo-target.sh
. scripts/cargo-target.sh

TARGET=x86_64-unknown-linux-gnu
export RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static --cfg getrandom_backend=\"linux_getrandom\""
cargo build --release --locked --bin redlock-sidecar --target "${TARGET}" >&2
BIN="$(cargo_target_dir)/${TARGET}/release/redlock-sidecar"

# A dynamic executable has an interpreter (PT_INTERP); refuse to hand one out as static.
if LC_ALL=C readelf -l "${BIN}" | grep -q 'Requesting program interpreter'; then
  echo "build-static: ${BIN} is not static" >&2
  exit 1
fi
if [ -n "${1:-}" ]; then
  install -D -m 0755 "${BIN}" "$1"
  echo "$1"
else
  echo "${BIN}"
fi
