#!/usr/bin/env bash
# Makes sure PostgreSQL's server programs (initdb, pg_ctl, postgres) and psql are installed, for
# the fencing recipes' test (tests/recipes.rs): installs Debian's packages when we can (root),
# else says exactly what to install. The test starts its own server on a free loopback port.
ensure_postgres() {
  if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v psql >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "missing: PostgreSQL: installing the Debian packages" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2 || return 1
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && return 0
  fi
  echo "required: install PostgreSQL with 'sudo apt-get install -y postgresql' (Debian/Ubuntu)" >&2
  return 1
}
