#!/usr/bin/env bash
# Makes sure redis-server (and openssl, which the TLS test uses) are on PATH: installs the
# Debian packages when we can (root), else says exactly what to install. Sourced by the demo
# and the test script. The Sentinel and cluster-mode tests need nothing more: they run the same
# binary as `redis-server CONF --sentinel` and build clusters with CLUSTER commands (no
# redis-sentinel or redis-cli). REDLOCK_TEST_REDIS_SERVER names another server binary to test
# against (e.g. valkey-server); this script does not install it.
ensure_redis() {
  local missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  [ "${1:-}" = "--with-openssl" ] && ! command -v openssl >/dev/null 2>&1 && missing+=(openssl)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "missing: ${missing[*]}: installing the Debian packages" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >&2 || return 1
    command -v redis-server >/dev/null 2>&1 && return 0
  fi
  echo "required: install them with 'sudo apt-get install -y ${missing[*]}' (Debian/Ubuntu)" >&2
  return 1
}
