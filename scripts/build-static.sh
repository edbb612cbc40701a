#!/usr/bin/env bash
# Builds redlock-sidecar as one static executable (static glibc, static-pie) that runs in any
# Linux container image of its architecture: Alpine (musl), UBI, Ubuntu, Amazon Linux,
# distroless-static, scratch.
#   scripts/build-static.sh                     build for this machine's architecture; print the binary's path
#   scripts/build-static.sh DEST                build, then copy the binary to DEST
#   scripts/build-static.sh --arch arm64 [DEST] build for another architecture (amd64 or arm64)
# The architecture defaults to $TARGETARCH (what `docker buildx` passes to a build stage), else
# this machine's. Used by the Dockerfile and by CI (scripts/e2e-static.sh), so both ship the
# same binary.
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
#
# Cross builds (e.g. arm64 on an x86-64 machine) need the Rust target (`rustup target add
# aarch64-unknown-linux-gnu`, done here when rustup is present) and a cross C toolchain with
# glibc for the target (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross; for amd64 on arm64:
# gcc-x86-64-linux-gnu libc6-dev-amd64-cross): `ring` compiles C, and the linker links glibc.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cargo-target.sh
. scripts/cargo-target.sh

host_arch() {
  case "$(uname -m)" in
    x86_64 | amd64) echo amd64 ;;
    aarch64 | arm64) echo arm64 ;;
    *) uname -m ;;
  esac
}
ARCH="${TARGETARCH:-$(host_arch)}"
if [ "${1:-}" = "--arch" ]; then
  ARCH="${2:?--arch needs amd64 or arm64}"
  shift 2
fi
case "${ARCH}" in
  amd64) TARGET=x86_64-unknown-linux-gnu GNU=x86_64-linux-gnu MACHINE='X86-64'
         DEBIAN_CROSS='gcc-x86-64-linux-gnu libc6-dev-amd64-cross' ;;
  arm64) TARGET=aarch64-unknown-linux-gnu GNU=aarch64-linux-gnu MACHINE='AArch64'
         DEBIAN_CROSS='gcc-aarch64-linux-gnu libc6-dev-arm64-cross' ;;
  *) echo "build-static: unsupported architecture ${ARCH} (amd64 or arm64)" >&2; exit 2 ;;
esac

if [ "${ARCH}" != "$(host_arch)" ]; then
  if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "${TARGET}"; then
    rustup target add "${TARGET}" >&2
  fi
  if ! command -v "${GNU}-gcc" >/dev/null; then
    echo "build-static: cross-building for ${ARCH} needs ${GNU}-gcc and glibc for ${ARCH} (Debian: ${DEBIAN_CROSS})" >&2
    exit 1
  fi
  triple_env="$(tr 'a-z-' 'A-Z_' <<<"${TARGET}")"
  export "CARGO_TARGET_${triple_env}_LINKER=${GNU}-gcc"
  export "CC_${TARGET//-/_}=${GNU}-gcc" "AR_${TARGET//-/_}=${GNU}-ar"
fi

export RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static --cfg getrandom_backend=\"linux_getrandom\""
cargo build --release --locked --bin redlock-sidecar --target "${TARGET}" >&2
BIN="$(cargo_target_dir)/${TARGET}/release/redlock-sidecar"

# A dynamic executable has an interpreter (PT_INTERP); refuse to hand one out as static.
if LC_ALL=C readelf -l "${BIN}" | grep -q 'Requesting program interpreter'; then
  echo "build-static: ${BIN} is not static" >&2
  exit 1
fi
if ! LC_ALL=C readelf -h "${BIN}" | grep -q "Machine: .*${MACHINE}"; then
  echo "build-static: ${BIN} is not a ${ARCH} executable" >&2
  exit 1
fi
if [ -n "${1:-}" ]; then
  install -D -m 0755 "${BIN}" "$1"
  echo "$1"
else
  echo "${BIN}"
fi
