#!/usr/bin/env bash
# The protocol model (tests/model/), and the shards model beside it: every instance, the long
# ones included (3 clients, two data-loss faults, lost requests with a pause and a SIGTERM, mixed
# ttls with retries; shards with a lost request, a pause, a flush, each also with a member
# joining, and an app that stops at its revoke deadline through a SIGTERM and a pause), each an
# exhaustive depth-first run of a release build, one at a time (each checker uses two threads).
# `cargo test --test model` (part of scripts/test.sh) runs only the short instances and each
# rule's counterexample. See docs/reliability.md, "The protocol model", for sizes and times.
#   scripts/model-check.sh           every instance
#   scripts/model-check.sh FILTER    only the tests whose name contains FILTER
# About 45 minutes on two cores. MODEL_MAX_STATES (default 700,000,000, counting revisits)
# bounds each run; a run that reaches it fails as not exhaustive. A depth-first run keeps about
# 17 bytes per state, so the largest instance (564 M with revisits) needs about 10 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
export MODEL_MAX_STATES=${MODEL_MAX_STATES:-700000000}
exec cargo test --release --test model -- --include-ignored --nocapture --test-threads=1 "$@"
