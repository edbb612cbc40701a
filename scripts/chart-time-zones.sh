#!/usr/bin/env bash
# Writes charts/redlock-sidecar/files/time-zones.txt, the IANA time zone names cronjob.timeZone
# accepts (every zone and link of the tzdata installed here: Debian's tzdata package).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZI=/usr/share/zoneinfo/tzdata.zi
VERSION="$(sed -n 's/^# version //p' "${ZI}")"
{
  echo "# IANA time zone names (tzdata ${VERSION}: its zones and links), one a line: the values cronjob.timeZone accepts."
  echo "# Generated from tzdata's tzdata.zi; regenerate with scripts/chart-time-zones.sh."
  awk '$1 == "Z" { print $2 } $1 == "L" { print $3 }' "${ZI}" | LC_ALL=C sort -u
} >"${REPO_ROOT}/charts/redlock-sidecar/files/time-zones.txt"
