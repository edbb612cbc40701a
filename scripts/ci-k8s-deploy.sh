#!/usr/bin/env bash
# Deployment checks of the chart, sourced by scripts/ci-k8s.sh (uses its check, refute,
# expect_failure, WORK, CHART, K8S_VERSIONS, REQ): names under a 53-character release name, exact
# RBAC, the token in the sidecar container only, the CronJob's failure policy and render-time
# checks, the bundled Redis' protections and its readiness probe against a real server, the attach
# Components, the admission policy's CEL, the helm test pod, image and architecture, service mesh
# and NetworkPolicy ports, the example's PodDisruptionBudget, and the checkov scan.

LONG_RELEASE="a-release-name-of-fifty-three-characters-for-the-ci-x"   # Helm's own limit is 53
PY="${TOOLS_DIR}/venv/bin/python"

long_release_names() {
  [ "${#LONG_RELEASE}" -eq 53 ]
  mkdir -p "${WORK}/long"
  helm template "${LONG_RELEASE}" "${CHART}" "${REQ[@]}" --namespace redlock >"${WORK}/long/default.yaml"
  helm template "${LONG_RELEASE}" "${CHART}" "${REQ[@]}" --namespace redlock -f "${CHART}/ci/all-on-values.yaml" \
    >"${WORK}/long/all-on.yaml"
  helm template "${LONG_RELEASE}" "${CHART}" "${REQ[@]}" --namespace redlock \
    -f "${CHART}/ci/regular-container-values.yaml" >"${WORK}/long/regular.yaml"
  local v
  for v in "${K8S_VERSIONS[@]}"; do
    kubernetes-validate --strict --quiet -k "${v}" "${WORK}"/long/*.yaml
  done
  "${PY}" - "${WORK}"/long/*.yaml <<'PY'
# The API server's limits: DNS labels (63) for most names; CronJob and StatefulSet 52 (the
# controllers append 11 characters to Job names and to the controller-revision-hash label).
import sys, yaml
LIMITS = {"CronJob": 52, "StatefulSet": 52, "Service": 63, "Deployment": 63, "NetworkPolicy": 63, "Pod": 63,
          "ValidatingAdmissionPolicy": 253, "ValidatingAdmissionPolicyBinding": 253,
          "PodDisruptionBudget": 63, "ServiceAccount": 63, "Role": 63, "RoleBinding": 63, "Secret": 63,
          "ConfigMap": 253, "PodMonitor": 63, "ServiceMonitor": 63, "PrometheusRule": 63}
errors = []
for path in sys.argv[1:]:
    for d in yaml.safe_load_all(open(path)):
        if not d:
            continue
        name, kind = d["metadata"]["name"], d["kind"]
        if len(name) > LIMITS[kind]:
            errors.append(f"{kind} {name}: {len(name)} > {LIMITS[kind]} characters")
        for key, value in d["metadata"].get("labels", {}).items():
            if len(value) > 63:
                errors.append(f"{kind} {name}: label {key} value longer than 63")
if errors:
    sys.exit("\n".join(errors))
PY
}
check "53-character release name: every name within its limit, objects validate" long_release_names

rbac_is_exact() {
  helm template x "${CHART}" "${REQ[@]}" --set kubernetes.mirrorLease=true --set lock.name=orders-writer \
    --set cronjob.enabled=true --set cronjob.name=report --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC \
    >"${WORK}/rbac.yaml"
  "${PY}" - "${WORK}/rbac.yaml" <<'PY'
# Exactly the calls of src/k8s (pod patch, pod list and watch for --follow-container, core Event create,
# Lease get/update by name and create) and of guard (Event create); nothing cluster-wide.
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "Role"}
assert not [d for d in docs if d["kind"].startswith("Cluster")], "cluster-wide RBAC"
def norm(rules):
    return sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])),
                   tuple(r.get("resourceNames", []))) for r in rules)
sidecar = norm(roles["x-redlock-sidecar"])
assert sidecar == sorted([
    (("",), ("pods",), ("list", "patch", "watch"), ()),
    (("",), ("events",), ("create",), ()),
    (("coordination.k8s.io",), ("leases",), ("get", "update"), ("redlock-orders-writer",)),
    (("coordination.k8s.io",), ("leases",), ("create",), ()),
]), sidecar
guard = norm(roles["x-redlock-sidecar-guard"])
assert guard == [(("",), ("events",), ("create",), ())], guard
print("roles:", sorted(roles))
PY
  expect_failure "must be a DNS label of at most 55" \
    helm template x "${CHART}" "${REQ[@]}" --set kubernetes.mirrorLease=true --set lock.name=orders.writer
}
check "RBAC: exactly the API calls made; Lease by resourceNames" rbac_is_exact

token_only_in_api_containers() {
  "${PY}" - "${WORK}/rbac.yaml" "${WORK}/rendered/all-on-values.yaml" "${WORK}/rendered/default.yaml" <<'PY'
# No pod automounts a token; the projected kube-api-access volume is mounted only by the
# container that calls the API: the sidecar, and the CronJob's job container (guard's Events).
import sys, yaml
API_CONTAINERS = {"redlock-sidecar", "job"}
seen = set()
for path in sys.argv[1:]:
    for d in yaml.safe_load_all(open(path)):
        if not d or d["kind"] not in ("Deployment", "StatefulSet", "CronJob", "Pod"):
            continue
        spec = {"CronJob": lambda: d["spec"]["jobTemplate"]["spec"]["template"]["spec"],
                "Pod": lambda: d["spec"]}.get(d["kind"], lambda: d["spec"]["template"]["spec"])()
        assert spec.get("automountServiceAccountToken") is False, d["metadata"]["name"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            if "kube-api-access" in mounts:
                assert c["name"] in API_CONTAINERS, (d["metadata"]["name"], c["name"])
                seen.add((d["kind"], c["name"]))
assert ("Deployment", "redlock-sidecar") in seen and ("CronJob", "job") in seen, seen
PY
}
check "service-account token mounted only in the containers that call the API" token_only_in_api_containers

cronjob_policy_and_guards() {
  local base=(--set cronjob.enabled=true --set cronjob.name=report --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC)
  "${PY}" - "${WORK}/rendered/all-on-values.yaml" <<'PY'
import sys, yaml
cron = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "CronJob")
job = cron["spec"]["jobTemplate"]["spec"]
rules = job["podFailurePolicy"]["rules"]
assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}, rules[0]
codes = {r["action"]: r["onExitCodes"]["values"] for r in rules[1:]}
assert codes["Count"] == [69] and codes["FailJob"] == [2, 71, 75, 76, 124, 126, 127], codes
pod = job["template"]["spec"]
c = next(c for c in pod["containers"] if c["name"] == "job")
env = {e["name"]: e.get("value") for e in c["env"]}
assert env["REDLOCK_OUTCOME_FILE"] == c["terminationMessagePath"] == "/dev/termination-log", env
assert env["REDLOCK_KUBERNETES"] == "on" and "POD_NAME" in env and "POD_NAMESPACE" in env, env
assert "REDLOCK_REDIS_PASSWORD" not in env and env["REDLOCK_REDIS_PASSWORD_FILE"], env
assert env["REPORT_BUCKET"] == "reports" and c["envFrom"] and c["securityContext"]["runAsUser"] == 10001
assert {"scratch"} <= {m["name"] for m in c["volumeMounts"]} and job["ttlSecondsAfterFinished"] == 3600
assert c["command"][c["command"].index("--lock") + 1] == "orders-report-$(JOB_NAME)"
PY
  # Without retryCommandFailures, any other failure of the command fails the Job.
  helm template x "${CHART}" "${REQ[@]}" "${base[@]}" | grep -q 'operator: NotIn'
  expect_failure "cronjob.timeZone is required" helm template x "${CHART}" "${REQ[@]}" --set cronjob.enabled=true --set cronjob.name=r --set cronjob.lockName=r
  expect_failure "cronjob.lockName is required" helm template x "${CHART}" "${REQ[@]}" --set cronjob.enabled=true --set cronjob.name=r --set cronjob.timeZone=Etc/UTC
  expect_failure "cronjob.name is required" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set cronjob.name= --set cronjob.lockPerScheduleSlot=true
  expect_failure "minHold of at least startingDeadlineSeconds" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.lockPerScheduleSlot=true --set cronjob.guard.minHold=30s
  # The period derived from the schedule: */5 -> 300 s, */7 -> 240 s (56 -> 0), daily in a zone
  # with daylight saving time -> 23 h, two weekdays -> 2 days.
  expect_failure "must not exceed the schedule's period \(300s" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.activeDeadlineSeconds=600
  expect_failure "\(240s" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=*/7 * * * *' \
    --set cronjob.activeDeadlineSeconds=200
  helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=*/7 * * * *' --set cronjob.activeDeadlineSeconds=180 >/dev/null
  expect_failure "\(82800s" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=30 2 * * *' \
    --set cronjob.timeZone=Europe/Berlin --set cronjob.activeDeadlineSeconds=82800
  expect_failure "\(172800s" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=0 3 * * 1\,3' \
    --set cronjob.activeDeadlineSeconds=200000
  expect_failure "set cronjob.schedulePeriod" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=0 3 * * MON'
  helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set 'cronjob.schedule=0 3 * * MON' --set cronjob.schedulePeriod=168h >/dev/null
  expect_failure "minHold \(5m\) must be shorter than the schedule's period" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.guard.minHold=5m
  expect_failure "minHold \(3m\) must be shorter than activeDeadlineSeconds" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.guard.minHold=3m
  expect_failure "maxHold \(2m\) must be shorter than activeDeadlineSeconds" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.guard.maxHold=2m
  expect_failure "needs kubernetes.enabled" helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set kubernetes.enabled=false --set example.service.enabled=false
}
check "CronJob: pod failure policy, outcome file, job container, render-time checks" cronjob_policy_and_guards

bundled_redis_is_safe() {
  helm template x "${CHART}" "${REQ[@]}" >"${WORK}/x-default.yaml"
  "${PY}" - "${WORK}/x-default.yaml" <<'PY'
import re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {}
for d in docs:
    kinds.setdefault(d["kind"], []).append(d)
assert "Secret" not in kinds, "the chart generates no Secret (GitOps: it would change on every render)"
# One StatefulSet of independent masters, replaced one at a time, highest ordinal first.
(sts,) = kinds["StatefulSet"]
spec = sts["spec"]
assert spec["replicas"] == 3 and spec["updateStrategy"]["type"] == "RollingUpdate", spec
# Every node is Ready (counted) before the controller takes the next (scripts/ci-k8s.sh checks the policy in detail).
assert spec["podManagementPolicy"] == "OrderedReady", spec["podManagementPolicy"]
assert spec["minReadySeconds"] == 4, spec["minReadySeconds"]   # one renew interval (10s/3), rounded up
pod = spec["template"]
labels = pod["metadata"]["labels"]
assert not any(k in labels for k in ("helm.sh/chart", "app.kubernetes.io/version")), \
    "a chart or app version in the pod template would restart every node on every chart upgrade"
c = pod["spec"]["containers"][0]
args = c["args"][0]
assert "--protected-mode yes" in args and "--requirepass" in args and "--maxmemory-policy noeviction" in args, args
assert "command -v valkey-server || command -v redis-server" in args, args
assert c["image"] == "valkey/valkey:8.1-alpine", c["image"]
# Ready only once the sidecars count the node's votes again: uptime >= max-ttl + drift + 2 renew
# intervals + 1s = 60s + 602ms + 6.67s -> 68s, + 1s (max-ttl: max(ttl 10s, 60s)).
probe = " ".join(c["readinessProbe"]["exec"]["command"])
assert re.search(r'uptime_in_seconds.*\n\[ "\$\{up:-0\}" -ge 69 \]', probe), probe
assert "-a " not in probe and "REDISCLI_AUTH=" in probe and "VALKEYCLI_AUTH=" in probe, "password only in the environment"
assert "tcpSocket" in c["livenessProbe"] and "tcpSocket" in c["startupProbe"]
# Soft anti-affinity by default: a first install runs every node on a one-node cluster.
assert list(pod["spec"]["affinity"]["podAntiAffinity"]) == ["preferredDuringSchedulingIgnoredDuringExecution"], pod["spec"]["affinity"]
anti = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname", anti
assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
(svc,) = [d for d in kinds["Service"] if d["metadata"]["name"] == sts["spec"]["serviceName"]]
assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True, svc["spec"]
pdb = next(d for d in kinds["PodDisruptionBudget"] if d["metadata"]["name"].endswith("-redis"))["spec"]
assert pdb["minAvailable"] == 2 and pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"], pdb
policy = next(d for d in kinds["NetworkPolicy"] if d["metadata"]["name"].endswith("-redis"))["spec"]
allowed = policy["ingress"][0]["from"][0]["podSelector"]
client = {"redlock.io/redis-client": "x-redlock-sidecar"}
# This release's clients, and Deployments attached with manifests/attach in this namespace.
assert allowed == {"matchExpressions": [{"key": "redlock.io/redis-client", "operator": "In",
                                         "values": ["x-redlock-sidecar", "redlock-sidecar"]}]}, allowed
assert policy["ingress"][0]["ports"] == [{"port": 6379, "protocol": "TCP"}], policy["ingress"][0]["ports"]
example = next(d for d in kinds["Deployment"])["spec"]["template"]
assert client.items() <= example["metadata"]["labels"].items(), example["metadata"]["labels"]
env = {e["name"]: e.get("value") for e in example["spec"]["initContainers"][0]["env"]}
assert env["REDLOCK_REDIS"] == ",".join(
    f"redis://x-redlock-sidecar-redis-{i}.x-redlock-sidecar-redis.default.svc:6379" for i in range(3)), env["REDLOCK_REDIS"]
sidecar = example["spec"]["initContainers"][0]
assert "startupProbe" in sidecar and "readinessProbe" not in sidecar, sidecar
PY
  helm template x "${CHART}" "${REQ[@]}" --set sidecar.readinessProbe=true | grep -q 'path: /readyz'
  # The production spread is one value away.
  local out
  out="$(helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.antiAffinity=required --show-only templates/redis.yaml)"
  grep -q 'requiredDuringSchedulingIgnoredDuringExecution' <<<"${out}"
  refute grep -q 'preferredDuringSchedulingIgnoredDuringExecution' <<<"${out}"
  # The ready delay follows the lock's timing (max-ttl 60s, renew 5s: 60.602 + 10 -> 71, + 1; max-ttl
  # 2m: 121.202 + 10 -> 132, + 1) or the value.
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=30s --set lock.renewInterval=5s | grep -q -- '-ge 72 \]'
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=30s --set lock.maxTtl=2m --set lock.renewInterval=5s | grep -q -- '-ge 133 \]'
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=30s --set lock.renewInterval=5s | grep -q 'minReadySeconds: 5$'
  helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.readyAfterSeconds=60 | grep -q -- '-ge 60 \]'
  # A Redis image instead of Valkey, and 5 nodes: PDB 4 of 5.
  out="$(helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.image.repository=redis --set redis.deploy.image.tag=7.2-alpine --set redis.deploy.nodes=5)"
  grep -q 'image: "redis:7.2-alpine"' <<<"${out}"
  grep -q 'minAvailable: 4' <<<"${out}"
  grep -q 'replicas: 5' <<<"${out}"
  expect_failure "not both" helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.enabled=false \
    --set 'redis.urls[0]=rediss://a:6379' --set redis.tls.caSecret=a --set redis.tls.caConfigMap=b
}
check "bundled Redis: one StatefulSet, ordered updates gated on votes, PDB, Valkey, NetworkPolicy" bundled_redis_is_safe

readiness_probe_against_real_servers() {
  # The readiness probe's command, run as written against a real redis-server with a password:
  # NotReady while the uptime is below the threshold, Ready after; a wrong password is NotReady.
  local port dir pid probe started
  command -v redis-server >/dev/null || install_redis
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  dir="${WORK}/probe"; mkdir -p "${dir}/etc/redis-auth"
  printf 'a pass word' >"${dir}/etc/redis-auth/password"
  started="$(date +%s%N)"
  redis-server --port "${port}" --bind 127.0.0.1 --save '' --appendonly no --dir "${dir}" \
    --requirepass 'a pass word' >"${dir}/redis.log" 2>&1 &
  pid=$!
  helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.port="${port}" --set redis.deploy.readyAfterSeconds=2 \
    --show-only templates/redis.yaml >"${dir}/rendered.yaml"
  probe="$("${PY}" - "${dir}/rendered.yaml" "${dir}" <<'PY'
import sys, yaml
sts = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "StatefulSet")
cmd = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
assert cmd[:2] == ["sh", "-c"], cmd
print(cmd[2].replace("/etc/redis-auth", sys.argv[2] + "/etc/redis-auth"))
PY
)"
  local up=0 ready_after rc=0
  for _ in $(seq 100); do redis-cli -p "${port}" -a 'a pass word' --no-auth-warning ping >/dev/null 2>&1 && up=1 && break; sleep 0.1; done
  [ "${up}" = 1 ] || { kill "${pid}"; echo "redis-server did not start"; return 1; }
  if sh -c "${probe}" 2>/dev/null; then echo "Ready right after start"; rc=1; fi
  # Poll (10s deadline): Ready once uptime_in_seconds (a difference of whole seconds) reaches 2,
  # i.e. more than 1 s after the server started.
  ready_after=""
  for _ in $(seq 100); do
    if sh -c "${probe}" 2>/dev/null; then ready_after=$(( ($(date +%s%N) - started) / 1000000 )); break; fi
    sleep 0.1
  done
  [ -n "${ready_after}" ] && [ "${ready_after}" -ge 1000 ] || { echo "Ready after ${ready_after:-never} ms"; rc=1; }
  printf 'wrong' >"${dir}/etc/redis-auth/password"
  if sh -c "${probe}" 2>/dev/null; then echo "Ready with a wrong password"; rc=1; fi
  kill "${pid}"; wait "${pid}" 2>/dev/null || true
  [ "${rc}" = 0 ] && echo "NotReady at start, Ready after ${ready_after} ms, NotReady with a wrong password"
  return "${rc}"
}
check "bundled Redis readiness probe against a real redis-server (uptime threshold, password)" readiness_probe_against_real_servers

check "bundled Redis password rotation keeps the quorum (start script and probe, 3 real redis-servers)" \
  bash scripts/chart-redis-rotation.sh

attach_component() {
  # Sample apps as users have them: their own ServiceAccount (IRSA), a long grace period, the
  # token automounted; the Components from a sibling directory, as a user's overlay would have them.
  local dir="${WORK}/attach-sample" rel
  rm -rf "${dir}"; mkdir -p "${dir}/one" "${dir}/two" "${dir}/no-sa"
  rel="$(realpath --relative-to="${dir}/one" "${REPO_ROOT}/manifests/attach")"
  app() { # app NAME LOCK [SA]: a Deployment labelled for the Component, with its own pod settings
    cat <<YAML
apiVersion: apps/v1
kind: Deployment
metadata:
  name: $1
  labels:
    app: $1
    redlock.io/attach: "true"
spec:
  replicas: 2
  selector:
    matchLabels:
      app: $1
  template:
    metadata:
      labels:
        app: $1
      annotations:
        redlock.io/lock: $2
    spec:
${3:+      serviceAccountName: $3}
      automountServiceAccountToken: true
      terminationGracePeriodSeconds: 120
      containers:
        - name: app
          image: registry.example.com/$1:1.4.2
          ports:
            - name: http
              containerPort: 8080
YAML
  }
  configmap='configMapGenerator:
  - name: redlock-sidecar
    literals:
      - REDLOCK_REDIS=redis://redis-a.data:6379,redis://redis-b.data:6379,redis://redis-c.data:6379
      - REDLOCK_REDIS_PASSWORD_FILE=/etc/redlock/redis-auth/password'
  # One Deployment: manifests/attach binds the Role to its ServiceAccount and names the workload.
  app orders orders-writer orders >"${dir}/one/deployment.yaml"
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: shop\nresources:\n  - deployment.yaml\ncomponents:\n  - %s\n%s\n' \
    "${rel}" "${configmap}" >"${dir}/one/kustomization.yaml"
  kubectl kustomize "${dir}/one" >"${WORK}/attached.yaml"
  # Two Deployments: manifests/attach/sidecar, and the user's RoleBindings (docs/kubernetes.md).
  app orders orders-writer orders >"${dir}/two/orders.yaml"
  app billing billing-writer billing >"${dir}/two/billing.yaml"
  cat >"${dir}/two/rolebindings.yaml" <<'YAML'
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: redlock-sidecar-attach-orders
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: redlock-sidecar-attach}
subjects: [{kind: ServiceAccount, name: orders}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: redlock-sidecar-attach-billing
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: redlock-sidecar-attach}
subjects: [{kind: ServiceAccount, name: billing}]
YAML
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: shop\nresources:\n  - orders.yaml\n  - billing.yaml\n  - rolebindings.yaml\ncomponents:\n  - %s/sidecar\n%s\n' \
    "${rel}" "${configmap}" >"${dir}/two/kustomization.yaml"
  kubectl kustomize "${dir}/two" >"${WORK}/attached-two.yaml"
  local v
  for v in "${K8S_VERSIONS[@]}"; do
    kubernetes-validate --strict --quiet -k "${v}" "${WORK}/attached.yaml" "${WORK}/attached-two.yaml"
  done
  # Without its own ServiceAccount, manifests/attach refuses (the namespace's default account,
  # which every pod without one uses, is never bound); so does it with two Deployments.
  app orders orders-writer >"${dir}/no-sa/deployment.yaml"
  sed 's/^namespace: shop$/namespace: shop/' "${dir}/one/kustomization.yaml" >"${dir}/no-sa/kustomization.yaml"
  expect_failure "fieldPath .spec.template.spec.serviceAccountName. is missing" kubectl kustomize "${dir}/no-sa"
  cp "${dir}/two/orders.yaml" "${dir}/two/billing.yaml" "${dir}/no-sa/" && rm "${dir}/no-sa/deployment.yaml"
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - orders.yaml\n  - billing.yaml\ncomponents:\n  - %s\n' "${rel}" \
    >"${dir}/no-sa/kustomization.yaml"
  expect_failure "multiple matches for selector Deployment" kubectl kustomize "${dir}/no-sa"
  "${PY}" - "${WORK}/attached.yaml" "${WORK}/attached-two.yaml" "${dir}/one/deployment.yaml" <<'PY'
import sys, yaml
def load(path):
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(path)) if d}
one, two, original = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
def check_pod(deploy, lock_annotation, sa):
    pod = deploy["spec"]["template"]
    spec = pod["spec"]
    # The app's own pod settings are kept: ServiceAccount (cloud credentials), token, grace period.
    assert spec["serviceAccountName"] == sa and spec["automountServiceAccountToken"] is True, spec
    assert spec["terminationGracePeriodSeconds"] == 120, spec["terminationGracePeriodSeconds"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["name"] == "redlock-sidecar" and sidecar["restartPolicy"] == "Always", sidecar
    assert [c["name"] for c in spec["containers"]] == ["app"], "the app container is kept"
    assert "volumeMounts" not in spec["containers"][0], "nothing mounted into the app container"
    env = {e["name"]: e for e in sidecar["env"]}
    # Per Deployment: the lock and the workload from the pod's own annotations.
    assert env["REDLOCK_LOCK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['redlock.io/lock']"
    assert env["REDLOCK_WORKLOAD"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['redlock.io/workload']"
    assert pod["metadata"]["annotations"]["redlock.io/lock"] == lock_annotation
    assert "REDLOCK_REDIS" not in env and "REDLOCK_REDIS_PASSWORD_FILE" not in env, "from the overlay's ConfigMap"
    cm = sidecar["envFrom"][0]["configMapRef"]["name"]
    assert cm.startswith("redlock-sidecar-"), cm   # the generated (hashed) name, rewritten
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["redlock-redis-auth"]["secret"]["optional"] is True, "no password, no Secret needed"
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"redlock-redis-auth", "redlock-kube-api-access"}
    labels = pod["metadata"]["labels"]
    assert labels["redlock.io/redis-client"] == "redlock-sidecar" and labels["app"] == deploy["metadata"]["name"], labels
    return pod
pod = check_pod(one[("Deployment", "orders")], "orders-writer", "orders")
assert pod["metadata"]["annotations"]["redlock.io/workload"] == "orders", "named after its Deployment"
# The Role and RoleBinding are the Deployment's own (two attached Deployments never share them).
binding = one[("RoleBinding", "redlock-sidecar-attach:orders")]
assert binding["roleRef"]["name"] == "redlock-sidecar-attach:orders"
assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "orders"}], binding["subjects"]  # the binding's namespace
assert ("ServiceAccount", "redlock-sidecar") not in one, "the Component creates no ServiceAccount"
assert not [k for k in one if k[0] in ("Role", "RoleBinding") and k[1] == "redlock-sidecar-attach"], "no shared name"
role = one[("Role", "redlock-sidecar-attach:orders")]
assert sorted((tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]) == [(("events",), ("create",)), (("pods",), ("list", "patch", "watch"))]
for name, lock in (("orders", "orders-writer"), ("billing", "billing-writer")):
    check_pod(two[("Deployment", name)], lock, name)
assert {k for k in two if k[0] in ("Role", "RoleBinding")} == {
    ("Role", "redlock-sidecar-attach"), ("RoleBinding", "redlock-sidecar-attach-orders"), ("RoleBinding", "redlock-sidecar-attach-billing")}
# What the Component adds besides the patch, for the checkov scan (the app is the user's).
ours = [d for (kind, _), d in one.items() if kind in ("Role", "RoleBinding")]
yaml.safe_dump_all(ours, open(sys.argv[1].replace(".yaml", "-rbac.yaml"), "w"))
PY
  # No object of the Components has a name a chart release uses, also not the release that the
  # Components' labels pair with (fullnameOverride=redlock-sidecar) with everything on.
  helm template redlock "${CHART}" --namespace shop -f "${CHART}/ci/all-on-values.yaml" --set fullnameOverride=redlock-sidecar \
    >"${WORK}/paired-release.yaml"
  helm template redlock "${CHART}" --namespace shop "${REQ[@]}" --set fullnameOverride=redlock-sidecar \
    --set monitoring.serviceMonitor.enabled=true --set monitoring.grafanaDashboard.enabled=true >>"${WORK}/paired-release.yaml"
  "${PY}" - "${WORK}/paired-release.yaml" "${WORK}/attached.yaml" <<'PY'
import sys, yaml
chart = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(open(sys.argv[1])) if d}
attach = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(open(sys.argv[2])) if d
          and d["kind"] in ("Role", "RoleBinding", "ServiceAccount")}
clash = chart & attach
assert not clash, f"the Components and a chart release would both own {sorted(clash)}"
print(f"{len(attach)} Component objects, {len(chart)} chart objects, no shared name")
PY
}
check "kustomize Components manifests/attach: the app's SA, grace and token kept; per-Deployment lock; no clash" attach_component

admission_policy() {
  # The ValidatingAdmissionPolicy's CEL, evaluated by a CEL implementation (cel-python) on the
  # requests an API server would hand it: the sidecar's leader-label patch of its own pod passes;
  # any other change, or its own change on another pod, is denied; other users are not judged.
  # (No API server runs here: its CEL type-checking is not exercised, its semantics are.)
  local out
  "${CEL_PY}" - "${WORK}/rendered/all-on-values.yaml" <<'PY'
import copy, sys, yaml, celpy
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
vap = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding")
assert binding["spec"]["policyName"] == vap["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "redlock"}
assert vap["spec"]["failurePolicy"] == "Fail"
assert vap["spec"]["matchConstraints"]["resourceRules"] == [
    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}]
env = celpy.Environment()
def evaluate(expr, activation):
    return bool(env.program(env.compile(expr)).evaluate(celpy.json_to_cel(activation)))
def verdict(old, new, user="system:serviceaccount:redlock:redlock-redlock-sidecar", uid="uid-1"):
    act = {"object": new, "oldObject": old, "request": {"operation": "UPDATE", "userInfo": {
        "username": user, "extra": {"authentication.kubernetes.io/pod-uid": [uid]}}}}
    if not all(evaluate(c["expression"], act) for c in vap["spec"]["matchConditions"]):
        return "not judged"
    return "allowed" if all(evaluate(v["expression"], act) for v in vap["spec"]["validations"]) else "denied"
pod = {"metadata": {"name": "p", "uid": "uid-1", "labels": {"app": "orders", "redlock.io/leader": "false"},
                    "annotations": {"a": "b"}, "ownerReferences": [{"kind": "ReplicaSet", "name": "rs"}]},
       "spec": {"containers": [{"name": "app", "image": "orders:1"}]}}
def changed(f):
    new = copy.deepcopy(pod); f(new); return new
leader = changed(lambda p: p["metadata"]["labels"].update({"redlock.io/leader": "true"}))
cases = {
    "the leader label of its own pod": (verdict(pod, leader), "allowed"),
    "the same, by an attached app's account": (verdict(pod, leader, user="system:serviceaccount:redlock:orders"), "allowed"),
    "the leader label of another pod": (verdict(pod, leader, uid="uid-2"), "denied"),
    "an image": (verdict(pod, changed(lambda p: p["spec"]["containers"][0].update({"image": "evil:1"}))), "denied"),
    "another label": (verdict(pod, changed(lambda p: p["metadata"]["labels"].update({"app": "x"}))), "denied"),
    "a new label": (verdict(pod, changed(lambda p: p["metadata"]["labels"].update({"x": "y"}))), "denied"),
    "a removed label": (verdict(pod, changed(lambda p: p["metadata"]["labels"].pop("app"))), "denied"),
    "an annotation": (verdict(pod, changed(lambda p: p["metadata"]["annotations"].update({"a": "c"}))), "denied"),
    "the owners": (verdict(pod, changed(lambda p: p["metadata"].pop("ownerReferences"))), "denied"),
    "anything, by another account": (verdict(pod, changed(lambda p: p["spec"]["containers"][0].update({"image": "x"})),
                                             user="system:serviceaccount:redlock:default"), "not judged"),
}
# A token without the pod-uid extra (a long-lived Secret token) is denied.
act = {"object": leader, "oldObject": pod, "request": {"operation": "UPDATE", "userInfo": {
    "username": "system:serviceaccount:redlock:redlock-redlock-sidecar", "extra": {}}}}
cases["a token bound to no pod"] = ("allowed" if all(evaluate(v["expression"], act) for v in vap["spec"]["validations"]) else "denied", "denied")
wrong = {k: v for k, v in cases.items() if v[0] != v[1]}
if wrong:
    sys.exit(f"wrong verdicts: {wrong}")
print(f"{len(cases)} requests judged as intended")
PY
  expect_failure "extraServiceAccounts: not the namespace's \"default\" ServiceAccount" helm template x "${CHART}" "${REQ[@]}" \
    --set kubernetes.admissionPolicy.enabled=true --set 'kubernetes.admissionPolicy.extraServiceAccounts={default}'
  # The Role is never bound to the namespace's default ServiceAccount.
  expect_failure "would be bound to the namespace's \"default\" ServiceAccount" helm template x "${CHART}" "${REQ[@]}" \
    --set serviceAccount.create=false
  expect_failure "would be bound to the namespace's \"default\" ServiceAccount" helm template x "${CHART}" "${REQ[@]}" \
    --set serviceAccount.create=false --set serviceAccount.name=default
  out="$(helm template x "${CHART}" "${REQ[@]}" --set serviceAccount.create=false --set serviceAccount.name=orders)"
  grep -q 'name: orders' <<<"${out}"
  # Without the integration there is no binding, and the default account (no token) is fine.
  helm template x "${CHART}" "${REQ[@]}" --set serviceAccount.create=false --set kubernetes.enabled=false \
    --set example.service.enabled=false | grep -q 'serviceAccountName: default'
  # Two releases never share the cluster-scoped policy's name.
  [ "$(helm template a "${CHART}" -n one "${REQ[@]}" --set kubernetes.admissionPolicy.enabled=true --show-only templates/admission-policy.yaml | grep -m1 '^  name:')" \
    != "$(helm template a "${CHART}" -n two "${REQ[@]}" --set kubernetes.admissionPolicy.enabled=true --show-only templates/admission-policy.yaml | grep -m1 '^  name:')" ]
}
check "least privilege: admission policy's CEL judges pod patches as intended; never bound to default" admission_policy

helm_test_pod() {
  "${PY}" - "${WORK}/rendered/default.yaml" "${WORK}/rendered/all-on-values.yaml" <<'PY'
import sys, yaml
for path in sys.argv[1:]:
    pods = [d for d in yaml.safe_load_all(open(path)) if d and d["kind"] == "Pod"]
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test", pod["metadata"]
    assert "redlock.io/redis-client" in pod["metadata"]["labels"], "the Redis NetworkPolicy admits it"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    # Pod Security Standard "restricted".
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault", psc
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True, sc
    assert c["args"] == ["check"], c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert "REDLOCK_REDIS_PASSWORD" not in env, "never the password in the pod spec"
    assert env["REDLOCK_REDIS_PASSWORD_FILE"]["value"].startswith("/etc/redlock/redis-auth/")
    arch = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(any(e["key"] == "kubernetes.io/arch" for e in t["matchExpressions"]) for t in arch), arch
PY
  refute grep -q 'kind: Pod$' <(helm template x "${CHART}" "${REQ[@]}" --set helmTest.enabled=false)
}
check "helm test: redlock-sidecar check in a restricted pod, password from its file" helm_test_pod

image_and_architecture() {
  # The image: base images and the Dockerfile frontend pinned by digest; one build for amd64 and
  # arm64 (the documented buildx line); the chart schedules the sidecar only on what it holds.
  grep -qE '^# syntax=docker/dockerfile:[0-9.]+@sha256:[a-f0-9]{64}$' Dockerfile
  local from
  while read -r from; do
    grep -qE '@sha256:[a-f0-9]{64}( |$)' <<<"${from}" || { echo "not pinned by digest: ${from}"; return 1; }
  done < <(grep -E '^FROM ' Dockerfile)
  grep -q 'FROM --platform=\$BUILDPLATFORM' Dockerfile   # cross-compiles natively, no emulation
  grep -q 'scripts/build-static.sh --arch "\${TARGETARCH}"' Dockerfile
  grep -q 'docker buildx build --platform linux/amd64,linux/arm64' docs/kubernetes.md
  "${PY}" - "${CHART}/values.yaml" "${WORK}/rendered/default.yaml" "${WORK}/rendered/all-on-values.yaml" <<'PY'
import sys, yaml
values = yaml.safe_load(open(sys.argv[1]))
assert values["image"]["architectures"] == ["amd64", "arm64"], "the architectures the documented build holds"
assert values["image"]["repository"] == "", "required until an image is published"
for path, want in ((sys.argv[2], ["amd64", "arm64"]), (sys.argv[3], ["arm64"])):
    for d in yaml.safe_load_all(open(path)):
        if not d or d["kind"] not in ("Deployment", "CronJob", "Pod"):
            continue
        spec = d["spec"] if d["kind"] == "Pod" else (
            d["spec"]["jobTemplate"]["spec"]["template"]["spec"] if d["kind"] == "CronJob" else d["spec"]["template"]["spec"])
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        for t in terms:   # every term: terms are ORed
            assert {"key": "kubernetes.io/arch", "operator": "In", "values": want} in t["matchExpressions"], (d["metadata"]["name"], t)
PY
  # all-on's own two required terms are kept, each with the architecture added.
  grep -q 'example.com/pool' "${WORK}/rendered/all-on-values.yaml"
  helm template x "${CHART}" "${REQ[@]}" --set-json 'image.architectures=[]' | refute grep -q 'kubernetes.io/arch'
}
check "image pinned by digest, built for amd64+arm64; pods scheduled on what it holds" image_and_architecture

service_mesh_and_ports() {
  local out
  out="$(helm template x "${CHART}" "${REQ[@]}" --set serviceMesh.excludeRedisPorts=true)"
  grep -q 'traffic.sidecar.istio.io/excludeOutboundPorts: "6379"' <<<"${out}"
  grep -q 'config.linkerd.io/skip-outbound-ports: "6379"' <<<"${out}"
  grep -q 'traffic.sidecar.istio.io/excludeInboundPorts: "6379"' <<<"${out}"
  refute grep -q 'istio' <(helm template x "${CHART}" "${REQ[@]}")
  grep -q 'excludeOutboundPorts: 6379,6380' "${WORK}/rendered/all-on-values.yaml"
  # NetworkPolicies name ports by number: a native sidecar's named port is not resolved by every CNI.
  "${PY}" - "${WORK}"/rendered/*.yaml <<'PY'
import sys, yaml
n = 0
for path in sys.argv[1:]:
    for d in yaml.safe_load_all(open(path)):
        if d and d["kind"] == "NetworkPolicy":
            for rule in d["spec"].get("ingress", []):
                for port in rule.get("ports", []):
                    assert isinstance(port["port"], int), (path, d["metadata"]["name"], port)
                    n += 1
assert n, "no NetworkPolicy port checked"
print(f"{n} NetworkPolicy ports, all numbers")
PY
}
check "service mesh: Redis ports excluded on request; NetworkPolicy ports are numbers" service_mesh_and_ports

example_disruption_budget() {
  "${PY}" - "${WORK}/rendered/default.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
deploy = next(d for d in docs if d["kind"] == "Deployment")
pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == deploy["metadata"]["name"])
assert pdb["spec"] == {"maxUnavailable": 1, "selector": deploy["spec"]["selector"]}, pdb["spec"]
env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["initContainers"][0]["env"]}
assert env["REDLOCK_WORKLOAD"]["value"] == deploy["metadata"]["name"], "the workload name on redlock_info"
assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid", "Events name the pod by uid"
assert env["REDLOCK_LOCK"]["value"] == "redlock-redlock", "namespace-release, not the full name"
PY
  # The lock name does not follow fullnameOverride (a rename would run two leaders while rolling).
  helm template redlock "${CHART}" -n redlock "${REQ[@]}" --set fullnameOverride=renamed | grep -A1 'name: REDLOCK_LOCK$' | grep -q '"redlock-redlock"'
  refute grep -q 'kind: PodDisruptionBudget' <(helm template x "${CHART}" "${REQ[@]}" --set example.podDisruptionBudget.enabled=false --set redis.deploy.podDisruptionBudget=false --set redis.deploy.nodes=1)
}
check "example workload: PodDisruptionBudget, workload name, pod uid; lock name independent of fullnameOverride" example_disruption_budget

chart_readme_current() {
  "${PY}" scripts/chart-readme.py --check
}
check "chart README.md generated from values.yaml (scripts/chart-readme.py)" chart_readme_current

checkov_scan() {
  # Every rendering CI makes, the checked-in manifests and the attach Component's RBAC as
  # applied to the sample (its sidecar patch is the chart's own container, scanned in the renderings). Deliberate exceptions
  # are annotations with their reason, beside a comment (templates/_helpers.tpl,
  # "redlock-sidecar.checkovSkips").
  mkdir -p "${WORK}/checkov"
  local i=0 f
  for f in "${WORK}"/rendered/*.yaml "${WORK}"/long/*.yaml manifests/*.yaml "${WORK}/attached-rbac.yaml"; do
    i=$((i + 1)); cp "${f}" "${WORK}/checkov/${i}-$(basename "${f}")"
  done
  checkov -d "${WORK}/checkov" --framework kubernetes --quiet --compact --skip-download
}
check "checkov ${CHECKOV_VERSION}: no failed check on rendered chart and manifests" checkov_scan
