#!/usr/bin/env bash
# Soak: N handoffs of the Redlock engine under random faults (Redis restarts and pauses, holder
# crashes and pauses, partitions, latency, and data lost without a restart: FLUSHALL/FLUSHDB,
# restores from an older snapshot, failovers to a replica that missed writes), checked for
# mutual exclusion and token order.
#   scripts/soak.sh [N]                      N handoffs (default 10000), a new random seed
#   REDLOCK_SOAK_SEED=S scripts/soak.sh [N]  replay the fault sequence of seed S
# Prints the seed first and a summary table at the end; see docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-redis.sh
ensure_redis
REDLOCK_SOAK=${1:-10000} cargo test --release --test faults soak -- --nocapture
