#!/usr/bin/env bash
# Dapr's official SDKs, unchanged, against the real binary on three local Redis nodes:
# JavaScript (@dapr/dapr) over HTTP and over gRPC, Python (dapr) over gRPC. Two sidecars share
# the nodes (a second pod of the app); each SDK runs lock, contention, wrong-owner unlock,
# unlock and expiry (scripts/dapr-sdks/check.{js,py}), then, with two nodes stopped, checks
# that a lock call says "no quorum" in a way the SDK parses. The SDKs are installed from the
# package registries, at the versions below, into the Cargo target directory (kept between runs).
#   scripts/dapr-sdks.sh                       (builds the debug binary)
#   REDLOCK_BIN=path/to/redlock-sidecar scripts/dapr-sdks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-redis.sh
ensure_redis
. scripts/cargo-target.sh
for tool in curl node npm python3; do
  command -v "$tool" >/dev/null || { echo "required: $tool"; exit 1; }
done

JS_SDK=3.18.0
PY_SDK=1.19.0
SDKS="$(cargo_target_dir)/dapr-sdks"

# The SDKs, each in a directory of its own version: installed once, checked every run.
PY="$SDKS/python-$PY_SDK"
if ! "$PY/bin/python" -c "import dapr.clients" 2>/dev/null; then
  echo "== installing the Python SDK dapr==$PY_SDK"
  rm -rf "$PY"
  python3 -m venv "$PY"
  "$PY/bin/pip" install --quiet --disable-pip-version-check "dapr==$PY_SDK"
fi
JS="$SDKS/js-$JS_SDK"
if [ ! -f "$JS/node_modules/@dapr/dapr/package.json" ]; then
  echo "== installing the JavaScript SDK @dapr/dapr@$JS_SDK"
  rm -rf "$JS"
  mkdir -p "$JS"
  echo '{"private": true}' >"$JS/package.json"
  (cd "$JS" && npm install --silent --no-audit --no-fund "@dapr/dapr@$JS_SDK")
fi
py_version=$("$PY/bin/python" -c "from importlib.metadata import version; print(version('dapr'))")
js_version=$(node -p "require('$JS/node_modules/@dapr/dapr/package.json').version")
[ "$py_version" = "$PY_SDK" ] && [ "$js_version" = "$JS_SDK" ] || {
  echo "SDK versions: dapr $py_version, @dapr/dapr $js_version (expected $PY_SDK, $JS_SDK)"; exit 1; }

if [ -z "${REDLOCK_BIN:-}" ]; then
  cargo build --quiet --bin redlock-sidecar
  REDLOCK_BIN="$(cargo_target_dir)/debug/redlock-sidecar"
fi

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
NODE_PIDS=()
URLS=()
for i in 1 2 3; do
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --dbfilename "node$i.rdb" --loglevel warning >"$WORK/node$i.log" 2>&1 &
  PIDS+=($!)
  NODE_PIDS+=($!)
  URLS+=("redis://127.0.0.1:$port")
done
REDIS=$(IFS=,; echo "${URLS[*]}")

declare -A HTTP GRPC
for name in a b; do
  HTTP[$name]=$(free_port)
  GRPC[$name]=$(free_port)
  "$REDLOCK_BIN" run --lock dapr-sdks --redis "$REDIS" --identity "sidecar-$name" --ttl 2s \
    --kubernetes off --listen "127.0.0.1:$(free_port)" \
    --control-listen "127.0.0.1:${HTTP[$name]}" --dapr-grpc-listen "127.0.0.1:${GRPC[$name]}" \
    >"$WORK/sidecar-$name.log" 2>&1 &
  PIDS+=($!)
done
logs() { for f in "$WORK"/sidecar-*.log; do echo "--- $f"; tail -n 20 "$f"; done; }

# Dapr's health check answers 204 once a round reached a quorum of nodes.
for name in a b; do
  for _ in $(seq 1 200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${HTTP[$name]}/v1.0/healthz")" = 204 ] && continue 2
    sleep 0.1
  done
  echo "sidecar $name never healthy"; logs; exit 1
done
# Fresh nodes grant a lock of ttl T once they have kept their data for T plus drift: the
# checks ask for at most 10 s, so wait until a 10 s lock can be taken.
echo "== waiting for the fresh nodes to count for a 10 s lock"
warm='{"resourceId": "warm-up", "lockOwner": "script", "expiryInSeconds": 10}'
for _ in $(seq 1 300); do
  curl -s -H 'Content-Type: application/json' -d "$warm" \
    "http://127.0.0.1:${HTTP[a]}/v1.0-alpha1/lock/redlock" | grep -q '"success":true' && break
  sleep 0.1
done
curl -s -o /dev/null -H 'Content-Type: application/json' -d "$warm" "http://127.0.0.1:${HTTP[a]}/v1.0-alpha1/unlock/redlock"

export DAPR_RUNTIME_HOST=127.0.0.1 DAPR_HTTP_PORT="${HTTP[a]}" DAPR_GRPC_PORT="${GRPC[a]}"
export DAPR_HEALTH_TIMEOUT=20 B_HTTP_PORT="${HTTP[b]}" B_GRPC_PORT="${GRPC[b]}"
export NODE_PATH="$JS/node_modules"

# run_all MODE: the three SDK runs side by side (their names differ); fails if any fails.
run_all() {
  local pids=() failed=0
  node scripts/dapr-sdks/check.js http "$1" >"$WORK/js-http.out" 2>&1 & pids+=($!)
  node scripts/dapr-sdks/check.js grpc "$1" >"$WORK/js-grpc.out" 2>&1 & pids+=($!)
  "$PY/bin/python" scripts/dapr-sdks/check.py "$1" >"$WORK/python.out" 2>&1 & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  cat "$WORK/js-http.out" "$WORK/js-grpc.out" "$WORK/python.out"
  return "$failed"
}

echo "== @dapr/dapr $JS_SDK (HTTP and gRPC) and dapr $PY_SDK (gRPC) against two sidecars"
run_all CASES || { logs; exit 1; }

echo "== two of the three nodes stopped: the lock calls say so"
for pid in "${NODE_PIDS[@]:0:2}"; do kill "$pid"; wait "$pid" 2>/dev/null || true; done
run_all NOQUORUM || { logs; exit 1; }
echo "== Dapr's SDKs: all checks passed"
