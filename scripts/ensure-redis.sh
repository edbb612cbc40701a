#!/usr/bin/env bash
# Makes sure redis-server is on PATH: installs Debian's package when we can (root), else
# says exactly what to install. Sourced by the demo and the test script.
ensure_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "redis-server is missing: installing the Debian package redis-server" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >&2 || return 1
    command -v redis-server >/dev/null 2>&1 && return 0
  fi
  echo "redis-server is required: install it with 'sudo apt-get install -y redis-server' (Debian/Ubuntu)" >&2
  return 1
}
