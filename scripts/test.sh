#!/usr/bin/env bash
# All tests: formatting, lints, unit and integration tests (real redis-server processes and
# the real binary), then the Kubernetes/observability checks (helm, kubernetes-validate,
# Grafana schema, promtool, a real Prometheus scraping real sidecars, Dapr's official SDKs
# against the binary, the static binary in a busybox-only chroot).
#   scripts/test.sh          everything
#   scripts/test.sh --rust   only fmt, clippy and the Rust tests
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-redis.sh
ensure_redis --with-openssl
# The fencing recipes' tests start a real PostgreSQL server.
. scripts/ensure-postgres.sh
ensure_postgres

step() { printf '\n== %s\n' "$*"; }
# --workspace: the sidecar and its lease core (core/), which has tests of its own.
step "cargo fmt --all --check"
cargo fmt --all --check
step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
# nextest runs every test as its own process, several test binaries at once: the suite's
# tests mostly wait on ttls, so this keeps the run well inside CI's budget.
if cargo nextest --version >/dev/null 2>&1; then
  step "cargo nextest run --workspace"
  cargo nextest run --workspace --no-fail-fast --status-level fail --final-status-level slow
else
  step "cargo test --workspace"
  cargo test --workspace --quiet
fi

if [ "${1:-}" != "--rust" ]; then
  # The static binary's release build (about 4 min of CPU) runs while the checks below mostly
  # wait on Prometheus and on rendering; its test follows them. A target directory of its own,
  # so that their debug builds do not wait for its lock.
  static_out="$(mktemp)" static_log="$(mktemp)"
  . scripts/cargo-target.sh
  CARGO_TARGET_DIR="$(cargo_target_dir)/static" bash scripts/build-static.sh >"${static_out}" 2>"${static_log}" &
  static_build=$!
  step "Kubernetes chart, manifests, dashboard and alert checks"
  bash scripts/ci-k8s.sh
  step "End to end: Prometheus scrapes real sidecars; every panel and alert query evaluates"
  bash scripts/e2e-prometheus.sh
  step "Dapr's SDKs unchanged (JavaScript over HTTP and gRPC, Python over gRPC) against the binary"
  bash scripts/dapr-sdks.sh
  step "Static binary: guard in a chroot with only busybox"
  if ! wait "${static_build}"; then
    cat "${static_log}"
    exit 1
  fi
  STATIC_BIN="$(tail -n 1 "${static_out}")" bash scripts/e2e-static.sh
fi
step "all tests passed"
