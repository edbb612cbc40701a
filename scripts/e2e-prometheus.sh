#!/usr/bin/env bash
# End-to-end check of the dashboard and the alerts against real processes, all on loopback:
#   3 redis-server  <-  3 `redlock-sidecar run` (lock "demo", 8 shards)  <-  Prometheus (1s scrapes, alerts loaded)
# Prometheus scrapes every sidecar twice (two jobs, as a PodMonitor plus a ServiceMonitor would),
# with the namespace and pod labels the Prometheus Operator adds. It waits for samples, takes and
# releases a request lock through each sidecar's control listener, causes a
# handoff (SIGTERM the leader, start it again), then evaluates every query of dashboards/redlock.json
# and every rule of dashboards/alerts.yaml through Prometheus' HTTP API. A query fails the run if
# Prometheus rejects it, or if it returns no data although this scenario must produce some (see
# ALLOWED_EMPTY below); the shards the sidecars split must add up to all 8. Then it runs failure
# stories and asserts the alerts:
#   two scrapes of every pod        -> no page (leaders are counted per pod)
#   the leader killed (SIGKILL)     -> no page
#   one Redis node down             -> exactly one RedlockRedisNodeUnavailable
#   a majority of Redis nodes down  -> RedlockNoQuorum (and not RedlockNoLeader)
#   the nodes back, and a new pod of the same workload on a renamed lock (a rollout that renamed
#   it)                             -> RedlockLeadersAcrossLocks
# The rules are dashboards/alerts.yaml with every `for:`, `keep_firing_for:` and range shortened
# 15-fold (5m -> 20s), so a story takes seconds; the expressions are otherwise the installed ones.
#
# Needs: cargo (builds the debug binary wherever Cargo's target directory is), and Debian's
# redis-server and prometheus (installed when missing). Every process it starts is stopped on exit.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
# shellcheck source=scripts/ci-tools.sh
source scripts/ci-tools.sh
# shellcheck source=scripts/cargo-target.sh
source scripts/cargo-target.sh
install_redis
install_promtool

# Panels (by title) and targets that may be empty here: there is no kube-state-metrics (guarded
# CronJobs), and the Kubernetes integration is off outside a cluster.
ALLOWED_EMPTY="Guarded CronJobs: periods since the last successful run|Kubernetes API errors"
SHARDS=8           # every sidecar splits this many shards of its lock (run --shards)
# Template variables that are empty here: no `cluster` external label, no kube-state-metrics.
ALLOWED_EMPTY_VARIABLES="cluster|cronjob"
TIME_SCALE=15      # rules' `for:` and ranges are divided by this
SCRAPE_INTERVAL=1s
RATE_INTERVAL=4s   # what Grafana's $__rate_interval gives for a 1s scrape interval (4 x scrape)
BAR_INTERVAL=4s    # $__interval of the bar panels here (their minimum interval, 1m, scaled down like the rules)
DEADLINE=60        # seconds any single wait may take

BIN="$(cargo_target_dir)/debug/redlock-sidecar"
if [ -z "${E2E_SKIP_BUILD:-}" ]; then
  echo "== cargo build --bin redlock-sidecar"
  cargo build --quiet --bin redlock-sidecar
fi
[ -x "${BIN}" ] || { echo "missing ${BIN}"; exit 1; }

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "${pid}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "${pid}" 2>/dev/null || true; done
  if [ -n "${E2E_KEEP:-}" ]; then echo "kept ${WORK}"; else rm -rf "${WORK}"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
T_START="$(date +%s%N)"
log() { local ms; ms="$(ms_since "${T_START}")"; printf '[%3d.%01ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*"; }
command -v curl >/dev/null || apt_install curl

free_ports() { # free_ports N: N distinct free TCP ports on 127.0.0.1
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
wait_until() { # wait_until WHAT COMMAND...: retry the command every 0.2s until it succeeds or DEADLINE
  local what="$1"; shift
  local end=$((SECONDS + DEADLINE))
  until "$@" >/dev/null 2>&1; do
    if [ "${SECONDS}" -ge "${end}" ]; then log "timed out waiting for ${what}"; return 1; fi
    sleep 0.2
  done
}

read -r -a PORTS <<<"$(free_ports 10)"
REDIS_PORTS=("${PORTS[0]}" "${PORTS[1]}" "${PORTS[2]}")
SIDECAR_PORTS=("${PORTS[3]}" "${PORTS[4]}" "${PORTS[5]}")
PROM_PORT="${PORTS[6]}"
CONTROL_PORTS=("${PORTS[7]}" "${PORTS[8]}" "${PORTS[9]}")
PROM="http://127.0.0.1:${PROM_PORT}"
REDIS_URLS="redis://127.0.0.1:${REDIS_PORTS[0]},redis://127.0.0.1:${REDIS_PORTS[1]},redis://127.0.0.1:${REDIS_PORTS[2]}"

# --- Redis x3 ---------------------------------------------------------------------------------
REDIS_PIDS=()
for i in 0 1 2; do
  mkdir -p "${WORK}/redis-${i}"
  redis-server --port "${REDIS_PORTS[$i]}" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "${WORK}/redis-${i}" --maxmemory-policy noeviction \
    >"${WORK}/redis-${i}.log" 2>&1 &
  REDIS_PIDS[i]=$!
  PIDS+=($!)
done
for i in 0 1 2; do
  wait_until "redis ${i}" redis-cli -p "${REDIS_PORTS[$i]}" ping
done
log "3 redis-server up on ports ${REDIS_PORTS[*]}"

# --- Sidecars x3 ------------------------------------------------------------------------------
SIDECAR_PIDS=()
start_sidecar() { # start_sidecar I [LOCK]: sidecar I of the workload demo-app, on lock demo by default
  local i="$1" lock="${2:-demo}"
  "${BIN}" run --lock "${lock}" --redis "${REDIS_URLS}" --listen "127.0.0.1:${SIDECAR_PORTS[$i]}" \
    --control-listen "127.0.0.1:${CONTROL_PORTS[$i]}" --shards "${SHARDS}" \
    --identity "sidecar-${i}" --kubernetes off --log-format text --workload demo-app \
    >>"${WORK}/sidecar-${i}.log" 2>&1 &
  SIDECAR_PIDS[i]=$!
  PIDS+=($!)
}
sidecar_url() { echo "http://127.0.0.1:${SIDECAR_PORTS[$1]}"; }
for i in 0 1 2; do start_sidecar "${i}"; done
for i in 0 1 2; do wait_until "sidecar ${i} /healthz" curl -fsS "$(sidecar_url "${i}")/healthz"; done
log "3 sidecars up on ports ${SIDECAR_PORTS[*]}"

# --- Prometheus -------------------------------------------------------------------------------
# The rules with shorter durations (see the header); written as Prometheus reads them.
python3 - dashboards/alerts.yaml "${WORK}/alerts.yaml" "${TIME_SCALE}" <<'PY'
import re, sys
src, dst, scale = sys.argv[1], sys.argv[2], int(sys.argv[3])
UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
def shorter(m):
    seconds = max(2, int(m.group(2)) * UNIT[m.group(3)] // scale)
    return f"[{seconds}s" if m.group(1) == "[" else f"{m.group(1)}{seconds}s"
text = open(src).read()
text = re.sub(r"((?:keep_firing_)?for: )(\d+)([smhd])\b", shorter, text)
text = re.sub(r"(\[)(\d+)([smhd])\]", lambda m: shorter(m) + "]", text)
open(dst, "w").write(text)
PY
promtool check rules "${WORK}/alerts.yaml" >/dev/null
targets() { # the static configs of one scrape job: each sidecar with namespace and pod labels
  local i
  for i in 0 1 2; do
    printf '      - targets: ["127.0.0.1:%s"]\n        labels: {namespace: e2e, pod: sidecar-%s}\n' "${SIDECAR_PORTS[$i]}" "${i}"
  done
}
cat >"${WORK}/prometheus.yml" <<EOF
global:
  scrape_interval: ${SCRAPE_INTERVAL}
  scrape_timeout: ${SCRAPE_INTERVAL}
  evaluation_interval: ${SCRAPE_INTERVAL}
rule_files:
  - ${WORK}/alerts.yaml
scrape_configs:
  - job_name: redlock-sidecar
    static_configs:
$(targets)
  - job_name: redlock-sidecar-second-scrape
    static_configs:
$(targets)
EOF
promtool check config "${WORK}/prometheus.yml" >/dev/null
prometheus --config.file="${WORK}/prometheus.yml" --storage.tsdb.path="${WORK}/tsdb" \
  --web.listen-address="127.0.0.1:${PROM_PORT}" --log.level=warn \
  >"${WORK}/prometheus.log" 2>&1 &
PIDS+=($!)
wait_until "prometheus ready" curl -fsS "${PROM}/-/ready"
T_QUERY_START="$(date +%s)"
leaders() { # prints the indexes of the sidecars whose GET /leader answers 200
  local i code
  for i in 0 1 2; do
    code="$(curl -s -o /dev/null -w '%{http_code}' "$(sidecar_url "${i}")/leader" || true)"
    [ "${code}" = 200 ] && echo "${i}"
  done
  return 0
}
one_leader() { [ "$(leaders | wc -l)" -eq 1 ]; }
wait_until "exactly one leader" one_leader
LEADER="$(leaders)"
log "leader: sidecar-${LEADER} ($(curl -s "$(sidecar_url "${LEADER}")/leader"))"

prom_value() { # prom_value EXPR: the value of the first series EXPR returns now, or "none"
  python3 - "${PROM}" "$1" <<'PY'
import json, sys, urllib.parse, urllib.request
prom, query = sys.argv[1:]
with urllib.request.urlopen(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": query}), timeout=10) as r:
    result = json.load(r)["data"]["result"]
print(result[0]["value"][1] if result else "none")
PY
}
six_series() { [ "$(prom_value 'count(redlock_is_leader{lock="demo"})')" = 6 ]; }
wait_until "Prometheus samples of all 3 sidecars from both jobs" six_series
log "Prometheus on port ${PROM_PORT} has samples of all 3 sidecars, each scraped twice"
# The app's request locks, so that their panels have data: a lock cycle through every sidecar.
for i in 0 1 2; do
  answer="$(curl -fsS -X POST "http://127.0.0.1:${CONTROL_PORTS[$i]}/v1/locks/e2e-order-${i}?ttl=5s&wait=20s")"
  lease="$(python3 -c 'import json, sys; print(json.load(sys.stdin)["lease"])' <<<"${answer}")"
  curl -fsS -o /dev/null -X DELETE "http://127.0.0.1:${CONTROL_PORTS[$i]}/v1/locks/e2e-order-${i}/${lease}"
done
log "a request-lock cycle through each sidecar's control listener"
sleep 5   # a few scrapes of the steady state

# --- Handoff ------------------------------------------------------------------------------------
OLD="${LEADER}"
T_TERM="$(date +%s%N)"
kill -TERM "${SIDECAR_PIDS[$OLD]}"
wait "${SIDECAR_PIDS[$OLD]}" || { log "sidecar-${OLD} exited with $? after SIGTERM"; exit 1; }
new_leader() { local l; l="$(leaders)"; [ -n "${l}" ] && [ "${l}" != "${OLD}" ] && [ "$(wc -l <<<"${l}")" -eq 1 ]; }
wait_until "a new leader after SIGTERM of sidecar-${OLD}" new_leader
LEADER="$(leaders)"
log "SIGTERM sidecar-${OLD}: it exited 0; sidecar-${LEADER} leads $(ms_since "${T_TERM}") ms after the signal"
start_sidecar "${OLD}"
wait_until "sidecar ${OLD} back" curl -fsS "$(sidecar_url "${OLD}")/healthz"
wait_until "exactly one leader after the restart" one_leader
log "sidecar-${OLD} restarted as a follower; leader is still sidecar-$(leaders)"
sleep 8   # let the restarted sidecar be scraped and the rate windows fill
T_QUERY_END="$(date +%s)"
# A sidecar that exports no rebalance histogram (a build before it) leaves that panel empty.
if ! curl -fsS "$(sidecar_url "${OLD}")/metrics" | grep -q '^redlock_shards_rebalance_seconds_bucket'; then
  log "the sidecars export no redlock_shards_rebalance_seconds: its panel may be empty"
  ALLOWED_EMPTY="${ALLOWED_EMPTY}|Rebalance duration"
fi

# --- Queries ------------------------------------------------------------------------------------
log "evaluating the dashboard's queries and the alerts over the last $((T_QUERY_END - T_QUERY_START))s"
python3 - "${PROM}" "${T_QUERY_START}" "${T_QUERY_END}" "${RATE_INTERVAL}" "${BAR_INTERVAL}" \
  "${ALLOWED_EMPTY}" "${ALLOWED_EMPTY_VARIABLES}" dashboards/redlock.json dashboards/alerts.yaml "${SHARDS}" <<'PY'
import json, math, re, sys, urllib.parse, urllib.request
prom, start, end, rate_interval, bar_interval, allowed_empty, allowed_empty_vars, dash_file, alerts_file, shards = sys.argv[1:]
allowed_empty = set(allowed_empty.split("|"))
allowed_empty_vars = set(allowed_empty_vars.split("|"))

def api(path, **params):
    url = f"{prom}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)

def substitute(expr):
    # Grafana's template variables as the dashboard's "All" selection and a 1s scrape interval
    # give them: the .* regex also matches the absent namespace/pod labels of a local run.
    for var in ("cluster", "namespace", "pod", "lock", "cronjob"):
        expr = expr.replace(f"${var}", ".*").replace("${" + var + "}", ".*")
    return expr.replace("$__rate_interval", rate_interval).replace("$__interval", bar_interval)

def has_data(result):
    # Some sample of some series that is a number (histogram_quantile over no events is NaN).
    for series in result:
        values = series.get("values") or [series.get("value")]
        if any(v and not math.isnan(float(v[1])) for v in values):
            return True
    return False

failures, lines = [], []
def record(kind, name, expr, ok, detail):
    lines.append(f"{'ok  ' if ok else 'FAIL'}  {kind:<10} {name:<48} {detail}")
    if not ok:
        failures.append(f"{kind} {name}: {detail}\n    {expr}")

dashboard = json.load(open(dash_file))
queries = []
for p in dashboard["panels"]:
    for t in p.get("targets", []):
        queries.append(("panel", f"{p['title']} [{t['refId']}]", p["title"], t["expr"]))
for a in dashboard["annotations"]["list"]:
    if "target" in a:
        queries.append(("annotation", a["name"], a["name"], a["target"]["expr"]))

for kind, name, group, expr in queries:
    q = substitute(expr)
    leftover = re.findall(r"\$\w+", q)
    if leftover:
        record(kind, name, q, False, f"unsubstituted variables {leftover}")
        continue
    r = api("query_range", query=q, start=start, end=end, step="1s")
    if r.get("status") != "success":
        record(kind, name, q, False, f"rejected: {r.get('error')}")
        continue
    n = len(r["data"]["result"])
    if has_data(r["data"]["result"]):
        record(kind, name, q, True, f"{n} series")
    elif group in allowed_empty:
        record(kind, name, q, True, "empty (allowed here)")
    else:
        record(kind, name, q, False, "no data")

# Template variables: label_values(selector, label) as Grafana asks Prometheus for them.
for v in dashboard["templating"]["list"]:
    if v["type"] != "query":
        continue
    query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
    if not m:
        record("variable", v["name"], query, False, "not a label_values() query")
        continue
    selector = substitute(m.group(1))
    r = api(f"label/{m.group(2)}/values", **{"match[]": selector, "start": start, "end": end})
    values = r.get("data") or []
    ok = r.get("status") == "success" and (values or v["name"] in allowed_empty_vars)
    record("variable", v["name"], query, ok, f"values {values}" if r.get("status") == "success" else f"rejected: {r.get('error')}")

# Alerts: every expression must evaluate (empty is fine while healthy), and Prometheus, which
# loaded the same file, must report every rule healthy.
try:
    import yaml
    rules = [r for g in yaml.safe_load(open(alerts_file))["groups"] for r in g["rules"]]
except ImportError:
    rules = None
loaded = {r["name"]: r for g in api("rules")["data"]["groups"] for r in g["rules"]}
for name, rule in sorted(loaded.items()):
    r = api("query", query=rule["query"], time=end)
    if r.get("status") != "success":
        record("alert", name, rule["query"], False, f"rejected: {r.get('error')}")
        continue
    firing = len(r["data"]["result"])
    ok = rule.get("health") == "ok"
    record("rule", name, rule["query"], ok,
           f"health {rule.get('health')}, {firing} series now, state {rule.get('state', 'recording')}")
names = {r.get("alert") or r.get("record") for r in rules} if rules is not None else None
if names is not None and names != set(loaded):
    failures.append(f"Prometheus loaded {sorted(loaded)}, alerts.yaml has {sorted(names)}")

# The handoff must be visible (each pod counted once, though scraped twice): two different sidecars
# led during the run, the new leader's "gained" transition was counted, and the fencing token changed. (The old leader's "lost" is
# counted as it exits, after its last scrape, so it cannot be seen here.)
window = f"[{int(end) - int(start)}s]"
for name, q, want in [
    ("pods that led", f'count(max by (pod) (max_over_time(redlock_is_leader{{lock="demo"}}{window})) == 1)', lambda v: v >= 2),
    ("gained transitions", f'sum(max by (pod) (increase(redlock_leader_transitions_total{{lock="demo", direction="gained"}}{window})))', lambda v: v >= 0.5),
    ("fencing token changes", f'changes(max(redlock_fencing_token{{lock="demo"}} > 0)[{int(end) - int(start)}s:1s])', lambda v: v >= 1),
    # The shards: all owned at the end (the leaver's and the joiner's moves done), each pod counted
    # once, and moved during the run (the first split, the hand-over, the join).
    ("shards owned", 'sum(max by (pod) (redlock_shards_owned{lock="demo"}))', lambda v: v == int(shards)),
    ("shards free", 'max(redlock_shards_unowned{lock="demo"})', lambda v: v == 0),
    ("shards taken", f'sum(max by (pod) (increase(redlock_shard_moves_total{{lock="demo", kind="taken"}}{window})))', lambda v: v >= 1),
]:
    r = api("query", query=q, time=end)
    result = r.get("data", {}).get("result", [])
    value = float(result[0]["value"][1]) if result else 0.0
    record("scenario", name, q, r.get("status") == "success" and want(value), f"{value:g}")

print("\n".join(lines))
if failures:
    print("\nfailures:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"\n{sum(1 for l in lines if l.startswith('ok'))} queries returned what they must")
PY
log "all dashboard queries and rules evaluated"

# --- Failure stories ------------------------------------------------------------------------------
firing() { # firing [ALERT]: one line per firing alert (of that name): name and labels
  python3 - "${PROM}" "${1:-}" <<'PY'
import json, sys, urllib.request
prom, name = sys.argv[1:]
with urllib.request.urlopen(f"{prom}/api/v1/alerts", timeout=10) as r:
    alerts = json.load(r)["data"]["alerts"]
for a in alerts:
    labels = a["labels"]
    if a["state"] == "firing" and (not name or labels["alertname"] == name):
        print(labels["alertname"], json.dumps({k: v for k, v in labels.items() if k != "alertname"}, sort_keys=True))
PY
}
fires() { [ -n "$(firing "$1")" ]; }
for_seconds() { # for_seconds ALERT: the (shortened) `for:` of ALERT in seconds
  python3 - "${WORK}/alerts.yaml" "$1" <<'PY'
import sys, yaml
rules = [r for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"]]
print(next(int(r["for"].rstrip("s")) for r in rules if r.get("alert") == sys.argv[2]))
PY
}
stay_quiet() { # stay_quiet SECONDS WHY: no alert may fire at any moment of the next SECONDS
  local end=$((SECONDS + $1)) out
  while [ "${SECONDS}" -lt "${end}" ]; do
    out="$(firing)"
    if [ -n "${out}" ]; then log "FAIL: an alert fires ($2):"; echo "${out}"; return 1; fi
    sleep 0.5
  done
}
NO_LEADER_FOR="$(for_seconds RedlockNoLeader)"
QUIET=$((NO_LEADER_FOR + 5))   # long enough for RedlockNoLeader (the longest of the alerts at stake) to fire

# Story 1: every pod is scraped twice. The raw series show two leaders, the alerts count one.
[ "$(prom_value 'sum(redlock_is_leader{lock="demo"})')" = 2 ] || { log "FAIL: expected 2 leader series (one pod, two scrapes)"; exit 1; }
stay_quiet "${QUIET}" "one leader scraped twice"
log "story 1: one leader, scraped twice: 2 leader series, no alert for ${QUIET}s"

# Story 2: SIGKILL the leader (no release; its lock expires after the ttl) and restart it, as the
# kubelet would. A follower takes over; nothing pages.
OLD="$(leaders)"
kill -KILL "${SIDECAR_PIDS[$OLD]}"
wait "${SIDECAR_PIDS[$OLD]}" 2>/dev/null || true
T_KILL="$(date +%s%N)"
start_sidecar "${OLD}"
new_leader_after_kill() { local l; l="$(leaders)"; [ -n "${l}" ] && [ "$(wc -l <<<"${l}")" -eq 1 ]; }
wait_until "a leader after SIGKILL of sidecar-${OLD}" new_leader_after_kill
log "story 2: SIGKILL sidecar-${OLD}: sidecar-$(leaders) leads $(ms_since "${T_KILL}") ms later"
stay_quiet "${QUIET}" "leader killed"
log "story 2: no alert for ${QUIET}s after the kill"

# Story 3: one Redis node of three down: exactly one RedlockRedisNodeUnavailable (not one per
# sidecar or per scrape), and no other alert: the lock still has its majority.
DEADLINE=$(( $(for_seconds RedlockRedisNodeUnavailable) + 30 ))
kill "${REDIS_PIDS[2]}"; wait "${REDIS_PIDS[2]}" 2>/dev/null || true
wait_until "RedlockRedisNodeUnavailable to fire" fires RedlockRedisNodeUnavailable
out="$(firing)"
echo "${out}" | sed 's/^/    /'
[ "$(grep -c '^RedlockRedisNodeUnavailable ' <<<"${out}")" -eq 1 ] || { log "FAIL: expected exactly one RedlockRedisNodeUnavailable"; exit 1; }
grep -q "127.0.0.1:${REDIS_PORTS[2]}" <<<"${out}" || { log "FAIL: the alert does not name the dead node"; exit 1; }
[ "$(wc -l <<<"${out}")" -eq 1 ] || { log "FAIL: other alerts fire with one node down"; exit 1; }
log "story 3: Redis node 2 down: exactly one RedlockRedisNodeUnavailable, nothing else"

# Story 4: a majority down: RedlockNoQuorum fires; RedlockNoLeader stays quiet (same cause, one page).
DEADLINE=$(( $(for_seconds RedlockNoQuorum) + 30 ))
kill "${REDIS_PIDS[1]}"; wait "${REDIS_PIDS[1]}" 2>/dev/null || true
wait_until "RedlockNoQuorum to fire" fires RedlockNoQuorum
end=$((SECONDS + QUIET))
while [ "${SECONDS}" -lt "${end}" ]; do
  if fires RedlockNoLeader; then log "FAIL: RedlockNoLeader fires although RedlockNoQuorum names the cause"; exit 1; fi
  sleep 0.5
done
fires RedlockNoQuorum || { log "FAIL: RedlockNoQuorum stopped firing"; exit 1; }
firing | sed 's/^/    /'
log "story 4: Redis nodes 1 and 2 down: RedlockNoQuorum fires, RedlockNoLeader does not (checked for ${QUIET}s)"

# Story 5: a rollout that renamed the lock. The nodes come back; the workload's leader takes its
# lock again once the restarted nodes' votes count (ttl + drift). A new pod of the same workload
# (demo-app) on lock "demo-v2" leads that lock at the same time: RedlockLeadersAcrossLocks, which
# RedlockMultipleLeaders cannot see (one leader per lock label).
for i in 1 2; do
  redis-server --port "${REDIS_PORTS[$i]}" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "${WORK}/redis-${i}" --maxmemory-policy noeviction >>"${WORK}/redis-${i}.log" 2>&1 &
  REDIS_PIDS[i]=$!
  PIDS+=($!)
done
for i in 1 2; do wait_until "redis ${i} back" redis-cli -p "${REDIS_PORTS[$i]}" ping; done
wait_until "a leader of demo again" one_leader
OLD_DEMO="$(leaders)"
NEW="$(( (OLD_DEMO + 1) % 3 ))"
kill "${SIDECAR_PIDS[$NEW]}"; wait "${SIDECAR_PIDS[$NEW]}" 2>/dev/null || true
start_sidecar "${NEW}" demo-v2
wait_until "sidecar-${NEW} to lead demo-v2" curl -fsS "$(sidecar_url "${NEW}")/leader"
DEADLINE=60
wait_until "RedlockLeadersAcrossLocks to fire" fires RedlockLeadersAcrossLocks
firing RedlockLeadersAcrossLocks | sed 's/^/    /'
grep -q '"workload": "demo-app"' <<<"$(firing RedlockLeadersAcrossLocks)" || { log "FAIL: the alert does not name the workload"; exit 1; }
fires RedlockMultipleLeaders && { log "FAIL: RedlockMultipleLeaders fires for two different locks"; exit 1; }
log "story 5: sidecar-${OLD_DEMO} leads demo, sidecar-${NEW} leads demo-v2 (workload demo-app): RedlockLeadersAcrossLocks fires"
log "e2e-prometheus: dashboard queries, rules and failure stories passed"
