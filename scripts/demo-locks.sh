#!/usr/bin/env bash
# The stock example, locally: three Redis masters hold the locks, three sidecars serve their
# apps' requests, and buyers in two languages (shell with curl, Python) race for the last items
# of one SKU. Every purchase takes the lock sku-42 through its sidecar, reads the stock, and
# writes the new count to the store (a fourth Redis) with the docs/locks.md script that refuses
# a fencing token lower than the last one seen. One buyer is paused past its lease's ttl in the
# middle of its purchase: its late write is refused, and the stock is never oversold.
#   scripts/demo-locks.sh     (STOCK=5 items; BUYERS=2 per language and sidecar: 12 buyers)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-redis.sh
ensure_redis
. scripts/cargo-target.sh
for tool in curl jq python3 redis-cli; do
  command -v "$tool" >/dev/null || { echo "required: $tool"; exit 1; }
done

STOCK=${STOCK:-5}
BUYERS=${BUYERS:-2}
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
start_redis() { # start_redis NAME: starts a node in this shell (so cleanup stops it), prints its port
  local port
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --dbfilename "$1.rdb" --loglevel warning >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    [ "$(redis-cli -p "$port" PING 2>/dev/null)" = PONG ] && break
    sleep 0.05
  done
  PORT=$port
}

URLS=()
for i in 1 2 3; do
  start_redis "node$i"
  URLS+=("redis://127.0.0.1:$PORT")
done
REDIS=$(IFS=,; echo "${URLS[*]}")
start_redis store
STORE=$PORT
echo "== lock nodes: ${URLS[*]}; the store: redis://127.0.0.1:$STORE"

# The fenced write of docs/locks.md, loaded once into the store.
FENCED=$(sed -n '/^```lua$/,/^```$/p' docs/locks.md | sed '1d;$d')
SHA=$(redis-cli -p "$STORE" SCRIPT LOAD "$FENCED")
redis-cli -p "$STORE" SET '{sku-42}:stock' "$STOCK" >/dev/null
redis-cli -p "$STORE" SET '{sku-42}:fence' 0 >/dev/null
: >"$WORK/sales"

CONTROLS=()
for name in alpha beta gamma; do
  control="127.0.0.1:$(free_port)"
  "$BIN" run --lock demo-leader --redis "$REDIS" --identity "$name" --kubernetes off \
    --listen "127.0.0.1:$(free_port)" --control-listen "$control" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  CONTROLS+=("$control")
done
for control in "${CONTROLS[@]}"; do
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "http://$control/" && break
    sleep 0.05
  done
done
echo "== three sidecars: ${CONTROLS[*]} (a fresh node votes once it has kept its data for ttl + drift: the first purchase waits a few seconds)"

# One purchase in shell: lock, read, fenced write, release.
buy_sh() { # buy_sh WHO CONTROL
  local answer lease token stock written
  answer=$(curl -s -X POST "http://$2/v1/locks/sku-42?ttl=5s&wait=60s")
  lease=$(jq -r '.lease // empty' <<<"$answer")
  [ -n "$lease" ] || { echo "$1: no lock: $answer"; return; }
  token=$(jq -r .fencing_token <<<"$answer")
  stock=$(redis-cli -p "$STORE" GET '{sku-42}:stock')
  if [ "$stock" -gt 0 ]; then
    written=$(redis-cli -p "$STORE" EVALSHA "$SHA" 2 '{sku-42}:stock' '{sku-42}:fence' "$token" $((stock - 1)))
    if [ "$written" = 1 ]; then echo "$1 bought one ($stock -> $((stock - 1)), token $token)" | tee -a "$WORK/sales"
    else echo "$1: write refused (token $token)"; fi
  else
    echo "$1: sold out"
  fi
  curl -s -o /dev/null -X DELETE "http://$2/v1/locks/sku-42/$lease"
}

# The same purchase in Python (standard library only).
buy_py() { # buy_py WHO CONTROL
  python3 - "$1" "$2" "$STORE" "$SHA" "$WORK/sales" <<'PY'
import json, subprocess, sys, urllib.request, urllib.error
who, control, store, sha, sales = sys.argv[1:]
def call(method, path):
    request = urllib.request.Request(f"http://{control}{path}", method=method, data=b"")
    try:
        with urllib.request.urlopen(request, timeout=90) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as error:
        return json.load(error)
def redis(*args):
    return subprocess.run(["redis-cli", "-p", store, *args], capture_output=True, text=True).stdout.strip()
lease = call("POST", "/v1/locks/sku-42?ttl=5s&wait=60s")
if "lease" not in lease:
    sys.exit(print(f"{who}: no lock: {lease}"))
stock = int(redis("GET", "{sku-42}:stock"))
if stock > 0:
    token = str(lease["fencing_token"])
    if redis("EVALSHA", sha, "2", "{sku-42}:stock", "{sku-42}:fence", token, str(stock - 1)) == "1":
        line = f"{who} bought one ({stock} -> {stock - 1}, token {token})"
        print(line)
        open(sales, "a").write(line + "\n")
    else:
        print(f"{who}: write refused (token {token})")
else:
    print(f"{who}: sold out")
call("DELETE", f"/v1/locks/sku-42/{lease['lease']}")
PY
}

echo "== a buyer takes the lock, reads the stock, and is paused past its 1s ttl before it writes"
answer=$(curl -s -X POST "http://${CONTROLS[0]}/v1/locks/sku-42?ttl=1s&wait=60s")
paused_token=$(jq -r .fencing_token <<<"$answer")
paused_stock=$(redis-cli -p "$STORE" GET '{sku-42}:stock')
echo "paused buyer: lock with token $paused_token, read stock $paused_stock; now paused (no keepalive)"

echo "== meanwhile $((BUYERS * 6)) buyers race for $STOCK items through the three sidecars"
BUYER_PIDS=()
i=0
for control in "${CONTROLS[@]}"; do
  for _ in $(seq 1 "$BUYERS"); do
    i=$((i + 1)); buy_sh "shell-$i" "$control" & BUYER_PIDS+=($!)
    i=$((i + 1)); buy_py "python-$i" "$control" & BUYER_PIDS+=($!)
  done
done
# The pause lasts until others have bought (its lease was released 1s after it stopped).
for _ in $(seq 1 600); do
  [ -s "$WORK/sales" ] && break
  sleep 0.1
done
echo "== the paused buyer wakes up and writes $((paused_stock - 1)) with its old token $paused_token"
late=$(redis-cli -p "$STORE" EVALSHA "$SHA" 2 '{sku-42}:stock' '{sku-42}:fence' "$paused_token" $((paused_stock - 1)))
if [ "$late" = 1 ]; then echo "late write ACCEPTED: the store was overwritten"; else echo "late write refused by the fence"; fi
answer=$(curl -s -X POST "http://${CONTROLS[0]}/v1/locks/sku-42/$(jq -r .lease <<<"$answer")/keepalive")
echo "its sidecar tells it: $answer"
for pid in "${BUYER_PIDS[@]}"; do wait "$pid"; done

sold=$(wc -l <"$WORK/sales")
left=$(redis-cli -p "$STORE" GET '{sku-42}:stock')
echo "== stock $STOCK, sold $sold, left $left"
if [ "$late" = 1 ] || [ "$sold" -ne "$STOCK" ] || [ "$left" -ne 0 ]; then
  echo "OVERSOLD or lost sales"; exit 1
fi
echo "never oversold: every item sold once, the paused holder's write refused"
