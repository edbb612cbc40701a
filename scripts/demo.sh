#!/usr/bin/env bash
# Local demo: three redis-server nodes, three sidecars contending for one lock; shows each
# sidecar's /leader, stops the leader with SIGTERM, shows the takeover, cleans up.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-redis.sh
ensure_redis
. scripts/cargo-target.sh

TTL=${TTL:-3s}
cargo build --quiet --bin redlock-sidecar
BIN="$(cargo_target_dir)/debug/redlock-sidecar"
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
http_get() { python3 - "$1" "${2:-GET}" <<'PY'
import sys, urllib.request, urllib.error
try:
    request = urllib.request.Request(sys.argv[1], method=sys.argv[2])
    r = urllib.request.urlopen(request, timeout=6); print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except Exception as e:
    print("down", e)
PY
}

URLS=()
for i in 1 2 3; do
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --dbfilename "n$i.rdb" --loglevel warning >"$WORK/redis$i.log" 2>&1 &
  PIDS+=($!)
  URLS+=("redis://127.0.0.1:$port")
done
REDIS=$(IFS=,; echo "${URLS[*]}")
echo "== three Redis masters: ${URLS[*]}"
for url in "${URLS[@]}"; do  # every node answers before anything uses them
  for _ in $(seq 1 100); do
    [ "$(redis-cli -p "${url##*:}" PING 2>/dev/null)" = PONG ] && break
    sleep 0.05
  done
  [ "$(redis-cli -p "${url##*:}" PING 2>/dev/null)" = PONG ] || { echo "$url does not answer"; cat "$WORK"/redis*.log; exit 1; }
done
"$BIN" check --redis "$REDIS" --ttl "$TTL"

declare -A ADMIN CONTROL SIDECAR
for name in alpha beta gamma; do
  port=$(free_port)
  ADMIN[$name]="127.0.0.1:$port"
  CONTROL[$name]="127.0.0.1:$(free_port)"
  "$BIN" run --lock demo --redis "$REDIS" --ttl "$TTL" --listen "127.0.0.1:$port" --identity "$name" \
    --control-listen "${CONTROL[$name]}" \
    >"$WORK/$name.log" 2>&1 &
  SIDECAR[$name]=$!
  PIDS+=($!)
done

echo "== waiting for a leader (a fresh Redis node counts only once it has kept its data for ttl + drift)"
leader=""
for _ in $(seq 1 200); do
  for name in alpha beta gamma; do
    case "$(http_get "http://${ADMIN[$name]}/leader")" in 200*) leader=$name ;; esac
  done
  [ -n "$leader" ] && break
  sleep 0.1
done
[ -n "$leader" ] || { echo "no leader elected"; cat "$WORK"/*.log; exit 1; }
for name in alpha beta gamma; do echo "$name: $(http_get "http://${ADMIN[$name]}/leader")"; done

echo "== SIGTERM to the leader ($leader): it releases the lock; a standby takes over at once"
kill -TERM "${SIDECAR[$leader]}"
new=""
for _ in $(seq 1 500); do
  for name in alpha beta gamma; do
    [ "$name" = "$leader" ] && continue
    case "$(http_get "http://${ADMIN[$name]}/leader")" in 200*) new=$name ;; esac
  done
  [ -n "$new" ] && break
  sleep 0.01
done
[ -n "$new" ] || { echo "no takeover"; cat "$WORK"/*.log; exit 1; }
handoff_ms=$(python3 - "$WORK/$leader.log" "$WORK/$new.log" <<'PY'
import sys, re, datetime
def stamp(path, what):
    for line in open(path):
        if what in line:
            t = re.match(r"(\S+)Z", line).group(1)
            return datetime.datetime.fromisoformat(t)
released = stamp(sys.argv[1], "shutting down")
acquired = [l for l in open(sys.argv[2]) if "acquired the lock" in l][-1]
acquired = datetime.datetime.fromisoformat(re.match(r"(\S+)Z", acquired).group(1))
print(f"{(acquired - released).total_seconds() * 1000:.1f}")
PY
)
echo "takeover by $new: ${handoff_ms} ms from SIGTERM reaching $leader to $new holding the lock (from their logs)"
for name in alpha beta gamma; do echo "$name: $(http_get "http://${ADMIN[$name]}/leader")"; done
echo "== $leader's log:"
grep -E "acquired|released|shutdown" "$WORK/$leader.log" || true

echo "== $new hands over on its own: POST /v1/leader/resign on its loopback control listener"
echo "$new: $(http_get "http://${CONTROL[$new]}/v1/leader/resign?hold=5s" POST)"
third=""
for _ in $(seq 1 500); do
  for name in alpha beta gamma; do
    [ "$name" = "$leader" ] || [ "$name" = "$new" ] && continue
    case "$(http_get "http://${ADMIN[$name]}/leader")" in 200*) third=$name ;; esac
  done
  [ -n "$third" ] && break
  sleep 0.01
done
[ -n "$third" ] || { echo "no takeover after the resign"; cat "$WORK"/*.log; exit 1; }
echo "$third leads now; $new stands aside for 5 s, then waits as a standby"
for name in alpha beta gamma; do
  [ "$name" = "$leader" ] && continue
  echo "$name: $(http_get "http://${ADMIN[$name]}/leader")"
done
echo "== demo done; cleaning up"
