#!/usr/bin/env bash
# Makes sure a PostgreSQL server is installed (its initdb, pg_ctl and psql): the fencing recipe
# tests (tests/locks.rs, tests/recipes.rs) start their own server in a temporary directory on a free loopback port
# and stops it again. Installs the Debian package when we can (root), else says what to
# install. Sourced by the test script and the lock demo.
postgres_installed() {
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && return 0
  command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]
}

ensure_postgres() {
  postgres_installed && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "missing: postgresql: installing the Debian package" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2 || return 1
    postgres_installed && return 0
  fi
  echo "required: install PostgreSQL with 'sudo apt-get install -y postgresql' (Debian/Ubuntu)" >&2
  return 1
}
