#!/usr/bin/env bash
# Deployment checks of the chart, sourced by scripts/ci-k8s.sh (uses its check, refute,
# expect_failure, WORK, CHART, K8S_VERSIONS): names under a 53-character release name, exact RBAC,
# the token in the sidecar container only, the CronJob's failure policy and render-time checks,
# the bundled Redis' protections, the attach Component and the checkov scan.

LONG_RELEASE="a-release-name-of-fifty-three-characters-for-the-ci-x"   # Helm's own limit is 53
PY="${TOOLS_DIR}/venv/bin/python"

long_release_names() {
  [ "${#LONG_RELEASE}" -eq 53 ]
  mkdir -p "${WORK}/long"
  helm template "${LONG_RELEASE}" "${CHART}" --namespace redlock >"${WORK}/long/default.yaml"
  helm template "${LONG_RELEASE}" "${CHART}" --namespace redlock -f "${CHART}/ci/all-on-values.yaml" \
    --set cronjob.name= --set cronjob.lockPerScheduleSlot=false >"${WORK}/long/all-on.yaml"
  helm template "${LONG_RELEASE}" "${CHART}" --namespace redlock \
    -f "${CHART}/ci/regular-container-values.yaml" >"${WORK}/long/regular.yaml"
  local v
  for v in "${K8S_VERSIONS[@]}"; do
    kubernetes-validate --strict --quiet -k "${v}" "${WORK}"/long/*.yaml
  done
  "${PY}" - "${WORK}"/long/*.yaml <<'PY'
# The API server's limits: DNS labels (63) for most names; CronJob and StatefulSet 52 (the
# controllers append 11 characters to Job names and to the controller-revision-hash label).
import sys, yaml
LIMITS = {"CronJob": 52, "StatefulSet": 52, "Service": 63, "Deployment": 63, "NetworkPolicy": 63,
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
  helm template x "${CHART}" --set kubernetes.mirrorLease=true --set lock.name=orders-writer \
    --set cronjob.enabled=true --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC \
    >"${WORK}/rbac.yaml"
  "${PY}" - "${WORK}/rbac.yaml" <<'PY'
# Exactly the calls of src/k8s.rs (pod patch, core Event create, Lease get/update by name and
# create) and of guard (Event create); nothing cluster-wide.
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "Role"}
assert not [d for d in docs if d["kind"].startswith("Cluster")], "cluster-wide RBAC"
def norm(rules):
    return sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])),
                   tuple(r.get("resourceNames", []))) for r in rules)
sidecar = norm(roles["x-redlock-sidecar"])
assert sidecar == sorted([
    (("",), ("pods",), ("patch",), ()),
    (("",), ("events",), ("create",), ()),
    (("coordination.k8s.io",), ("leases",), ("get", "update"), ("redlock-orders-writer",)),
    (("coordination.k8s.io",), ("leases",), ("create",), ()),
]), sidecar
guard = norm(roles["x-redlock-sidecar-guard"])
assert guard == [(("",), ("events",), ("create",), ())], guard
print("roles:", sorted(roles))
PY
  expect_failure "must be a DNS label of at most 55" \
    helm template x "${CHART}" --set kubernetes.mirrorLease=true --set lock.name=orders.writer
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
        if not d or d["kind"] not in ("Deployment", "StatefulSet", "CronJob"):
            continue
        spec = d["spec"]["template"]["spec"] if d["kind"] != "CronJob" else \
            d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
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
  local base=(--set cronjob.enabled=true --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC)
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
  helm template x "${CHART}" "${base[@]}" | grep -q 'operator: NotIn'
  expect_failure "cronjob.timeZone is required" helm template x "${CHART}" --set cronjob.enabled=true --set cronjob.lockName=r
  expect_failure "cronjob.lockName is required" helm template x "${CHART}" --set cronjob.enabled=true --set cronjob.timeZone=Etc/UTC
  expect_failure "needs cronjob.name" helm template x "${CHART}" "${base[@]}" --set cronjob.lockPerScheduleSlot=true
  expect_failure "minHold of at least startingDeadlineSeconds" helm template x "${CHART}" "${base[@]}" \
    --set cronjob.lockPerScheduleSlot=true --set cronjob.name=report --set cronjob.guard.minHold=30s
  # The period derived from the schedule: */5 -> 300 s, */7 -> 240 s (56 -> 0), daily in a zone
  # with daylight saving time -> 23 h, two weekdays -> 2 days.
  expect_failure "must not exceed the schedule's period \(300s" helm template x "${CHART}" "${base[@]}" \
    --set cronjob.activeDeadlineSeconds=600
  expect_failure "\(240s" helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=*/7 * * * *' \
    --set cronjob.activeDeadlineSeconds=200
  helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=*/7 * * * *' --set cronjob.activeDeadlineSeconds=180 >/dev/null
  expect_failure "\(82800s" helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=30 2 * * *' \
    --set cronjob.timeZone=Europe/Berlin --set cronjob.activeDeadlineSeconds=82800
  expect_failure "\(172800s" helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=0 3 * * 1\,3' \
    --set cronjob.activeDeadlineSeconds=200000
  expect_failure "set cronjob.schedulePeriod" helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=0 3 * * MON'
  helm template x "${CHART}" "${base[@]}" --set 'cronjob.schedule=0 3 * * MON' --set cronjob.schedulePeriod=168h >/dev/null
  expect_failure "minHold \(5m\) must be shorter than the schedule's period" helm template x "${CHART}" "${base[@]}" \
    --set cronjob.guard.minHold=5m
  expect_failure "minHold \(3m\) must be shorter than activeDeadlineSeconds" helm template x "${CHART}" "${base[@]}" \
    --set cronjob.guard.minHold=3m
  expect_failure "maxHold \(2m\) must be shorter than activeDeadlineSeconds" helm template x "${CHART}" "${base[@]}" \
    --set cronjob.guard.maxHold=2m
  expect_failure "needs kubernetes.enabled" helm template x "${CHART}" "${base[@]}" \
    --set kubernetes.enabled=false --set example.service.enabled=false
}
check "CronJob: pod failure policy, outcome file, job container, render-time checks" cronjob_policy_and_guards

bundled_redis_is_safe() {
  helm template x "${CHART}" >"${WORK}/x-default.yaml"
  "${PY}" - "${WORK}/x-default.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {}
for d in docs:
    kinds.setdefault(d["kind"], []).append(d)
secret = next(d for d in kinds["Secret"] if d["metadata"]["name"].endswith("-redis-auth"))
assert secret["data"]["password"], secret
for sts in kinds["StatefulSet"]:
    pod = sts["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"][0]
    assert "--protected-mode yes" in args and "--requirepass" in args, args
    assert "--protected-mode no" not in args
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname", anti
pdb = kinds["PodDisruptionBudget"][0]["spec"]
assert pdb["minAvailable"] == 2, pdb
policy = next(d for d in kinds["NetworkPolicy"] if d["metadata"]["name"].endswith("-redis"))["spec"]
allowed = policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
client = {"redlock.io/redis-client": "x-redlock-sidecar"}
assert allowed == client, allowed
example = next(d for d in kinds["Deployment"])["spec"]["template"]["metadata"]["labels"]
assert client.items() <= example.items(), example
sidecar = next(d for d in kinds["Deployment"])["spec"]["template"]["spec"]["initContainers"][0]
assert "startupProbe" in sidecar and "readinessProbe" not in sidecar, sidecar
PY
  helm template x "${CHART}" --set sidecar.readinessProbe=true | grep -q 'path: /readyz'
  # The same password on every upgrade: the template reads the Secret back with `lookup`.
  grep -q 'lookup "v1" "Secret"' "${CHART}/templates/redis.yaml"
  expect_failure "not both" helm template x "${CHART}" --set redis.deploy.enabled=false \
    --set 'redis.urls[0]=rediss://a:6379' --set redis.tls.caSecret=a --set redis.tls.caConfigMap=b
}
check "bundled Redis: generated password, protected mode, PDB, anti-affinity, NetworkPolicy" bundled_redis_is_safe

attach_component() {
  # A sample app in its own namespace, with the Component, as a user's overlay would have it.
  local dir="${WORK}/attach-sample"
  mkdir -p "${dir}"
  cat >"${dir}/deployment.yaml" <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: orders
  labels:
    app: orders
    redlock.io/attach: "true"
spec:
  replicas: 2
  selector:
    matchLabels:
      app: orders
  template:
    metadata:
      labels:
        app: orders
    spec:
      containers:
        - name: app
          image: registry.example.com/orders:1.4.2
          ports:
            - name: http
              containerPort: 8080
YAML
  cat >"${dir}/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: shop
resources:
  - deployment.yaml
components:
  - $(realpath --relative-to="${dir}" "${REPO_ROOT}/manifests/attach")
configMapGenerator:
  - name: redlock-sidecar
    literals:
      - REDLOCK_LOCK=orders-writer
      - REDLOCK_REDIS=redis://redis-a.data:6379,redis://redis-b.data:6379,redis://redis-c.data:6379
YAML
  kubectl kustomize "${dir}" >"${WORK}/attached.yaml"
  local v
  for v in "${K8S_VERSIONS[@]}"; do
    kubernetes-validate --strict --quiet -k "${v}" "${WORK}/attached.yaml"
  done
  "${PY}" - "${WORK}/attached.yaml" <<'PY'
import sys, yaml
docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(sys.argv[1])) if d}
deploy = docs[("Deployment", "orders")]
pod = deploy["spec"]["template"]["spec"]
sidecar = pod["initContainers"][0]
assert sidecar["name"] == "redlock-sidecar" and sidecar["restartPolicy"] == "Always", sidecar
assert [c["name"] for c in pod["containers"]] == ["app"], "the app container is kept"
cm = sidecar["envFrom"][0]["configMapRef"]["name"]
assert cm.startswith("redlock-sidecar-") and ("ConfigMap", cm) in docs, cm   # hashed name, rewritten
assert pod["serviceAccountName"] == "redlock-sidecar" and pod["automountServiceAccountToken"] is False
assert ("ServiceAccount", "redlock-sidecar") in docs and ("Role", "redlock-sidecar") in docs
binding = docs[("RoleBinding", "redlock-sidecar")]
assert binding["subjects"][0]["namespace"] == "shop", binding
assert {v["name"] for v in pod["volumes"]} >= {"kube-api-access", "redis-auth"}, pod["volumes"]
assert {m["name"] for m in sidecar["volumeMounts"]} >= {"kube-api-access", "redis-auth"}
assert "volumeMounts" not in pod["containers"][0], "no token in the app container"
labels = deploy["spec"]["template"]["metadata"]["labels"]
assert labels["redlock.io/redis-client"] == "redlock-sidecar" and labels["app"] == "orders", labels
# What the Component adds besides the patch, for the checkov scan (the app is the user's).
ours = [d for (kind, _), d in docs.items() if kind in ("ServiceAccount", "Role", "RoleBinding")]
yaml.safe_dump_all(ours, open(sys.argv[1].replace(".yaml", "-rbac.yaml"), "w"))
PY
}
check "kustomize Component manifests/attach: sidecar added to a sample Deployment, validated" attach_component

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
