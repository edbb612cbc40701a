#!/usr/bin/env bash
# Checks of everything Kubernetes- and observability-related: the Helm chart, the checked-in
# manifests, the Grafana dashboard and the Prometheus alerts.
#
# Runs on a fresh Debian machine as root; installs what it needs into target/ci-tools
# (see scripts/ci-tools.sh) and is idempotent. Builds the debug binary (cargo; a no-op after
# `cargo test`) to compare the chart's timing checks with the sidecar's own. Prints one PASS/FAIL line per check and
# exits non-zero if any check failed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
# shellcheck source=scripts/ci-tools.sh
source scripts/ci-tools.sh

CHART=charts/redlock-sidecar
# Oldest and newest Kubernetes versions the rendered objects are validated against
# (the chart needs >= 1.29 for native sidecars).
K8S_VERSIONS=(1.29.0 1.30.0 1.37.0)

install_helm
install_helm3
install_kubernetes_validate
install_node_tools
install_promtool
install_kubectl
install_checkov
install_cel

WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT
LOG="${WORK}/log"

PASSED=0
FAILED=0
FAILED_NAMES=()
check() { # check NAME COMMAND...: run a check, print one line, keep its output for failures
  local name="$1"; shift
  local start=${SECONDS} rc
  # A plain subshell (not inside `if`, `||` or `&&`, where bash ignores `set -e`), so that the
  # check stops at its first failing command.
  set +e
  ( set -e; "$@" ) >"${LOG}" 2>&1
  rc=$?
  set -e
  if [ "${rc}" -eq 0 ]; then
    PASSED=$((PASSED + 1))
    printf 'PASS  %-62s (%ds)\n' "${name}" $((SECONDS - start))
  else
    FAILED=$((FAILED + 1))
    FAILED_NAMES+=("${name}")
    printf 'FAIL  %-62s (%ds)\n' "${name}" $((SECONDS - start))
    sed 's/^/      | /' "${LOG}" | tail -n 40
  fi
}
refute() { # refute COMMAND...: the command must fail (e.g. a grep that must not match)
  if "$@"; then echo "unexpected success: $*"; return 1; fi
}
expect_failure() { # expect_failure PATTERN COMMAND...: the command must fail with PATTERN in its output
  local pattern="$1"; shift
  local out
  if out="$("$@" 2>&1)"; then
    echo "expected a failure, but it succeeded: $*"
    return 1
  fi
  if ! grep -qE -- "${pattern}" <<<"${out}"; then
    echo "failed, but not with /${pattern}/:"
    echo "${out}" | tail -n 10
    return 1
  fi
}

VALUES_FILES=("${CHART}"/ci/*.yaml)
# The values every install of the source tree's chart must give (it names no image, and the bundled Redis' password is
# never generated): the renderings below that are not about them add these.
REQ=(--set image.repository=registry.example.com/redlock-sidecar --set redis.existingSecret=redlock-redis)

# --- Helm ---------------------------------------------------------------------------------
lint_all() {
  helm lint --strict "${CHART}" "${REQ[@]}"
  local f
  for f in "${VALUES_FILES[@]}"; do helm lint --strict "${CHART}" -f "${f}"; done
}
check "helm lint --strict (required values, and ${CHART}/ci/*.yaml)" lint_all

required_values() {
  # Nothing pullable by default: the render names what to set, and how to get it.
  expect_failure "image.repository is required: this chart is the source tree's, which names no image; install a chart published by scripts/release.sh" \
    helm template x "${CHART}" --set redis.existingSecret=s
  expect_failure "redis.existingSecret is required with redis.deploy.enabled" \
    helm template x "${CHART}" --set image.repository=r.example.com/x
  helm template x "${CHART}" --set image.repository=r.example.com/x --set redis.deploy.enabled=false \
    --set 'redis.urls={redis://a:6379}' >/dev/null
  # Generated secrets would differ on every render: none in the templates.
  refute grep -rnE '\{\{[^}]*\b(randAlpha|randAlphaNum|randNumeric|randAscii|randBytes|uuidv4|genPrivateKey|genCA|genSelfSignedCert|genSignedCert|lookup|now|htpasswd)\b' "${CHART}/templates"
}
check "image.repository and the Redis password are required; nothing is generated" required_values

render_all() {
  mkdir -p "${WORK}/rendered"
  helm template redlock "${CHART}" --namespace redlock "${REQ[@]}" >"${WORK}/rendered/default.yaml"
  local f
  for f in "${VALUES_FILES[@]}"; do
    helm template redlock "${CHART}" --namespace redlock -f "${f}" >"${WORK}/rendered/$(basename "${f}")"
  done
}
check "helm template (defaults and every ci values file)" render_all

render_twice() {
  # GitOps (Argo CD, Flux) render on every sync: a difference between two renderings would be
  # applied every time (a rewritten Secret, restarted pods). Both Helm versions, every values set.
  local f out i
  for f in "" "${VALUES_FILES[@]}"; do
    for helm_bin in helm helm3; do
      for i in 1 2; do
        "${helm_bin}" template redlock "${CHART}" --namespace redlock "${REQ[@]}" ${f:+-f "${f}"} >"${WORK}/twice-${i}.yaml"
      done
      diff "${WORK}/twice-1.yaml" "${WORK}/twice-2.yaml"
    done
  done
}
check "helm template twice gives identical output (defaults, every ci values file; Helm 4 and 3)" render_twice

selectors_select_pods() {
  # Every selector a rendering holds (monitors, Services, NetworkPolicies and their peers, PDBs,
  # workloads, affinity, spread) selects a pod template of the same rendering, or the build fails:
  # each chart values set on its own, and manifests/ as one installation.
  local f
  for f in "${WORK}"/rendered/*.yaml; do
    "${TOOLS_DIR}/venv/bin/python" scripts/check-selectors.py --default-namespace redlock "${f}" >/dev/null
  done
  "${TOOLS_DIR}/venv/bin/python" scripts/check-selectors.py --default-namespace redlock manifests/*.yaml
  # A Deployment attached with manifests/attach in namespace "shop", next to a release "orders"
  # without the example workload (the usual way to attach): the release's PodMonitor with
  # monitoring.scrape=namespace and its Redis NetworkPolicy must select the attached pods.
  local dir="${WORK}/attach-selectors"
  mkdir -p "${dir}"
  cat >"${dir}/deployment.yaml" <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: orders
  labels:
    redlock.io/attach: "true"
spec:
  selector:
    matchLabels: {app: orders}
  template:
    metadata:
      labels: {app: orders}
      annotations:
        redlock.io/lock: orders-writer
    spec:
      serviceAccountName: orders
      containers:
        - name: app
          image: registry.example.com/orders:1.0
YAML
  # Its ConfigMap names the release's bundled Redis nodes: the release's NetworkPolicy must admit it.
  local nodes
  nodes="$(printf 'redis://orders-redlock-sidecar-redis-%d.orders-redlock-sidecar-redis.shop.svc:6379,' 0 1 2)"
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: shop\nresources:\n  - deployment.yaml\ncomponents:\n  - %s\nconfigMapGenerator:\n  - name: redlock-sidecar\n    literals:\n      - REDLOCK_REDIS=%s\n' \
    "$(realpath --relative-to="${dir}" "${REPO_ROOT}/manifests/attach")" "${nodes%,}" >"${dir}/kustomization.yaml"
  kubectl kustomize "${dir}" >"${WORK}/attach-selectors.yaml"
  local release=(orders "${CHART}" --namespace shop "${REQ[@]}" --set example.enabled=false --set monitoring.podMonitor.enabled=true)
  helm template "${release[@]}" --set monitoring.scrape=namespace >"${WORK}/attach-release.yaml"
  "${TOOLS_DIR}/venv/bin/python" scripts/check-selectors.py "${WORK}/attach-release.yaml" "${WORK}/attach-selectors.yaml" \
    >"${WORK}/attach-selectors.out"
  grep -E 'PodMonitor/orders-redlock-sidecar spec.selector: 2 \(Deployment/orders, Deployment/orders \(leader\)\)$|redis spec.ingress\[0\].from\[0\].podSelector: 3 \(Deployment/orders, Deployment/orders \(leader\), Pod/orders-redlock-sidecar-test\)$' \
    "${WORK}/attach-selectors.out" | wc -l | grep -qx 2
  # ... and not only some: every sidecar of the namespace, every pod that connects to its nodes.
  grep -E 'PodMonitor/orders-redlock-sidecar spec.selector: selects all 2 it must \(every sidecar of the namespace\): Deployment/orders, Deployment/orders \(leader\)$' \
    "${WORK}/attach-selectors.out"
  grep -E 'NetworkPolicy/orders-redlock-sidecar-redis spec.ingress: selects all 3 it must .*: Deployment/orders, Deployment/orders \(leader\), Pod/orders-redlock-sidecar-test$' \
    "${WORK}/attach-selectors.out"
  # The check catches a monitor that selects nothing: with scrape=release the release's own
  # PodMonitor has no pod of its own to scrape.
  helm template "${release[@]}" >"${WORK}/attach-release-scope.yaml"
  expect_failure "PodMonitor/orders-redlock-sidecar spec.selector .* selects no pods in namespace shop" \
    "${TOOLS_DIR}/venv/bin/python" scripts/check-selectors.py "${WORK}/attach-release-scope.yaml" "${WORK}/attach-selectors.yaml"
  # ... and the leader Service is judged against the pods' run-time leader label.
  sed 's/REDLOCK_LEADER_LABEL/REDLOCK_NO_LABEL/' "${WORK}/rendered/default.yaml" >"${WORK}/no-leader-label.yaml"
  expect_failure "Service/redlock-redlock-sidecar-leader spec.selector .* selects no pods" \
    "${TOOLS_DIR}/venv/bin/python" scripts/check-selectors.py --default-namespace redlock "${WORK}/no-leader-label.yaml"
}
check "every selector selects its pods (chart values sets, manifests/, a Deployment attached next to a release)" selectors_select_pods

package_contents() {
  helm package "${CHART}" --destination "${WORK}/pkg" >/dev/null
  tar -tzf "${WORK}"/pkg/redlock-sidecar-*.tgz >"${WORK}/pkg/list"
  grep -qx 'redlock-sidecar/dashboards/redlock.json' "${WORK}/pkg/list"
  grep -qx 'redlock-sidecar/dashboards/alerts.yaml' "${WORK}/pkg/list"
  grep -qx 'redlock-sidecar/templates/tests/check.yaml' "${WORK}/pkg/list"
  grep -qx 'redlock-sidecar/values.schema.json' "${WORK}/pkg/list"
  refute grep -q '^redlock-sidecar/ci/' "${WORK}/pkg/list"
}
check "helm package carries the dashboard, alerts and schema (not ci/)" package_contents

validate_k8s() {
  local v
  for v in "${K8S_VERSIONS[@]}"; do
    kubernetes-validate --strict --quiet -k "${v}" "${WORK}"/rendered/*.yaml
  done
}
check "kubernetes-validate --strict -k ${K8S_VERSIONS[*]}" validate_k8s

service_ports() { # service_ports FILE...: no Service targetPort names a port of an init container
  "${TOOLS_DIR}/venv/bin/python" - "$@" <<'PY'
# A named port of a restartable init container (a native sidecar) reaches EndpointSlices only
# from Kubernetes 1.33 (kubernetes/kubernetes#128850): on 1.29-1.32 such a Service has no endpoints.
import sys, yaml
errors, named = [], 0
for f in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(f)) if d]
    pods = []
    for d in docs:
        kind = d.get("kind")
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            pods.append(d["spec"]["template"])
        elif kind == "CronJob":
            pods.append(d["spec"]["jobTemplate"]["spec"]["template"])
    for svc in (d for d in docs if d.get("kind") == "Service" and d["spec"].get("selector")):
        selector = svc["spec"]["selector"]
        selected = [p["spec"] for p in pods
                    if all(p["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if not isinstance(target, str):
                continue
            named += 1
            for spec in selected:
                init = {p.get("name") for c in spec.get("initContainers", []) for p in c.get("ports", [])}
                regular = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
                where = f"{f}: Service {svc['metadata']['name']} targetPort {target!r}"
                if target in init:
                    errors.append(f"{where} names a port of an init container; use the port number")
                elif target not in regular:
                    errors.append(f"{where} names no container port of the pods it selects")
if errors:
    sys.exit("\n".join(errors))
print(f"{named} named targetPorts, none of an init container")
PY
}
service_targets_no_init_port() {
  service_ports "${WORK}"/rendered/*.yaml
  # The metrics Service is rendered with the native sidecar, and the check catches a named port.
  grep -q 'targetPort: 9707' "${WORK}/rendered/servicemonitor-values.yaml"
  sed 's/targetPort: 9707/targetPort: admin/' "${WORK}/rendered/servicemonitor-values.yaml" >"${WORK}/named-port.yaml"
  expect_failure "names a port of an init container" service_ports "${WORK}/named-port.yaml"
}
check "no Service targetPort names a port of an init container (native sidecar)" service_targets_no_init_port

check "monitoring.coreos.com objects (PodMonitor, ServiceMonitor, PrometheusRule)" \
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/rendered" <<'PY'
# kubernetes-validate only warns on CRD kinds; check the fields the operator needs here.
import glob, re, sys, yaml, jsonschema
DUR = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
META = {"type": "object", "required": ["name", "namespace"],
        "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                       "namespace": {"type": "string"}, "labels": STRMAP, "annotations": STRMAP}}
SELECTOR = {"type": "object", "additionalProperties": False, "minProperties": 1,
            "properties": {"matchLabels": STRMAP, "matchExpressions": {"type": "array"}}}
ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"],
            "properties": {"port": {"type": "string", "minLength": 1}, "path": {"type": "string", "pattern": "^/"},
                           "interval": DUR, "scrapeTimeout": DUR, "scheme": {"enum": ["http", "https"]},
                           "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"},
                           "metricRelabelings": {"type": "array"}}}
def crd(spec):
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"type": "string"},
                           "metadata": META, "spec": spec}}
RULE = {"type": "object", "additionalProperties": False, "required": ["expr"],
        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
        "properties": {"alert": {"type": "string"}, "record": {"type": "string"}, "expr": {"type": "string", "minLength": 1},
                       "for": DUR, "keep_firing_for": DUR, "labels": STRMAP, "annotations": STRMAP}}
SCHEMAS = {
    "PodMonitor": crd({"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                       "properties": {"selector": SELECTOR, "namespaceSelector": {"type": "object"}, "jobLabel": {"type": "string"},
                                      "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}}}),
    "ServiceMonitor": crd({"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                           "properties": {"selector": SELECTOR, "namespaceSelector": {"type": "object"}, "jobLabel": {"type": "string"},
                                          "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}}}),
    "PrometheusRule": crd({"type": "object", "additionalProperties": False, "required": ["groups"],
                           "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                               "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                               "properties": {"name": {"type": "string"}, "interval": DUR,
                                              "rules": {"type": "array", "minItems": 1, "items": RULE}}}}}}),
}
seen = {}
docs = [d for f in sorted(glob.glob(sys.argv[1] + "/*.yaml")) for d in yaml.safe_load_all(open(f)) if d]
for d in docs:
    if d.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        kind = d["kind"]
        if kind not in SCHEMAS:
            sys.exit(f"unexpected monitoring kind {kind}")
        jsonschema.validate(d, SCHEMAS[kind])
        seen[kind] = seen.get(kind, 0) + 1
# The ports the monitors scrape must exist on the pods / Services they select.
ports = {p["name"] for d in docs if d["kind"] in ("Deployment",) for c in
         d["spec"]["template"]["spec"].get("initContainers", []) + d["spec"]["template"]["spec"]["containers"]
         for p in c.get("ports", [])}
assert "admin" in ports, ports
for kind in SCHEMAS:
    assert seen.get(kind), f"no {kind} rendered by the ci values files"
print("validated:", seen)
PY

check "every relative link in README.md, docs/ and the chart README resolves" python3 scripts/check-doc-links.py

check "values.yaml: every value has a comment" python3 - "${CHART}/values.yaml" <<'PY'
# A value is documented by the comment right above it, or by the comment of a map it belongs to.
import re, sys
lines = open(sys.argv[1]).read().splitlines()
stack = []  # (indent, documented)
errors = []
prev_comment = False
for n, line in enumerate(lines, 1):
    if not line.strip():
        prev_comment = False
        continue
    if line.lstrip().startswith("#"):
        prev_comment = True
        continue
    m = re.match(r"^(\s*)(- )?([A-Za-z0-9_.\-/\"]+):(\s*(.*))?$", line)
    if not m or m.group(2):
        prev_comment = False
        continue
    indent = len(m.group(1))
    while stack and stack[-1][0] >= indent:
        stack.pop()
    inherited = any(d for _, d in stack)
    value = (m.group(5) or "").split(" #")[0].strip()
    documented = prev_comment
    is_parent = value == ""
    if not is_parent and not documented and not inherited:
        errors.append(f"line {n}: {m.group(3)} has no comment")
    stack.append((indent, documented or inherited))
    prev_comment = False
if errors:
    sys.exit("\n".join(errors))
print("every value documented")
PY

unknown_keys_rejected() {
  printf 'sidecar:\n  natve: true\n' >"${WORK}/typo.yaml"
  expect_failure "additional properties 'natve' not allowed" helm lint --strict "${CHART}" "${REQ[@]}" -f "${WORK}/typo.yaml"
  expect_failure "additional properties 'natve' not allowed" helm template x "${CHART}" "${REQ[@]}" -f "${WORK}/typo.yaml"
  expect_failure "additional properties 'bogus' not allowed" helm template x "${CHART}" "${REQ[@]}" --set bogus=1
  expect_failure "additional properties 'password' not allowed" helm template x "${CHART}" "${REQ[@]}" --set redis.password=hunter2
  expect_failure "got number, want string" helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=10
  expect_failure "got string, want integer" helm template x "${CHART}" "${REQ[@]}" --set-string example.replicas=three
  expect_failure "does not match pattern" helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.enabled=false \
    --set 'redis.urls[0]=redis://user:secret@redis-a:6379'
  expect_failure "/image/tag" helm template x "${CHART}" "${REQ[@]}" --set image.tag=latest
  # Odd node counts only: 2 of 2 is a quorum that any one node's drain stops.
  expect_failure "nodes.*(value must be one of|must be one of)" helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.nodes=2
  expect_failure "/image/architectures" helm template x "${CHART}" "${REQ[@]}" --set 'image.architectures={x86}'
}
check "values.schema.json rejects unknown keys, bad types, inline passwords" unknown_keys_rejected

template_guards() {
  expect_failure "must be shorter than terminationGracePeriodSeconds" \
    helm template x "${CHART}" "${REQ[@]}" --set sidecar.shutdownTimeout=30s
  expect_failure "must be shorter than terminationGracePeriodSeconds" \
    helm template x "${CHART}" "${REQ[@]}" --set sidecar.shutdownTimeout=1m --set terminationGracePeriodSeconds=45
  helm template x "${CHART}" "${REQ[@]}" --set sidecar.shutdownTimeout=29500ms >/dev/null
  expect_failure "no Redis nodes" helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.enabled=false
  expect_failure "not both" helm template x "${CHART}" "${REQ[@]}" --set 'redis.urls[0]=redis://a:6379'
  expect_failure "needs kubernetes.enabled" helm template x "${CHART}" "${REQ[@]}" --set kubernetes.enabled=false
  expect_failure "podMonitor.enabled and monitoring.serviceMonitor.enabled are both true" \
    helm template x "${CHART}" "${REQ[@]}" --set monitoring.podMonitor.enabled=true --set monitoring.serviceMonitor.enabled=true
  expect_failure "runbookBaseUrl is required" helm template x "${CHART}" "${REQ[@]}" --set monitoring.prometheusRule.enabled=true
  expect_failure "does not match pattern" helm template x "${CHART}" "${REQ[@]}" --set monitoring.prometheusRule.enabled=true \
    --set monitoring.prometheusRule.runbookBaseUrl=docs/runbooks.md
}
check "template fails on shutdownTimeout >= grace period and bad combinations" template_guards

timing_guards() {
  # The rules of src/config/ at render time: a value the sidecar would refuse (exit 2, a
  # CrashLoop behind the native sidecar's startup gate) fails the render, naming the rule.
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1s >"${WORK}/ttl1s.yaml"
  refute grep -q REDLOCK_SAFETY_MARGIN "${WORK}/ttl1s.yaml"   # derived by the sidecar, as by the chart
  expect_failure "lock.safetyMargin \(1s\) must be less than ttl - renew interval - drift \(654ms\)" \
    helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1s --set lock.safetyMargin=1s
  expect_failure "lock.ttl \(200ms\) is too short: it must be at least 4 x \(lock.nodeTimeout 50ms \+ drift 4ms\)" \
    helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=200ms
  expect_failure "lock.renewInterval \(5s\) must be greater than 0 and less than ttl/2 \(5000ms\)" \
    helm template x "${CHART}" "${REQ[@]}" --set lock.renewInterval=5s
  expect_failure "lock.safetyMargin \(100ms\) must exceed lock.nodeTimeout \+ drift \(152ms\)" \
    helm template x "${CHART}" "${REQ[@]}" --set lock.safetyMargin=100ms
  expect_failure "sidecar.shutdownTimeout \(90ms\) must exceed twice lock.nodeTimeout" \
    helm template x "${CHART}" "${REQ[@]}" --set sidecar.shutdownTimeout=90ms
  # The sidecar's upper bounds (every deadline it computes stays representable).
  expect_failure "lock.ttl \(2h\) must be at most 1h" helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=2h
  expect_failure "lock.nodeTimeout \(61s\) must be at most 1m" helm template x "${CHART}" "${REQ[@]}" --set lock.nodeTimeout=61s
  expect_failure "lock.retryDelay \(2m\) must be at most 1m" helm template x "${CHART}" "${REQ[@]}" --set lock.retryDelay=2m
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1h --set terminationGracePeriodSeconds=30 >/dev/null
  expect_failure "redis.urls lists 2 nodes: use an odd number" helm template x "${CHART}" "${REQ[@]}" \
    --set redis.deploy.enabled=false --set 'redis.urls={redis://a:6379,redis://b:6379}'
}
check "timing: lock.ttl=1s renders (derived margin); what the sidecar refuses fails the render" timing_guards

timing_like_the_binary() {
  # The chart's verdict on each combination must be the sidecar's own: `run` validates its
  # configuration first (exit 2 with the flag) and only then binds --listen, so an address this
  # machine does not have (TEST-NET-1) tells a valid configuration ("cannot bind") from an
  # invalid one without starting anything.
  # shellcheck source=scripts/cargo-target.sh
  source scripts/cargo-target.sh
  cargo build --quiet --bin redlock-sidecar
  local bin combos=0 chart_ok bin_out rendered
  bin="$(cargo_target_dir)/debug/redlock-sidecar"
  while read -r ttl renew margin timeout shutdown maxttl; do
    local args=(--set "lock.ttl=${ttl}" --set "lock.nodeTimeout=${timeout}" --set "sidecar.shutdownTimeout=${shutdown}")
    local flags=(--ttl "${ttl}" --node-timeout "${timeout}" --shutdown-timeout "${shutdown}")
    [ "${renew}" = - ] || { args+=(--set "lock.renewInterval=${renew}"); flags+=(--renew-interval "${renew}"); }
    [ "${margin}" = - ] || { args+=(--set "lock.safetyMargin=${margin}"); flags+=(--safety-margin "${margin}"); }
    [ "${maxttl:--}" = - ] || args+=(--set "lock.maxTtl=${maxttl}")
    chart_ok=yes
    rendered="$(helm template x "${CHART}" "${REQ[@]}" "${args[@]}" --show-only templates/example.yaml 2>/dev/null)" || chart_ok=no
    # The sidecar gets the max-ttl the chart renders (derived when the value is empty), or the
    # value given when the chart refused it.
    if [ "${chart_ok}" = yes ]; then
      flags+=(--max-ttl "$(grep -A1 'name: REDLOCK_MAX_TTL' <<<"${rendered}" | sed -n 's/.*value: "\(.*\)"/\1/p')")
    elif [ "${maxttl:--}" != - ]; then
      flags+=(--max-ttl "${maxttl}")
    fi
    bin_out="$("${bin}" run --lock l --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9 "${flags[@]}" 2>&1 || true)"
    case "${bin_out}" in
      *"--listen: cannot bind"*) bin_ok=yes ;;
      *) bin_ok=no ;;
    esac
    if [ "${chart_ok}" != "${bin_ok}" ]; then
      echo "ttl=${ttl} renew=${renew} margin=${margin} nodeTimeout=${timeout} shutdown=${shutdown} maxTtl=${maxttl:--}: chart ${chart_ok}, sidecar ${bin_ok}: ${bin_out}"
      return 1
    fi
    combos=$((combos + 1))
  done <<'GRID'
10s - - 50ms 10s
10s - 1s 50ms 10s
10s - 152ms 50ms 10s
10s - 153ms 50ms 10s
10s - 6s 50ms 10s
10s - 6564ms 50ms 10s
10s 5s - 50ms 10s
10s 4999ms - 50ms 10s
10s 4999ms 5s 50ms 10s
1s - - 50ms 10s
1s - 1s 50ms 10s
1s - 600ms 50ms 10s
1s 100ms 800ms 50ms 10s
1s 490ms - 50ms 10s
216ms - - 50ms 10s
217ms - - 50ms 10s
300ms - 80ms 50ms 10s
500ms - - 100ms 10s
2s - - 50ms 100ms
2s - - 50ms 101ms
3s - - 500ms 10s
3s - - 1s 10s
30s - - 2s 10s
1m 20s - 50ms 10s
1m - 1s 50ms 10s
1m - 45s 50ms 10s
10s - - 50ms 10s 5s
10s - - 50ms 10s 9999ms
10s - - 50ms 10s 10s
10s - - 50ms 10s 10000ms
10s - - 50ms 10s 1h
10s - - 50ms 10s 61m
1s - - 50ms 10s 999ms
1s - - 50ms 10s 1500ms
2m - - 50ms 10s -
2m - - 50ms 10s 1m
1h - - 50ms 10s 1h
GRID
  echo "${combos} combinations: the chart and the sidecar agree"
}
check "timing: the chart refuses exactly what the sidecar refuses (grid against the built binary)" timing_like_the_binary

max_ttl_of() { # max_ttl_of FILE[=EXPECTED]...: every container that passes a ttl passes --max-ttl too
  "${TOOLS_DIR}/venv/bin/python" - "$@" <<'PY'
# A container that runs the sidecar (`run`) or guard with a ttl (REDLOCK_TTL or --ttl) must state
# the longest ttl of the lock (REDLOCK_MAX_TTL or --max-ttl), at least its own ttl: a short-ttl
# contender that does not know a longer one counts a Redis node that restarted too recently.
# `check` takes no --max-ttl: its --ttl is the longest ttl, so it must be the rendering's max-ttl.
import re, sys, yaml
UNITS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}
def ms(text):
    m = re.fullmatch(r"([0-9]+)(ms|s|m|h)", text)
    assert m, f"not a duration: {text!r}"
    return int(m.group(1)) * UNITS[m.group(2)]
def pod_specs(d):
    kind = d.get("kind")
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return [d["spec"]["template"]["spec"]]
    if kind == "CronJob":
        return [d["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return [d["spec"]] if kind == "Pod" else []
def flag(words, env, name, var):
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return env.get(var)
errors, seen = [], {}
for arg in sys.argv[1:]:
    path, _, expected = arg.partition("=")
    found = []   # (where, role, ttl, max_ttl)
    for d in (d for d in yaml.safe_load_all(open(path)) if d):
        for spec in pod_specs(d):
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                words = [str(w) for w in c.get("command", []) + c.get("args", [])]
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                ttl = flag(words, env, "--ttl", "REDLOCK_TTL")
                if ttl is None:
                    continue
                role = next((w for w in words if w in ("run", "guard", "check", "status")), "run")
                found.append((f"{path}: {d['kind']}/{d['metadata']['name']} container {c['name']} ({role})",
                              role, ttl, flag(words, env, "--max-ttl", "REDLOCK_MAX_TTL")))
    maxes = {m for _, role, _, m in found if role != "check" and m is not None}
    for where, role, ttl, max_ttl in found:
        seen[role] = seen.get(role, 0) + 1
        if role == "check":
            if max_ttl is not None:
                errors.append(f"{where}: check takes no --max-ttl")
            if maxes and {ttl} != maxes:
                errors.append(f"{where}: its ttl {ttl} is not the max-ttl of the sidecars beside it ({sorted(maxes)})")
            continue
        if max_ttl is None:
            errors.append(f"{where}: passes a ttl ({ttl}) but no --max-ttl / REDLOCK_MAX_TTL")
        elif ms(max_ttl) < ms(ttl):
            errors.append(f"{where}: max-ttl {max_ttl} is below its ttl {ttl}")
        elif expected and max_ttl != expected:
            errors.append(f"{where}: max-ttl {max_ttl}, expected {expected}")
    if not found:
        errors.append(f"{path}: no container passes a ttl")
if errors:
    sys.exit("\n".join(errors))
print("containers with a ttl, by role, each with its max-ttl:", seen)
PY
}
max_ttl_everywhere() {
  # Every rendering CI makes, the checked-in manifests and the attach Component's sidecar; the
  # default is max(lock.ttl, 60s), and an explicit value is passed as given.
  local dir="${WORK}/max-ttl" f args=()
  mkdir -p "${dir}"
  helm template x "${CHART}" "${REQ[@]}" --set cronjob.enabled=true --set cronjob.name=report --set cronjob.lockName=report \
    --set cronjob.timeZone=Etc/UTC >"${dir}/cronjob.yaml"
  helm template x "${CHART}" "${REQ[@]}" --set sidecar.native=false >"${dir}/regular.yaml"
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=2m >"${dir}/ttl2m.yaml"
  helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=5m --set cronjob.enabled=true --set cronjob.name=report \
    --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC >"${dir}/max5m.yaml"
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1m --set lock.maxTtl=60000ms >"${dir}/equal.yaml"
  for f in "${WORK}"/rendered/*.yaml; do args+=("${f}"); done
  max_ttl_of "${WORK}/rendered/default.yaml=60s" "${args[@]}" manifests/redlock-sidecar.yaml=60s \
    manifests/example-deployment.yaml=60s manifests/example-cronjob.yaml=60s manifests/attach/sidecar/sidecar.yaml=60s \
    "${dir}/cronjob.yaml=60s" "${dir}/regular.yaml=60s" "${dir}/ttl2m.yaml=2m" "${dir}/max5m.yaml=5m" "${dir}/equal.yaml=60000ms" \
    | tee "${dir}/out"
  # Each kind of container was seen: the sidecar (native and regular), guard and check.
  grep -qE "'run': [0-9]+" "${dir}/out"
  grep -qE "'guard': [0-9]+" "${dir}/out"
  grep -qE "'check': [0-9]+" "${dir}/out"
  grep -q 'name: REDLOCK_MAX_TTL' <(helm template x "${CHART}" "${REQ[@]}" --set sidecar.native=false --show-only templates/example.yaml)
  # The check catches a container without it.
  sed '/name: REDLOCK_MAX_TTL/,+1d' "${WORK}/rendered/default.yaml" >"${dir}/without.yaml"
  expect_failure "passes a ttl \(10s\) but no --max-ttl" max_ttl_of "${dir}/without.yaml"
  # The issue's rollout, old pods with ttl 12s beside new pods with 1s: with the default both sides
  # state a max-ttl that covers both ttls. From 2m down to 30s the default (60s) would not cover
  # the old pods' 2m, which docs/kubernetes.md ("Changing the ttl") says to set with the change.
  local old new
  old="$(helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=12s --show-only templates/example.yaml)"
  new="$(helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1s --show-only templates/example.yaml)"
  grep -A1 'name: REDLOCK_MAX_TTL' <<<"${old}" | grep -q 'value: "60s"'
  grep -A1 'name: REDLOCK_MAX_TTL' <<<"${new}" | grep -q 'value: "60s"'
  grep -A1 'name: REDLOCK_MAX_TTL' <(helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=30s) | grep -q 'value: "60s"'
  grep -A1 'name: REDLOCK_MAX_TTL' <(helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=30s --set lock.maxTtl=2m) | grep -q 'value: "2m"'
}
check "lock.maxTtl: every container that passes a ttl passes --max-ttl (default max(ttl, 60s)); check uses it as its ttl" max_ttl_everywhere

max_ttl_refused() {
  # One line naming the value, from both Helm versions; the schema takes durations or empty only.
  local h
  for h in helm helm3; do
    expect_failure '^Error: .*lock\.maxTtl \(5s\) must be at least lock\.ttl \(10s\): it is the longest ttl' \
      "${h}" template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=5s
  done
  expect_failure 'lock\.maxTtl \(1m\) must be at least lock\.ttl \(2m\)' \
    helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=2m --set lock.maxTtl=1m
  expect_failure 'lock\.maxTtl \(9999ms\) must be at least lock\.ttl \(10s\)' \
    helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=9999ms
  expect_failure 'lock\.maxTtl \(61m\) must be at most 1h' helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=61m
  expect_failure '/lock/maxTtl.*(does not match pattern|got number)' helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=60
  expect_failure '/lock/maxTtl.*does not match pattern' helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=1.5s
  # The message is one line.
  local out
  out="$(helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=5s 2>&1 || true)"
  [ "$(grep -c 'lock.maxTtl' <<<"${out}")" -eq 1 ]
  # Equal to the ttl, or in another unit, renders.
  helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=10s >/dev/null
  helm template x "${CHART}" "${REQ[@]}" --set lock.maxTtl=10000ms >/dev/null
  helm template x "${CHART}" "${REQ[@]}" --set lock.ttl=1500ms --set lock.maxTtl=1500ms >/dev/null
}
check "lock.maxTtl below lock.ttl (or above 1h) fails the render with one line naming it" max_ttl_refused

values_the_issue_named() {
  # lock.name: the schema's limit is the sidecar's (200 characters; the binary built above agrees).
  # shellcheck source=scripts/cargo-target.sh
  source scripts/cargo-target.sh
  cargo build --quiet --bin redlock-sidecar
  local bin long out
  bin="$(cargo_target_dir)/debug/redlock-sidecar"
  long="$(printf 'a%.0s' $(seq 200))"
  helm template x "${CHART}" "${REQ[@]}" --set "lock.name=${long}" >/dev/null
  expect_failure "/lock/name.*maxLength" helm template x "${CHART}" "${REQ[@]}" --set "lock.name=${long}a"
  expect_failure "--lock: must be at most 200 characters" \
    "${bin}" run --lock "${long}a" --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9
  out="$("${bin}" run --lock "${long}" --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9 2>&1 || true)"
  grep -q -- "--listen: cannot bind" <<<"${out}"
  # cronjob.timeZone: an IANA name, or the render fails.
  local cron=(--set cronjob.enabled=true --set cronjob.name=report --set cronjob.lockName=report)
  expect_failure 'cronjob.timeZone "Mars/Base" is not an IANA time zone name' \
    helm template x "${CHART}" "${REQ[@]}" "${cron[@]}" --set cronjob.timeZone=Mars/Base
  local tz
  for tz in Etc/UTC UTC Europe/Berlin America/Argentina/Buenos_Aires US/Eastern; do
    helm template x "${CHART}" "${REQ[@]}" "${cron[@]}" --set "cronjob.timeZone=${tz}" >/dev/null
  done
  # The Sentinels' password: a Secret mounted as a file, only with a Sentinel group.
  local sentinel=(--set redis.deploy.enabled=false --set 'redis.urls={redis+sentinel://s1:26379\,s2/mymaster}')
  out="$(helm template x "${CHART}" "${REQ[@]}" "${sentinel[@]}" --set redis.sentinel.existingSecret=sentinel-auth --set redis.sentinel.username=watcher)"
  grep -q 'value: /etc/redlock/sentinel-auth/password' <<<"${out}"
  grep -q 'secretName: sentinel-auth' <<<"${out}"
  grep -q 'name: REDLOCK_SENTINEL_USERNAME' <<<"${out}"
  refute grep -q 'REDLOCK_SENTINEL_PASSWORD$' <<<"${out}"
  expect_failure "no redis.urls entry is a Sentinel group" \
    helm template x "${CHART}" "${REQ[@]}" --set redis.sentinel.existingSecret=sentinel-auth
  # The bundled Redis' second password key differs from the first.
  expect_failure "redis.deploy.extraPasswordKey must differ from redis.passwordKey" \
    helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.extraPasswordKey=password
  # monitoring.scrape=namespace needs the PodMonitor.
  expect_failure "monitoring.scrape=namespace needs the PodMonitor" helm template x "${CHART}" "${REQ[@]}" \
    --set monitoring.serviceMonitor.enabled=true --set monitoring.scrape=namespace
}
check "lock.name limit = the sidecar's; cronjob.timeZone an IANA name; Sentinel password Secret; scrape scope" values_the_issue_named

shards_value() {
  # sidecar.shards reaches the sidecar as REDLOCK_SHARDS (native or regular container), and the demo
  # app then shows its pod's shards; unset (null) or 0 passes nothing. The schema's bounds are the
  # sidecar's: the binary built above takes 16384 and refuses 16385, naming the flag.
  local out v bin
  out="$(helm template x "${CHART}" "${REQ[@]}" --set sidecar.shards=64 --show-only templates/example.yaml)"
  "${TOOLS_DIR}/venv/bin/python" - <(echo "${out}") <<'PY'
import sys, yaml
spec = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
sidecar = next(c for c in spec["initContainers"] if c["name"] == "redlock-sidecar")
shards = [e.get("value") for e in sidecar["env"] if e["name"] == "REDLOCK_SHARDS"]
assert shards == ["64"], shards
demo = next(c for c in spec["containers"] if c["name"] == "demo")
assert "http://127.0.0.1:$CONTROL_PORT/v1/shards" in demo["command"][-1], demo["command"][-1]
assert {"name": "CONTROL_PORT", "value": "9708"} in demo["env"], demo["env"]
PY
  helm template x "${CHART}" "${REQ[@]}" --set sidecar.native=false --set sidecar.shards=16384 --show-only templates/example.yaml \
    | grep -A1 'name: REDLOCK_SHARDS$' | grep -q 'value: "16384"'
  for v in "" sidecar.shards=0 sidecar.shards=null; do
    out="$(helm template x "${CHART}" "${REQ[@]}" ${v:+--set "${v}"} --show-only templates/example.yaml)"
    refute grep -qE 'REDLOCK_SHARDS|/v1/shards|CONTROL_PORT' <<<"${out}"
  done
  expect_failure "/sidecar/shards.*maximum" helm template x "${CHART}" "${REQ[@]}" --set sidecar.shards=16385
  expect_failure "/sidecar/shards.*minimum" helm template x "${CHART}" "${REQ[@]}" --set sidecar.shards=-1
  expect_failure "/sidecar/shards.*want null or integer" helm template x "${CHART}" "${REQ[@]}" --set-string sidecar.shards=64
  # shellcheck source=scripts/cargo-target.sh
  source scripts/cargo-target.sh
  bin="$(cargo_target_dir)/debug/redlock-sidecar"
  expect_failure "--shards" env REDLOCK_SHARDS=16385 \
    "${bin}" run --lock l --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9
  out="$(REDLOCK_SHARDS=16384 "${bin}" run --lock l --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9 2>&1 || true)"
  grep -q -- "--listen: cannot bind" <<<"${out}"
}
check "sidecar.shards: REDLOCK_SHARDS and the demo's shards only when set; bounds = the sidecar's" shards_value

rbac_follows_integration() {
  local out
  out="$(helm template x "${CHART}" "${REQ[@]}" --set kubernetes.enabled=false --set example.service.enabled=false)"
  refute grep -qE '^kind: (Role|RoleBinding|ClusterRole)' <<<"${out}"
  grep -q 'automountServiceAccountToken: false' <<<"${out}"
  refute grep -q 'automountServiceAccountToken: true' <<<"${out}"
  refute grep -q 'name: kube-api-access' <<<"${out}"
  refute grep -q 'REDLOCK_KUBERNETES.*"on"' <<<"${out}"
  out="$(helm template x "${CHART}" "${REQ[@]}")"
  grep -q '^kind: Role$' <<<"${out}"
  refute grep -q 'automountServiceAccountToken: true' <<<"${out}"
  grep -q 'name: kube-api-access' <<<"${out}"
  refute grep -q 'coordination.k8s.io' <<<"${out}"
  refute grep -q 'ClusterRole' <<<"${out}"
  refute grep -q 'image: .*:latest' <<<"${out}"
  refute grep -q 'preStop' <<<"${out}"
  helm template x "${CHART}" "${REQ[@]}" --set kubernetes.mirrorLease=true | grep -q 'coordination.k8s.io'
  # A regular (non-native) sidecar is a container, not an init container.
  out="$(helm template x "${CHART}" "${REQ[@]}" --set sidecar.native=false)"
  refute grep -q 'restartPolicy: Always' <<<"${out}"
  refute grep -q 'initContainers' <<<"${out}"
}
check "RBAC and token only with the Kubernetes integration; no :latest" rbac_follows_integration

helm3_compat() {
  helm3 lint --strict "${CHART}" "${REQ[@]}"
  local f
  for f in "${VALUES_FILES[@]}"; do helm3 lint --strict "${CHART}" -f "${f}"; done
  # Same objects from Helm 3 as from Helm 4.
  helm3 template redlock "${CHART}" --namespace redlock "${REQ[@]}" -f "${CHART}/ci/all-on-values.yaml" >"${WORK}/helm3.yaml"
  helm template redlock "${CHART}" --namespace redlock "${REQ[@]}" -f "${CHART}/ci/all-on-values.yaml" >"${WORK}/helm4.yaml"
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/helm3.yaml" "${WORK}/helm4.yaml" <<'PY'
import sys, yaml
a, b = ([d for d in yaml.safe_load_all(open(f)) if d] for f in sys.argv[1:])
if a != b:
    sys.exit("helm 3 and helm 4 render different objects")
PY
  expect_failure "natve" helm3 template x "${CHART}" "${REQ[@]}" --set sidecar.natve=true
  expect_failure "must be shorter than terminationGracePeriodSeconds" \
    helm3 template x "${CHART}" "${REQ[@]}" --set sidecar.shutdownTimeout=30s
}
check "Helm 3 ($(helm3 version --short)): lint, same objects, schema and guards" helm3_compat

notes_render() {
  local f out
  for f in "" "${VALUES_FILES[@]}"; do
    out="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" --dry-run=client ${f:+-f "${f}"})"
    grep -q '^NOTES:' <<<"${out}"
    grep -q 'curl -i http://127.0.0.1:9707/leader' <<<"${out}"
    grep -qi 'dashboard' <<<"${out}"
    # Commands a restricted namespace runs: no `kubectl run` (its pods fail Pod Security
    # "restricted" and would carry the password in their spec), no label nobody sets.
    refute grep -q 'kubectl run' <<<"${out}"
    refute grep -q 'cronjob-name' <<<"${out}"
    refute grep -qi 'password=' <<<"${out}"
  done
  out="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" --dry-run=client)"
  grep -q -- '-L redlock.io/leader' <<<"${out}"
  local notes
  # Which spread is in force, and its price; two port-forwards never share a local port.
  grep -q '^Spread: redis.deploy.antiAffinity=preferred (the default)' <<<"${out}"
  grep -q 'takes the quorum with it' <<<"${out}"
  grep -q "^Kubernetes (a StatefulSet's volumeClaimTemplates never change)" <<<"${out}"
  "${TOOLS_DIR}/venv/bin/python" -c '
import re, sys
ports = re.findall(r"kubectl port-forward .* (\d+):\d+ &", sys.stdin.read())
assert len(ports) == 3 and len(set(ports)) == 3, ports' <<<"${out}"
  notes="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" --set redis.deploy.antiAffinity=required --dry-run=client)"
  grep -q '^Spread: redis.deploy.antiAffinity=required' <<<"${notes}"
  # External voters are counted as voters, Sentinel groups named as such.
  local ext=(--set redis.deploy.enabled=false)
  notes="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" "${ext[@]}" --set 'redis.urls={redis+sentinel://s1:26379/m}' --dry-run=client)"
  grep -qx 'Redis: 1 external voter (a Sentinel group); the lock needs it.' <<<"${notes}"
  notes="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" "${ext[@]}" --set 'redis.urls={redis://a:6379,redis://b:6379,rediss+sentinel://s:26379/m}' --dry-run=client)"
  grep -qx 'Redis: 3 external voters (1 of them a Sentinel group); the lock needs 2 of them.' <<<"${notes}"
  grep -q 'helm test redlock -n redlock' <<<"${out}"
  # The CronJob's pods are found by labels they carry (app.kubernetes.io/component=cronjob).
  out="$(helm install redlock "${CHART}" --namespace redlock -f "${CHART}/ci/all-on-values.yaml" --dry-run=client)"
  grep -q -- '-l app.kubernetes.io/instance=redlock,app.kubernetes.io/component=cronjob' <<<"${out}"
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/rendered/all-on-values.yaml" <<'PY'
import sys, yaml
cron = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "CronJob")
labels = cron["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
assert labels["app.kubernetes.io/instance"] == "redlock" and labels["app.kubernetes.io/component"] == "cronjob", labels
PY
}
check "NOTES.txt renders (leader label, /leader, helm test, CronJob pods by their labels; no kubectl run)" notes_render

# Long release names, RBAC, tokens, CronJob policy, bundled Redis, attach component, checkov.
# shellcheck source=scripts/ci-k8s-deploy.sh
source scripts/ci-k8s-deploy.sh

# --- Platform review (issue 36, item 5): each item fixed or refused with one line -------------
one_line_refusal() { # one_line_refusal PATTERN COMMAND...: the render fails, PATTERN in its one error line
  local pattern="$1"; shift
  expect_failure "^Error: .*${pattern}" "$@"
  local out
  out="$("$@" 2>&1 || true)"
  [ "$(grep -c '^Error: ' <<<"${out}")" -eq 1 ] || { echo "more than one error line: ${out}"; return 1; }
  [ "$(grep -cE -- "${pattern}" <<<"${out}")" -eq 1 ] || { echo "the message spans lines: ${out}"; return 1; }
}

attachments_own_rolebindings() {
  # Two Deployments attached with manifests/attach in one namespace, each from its own kustomization,
  # and two chart releases in the same namespace (one with its own ServiceAccount, one with an existing
  # one): no Role or RoleBinding name is rendered twice, each RoleBinding binds exactly its own
  # workload's ServiceAccount to a Role of its own, and applying them in any order leaves every one of
  # those ServiceAccounts allowed to get and patch pods (one app's apply never takes it from another's).
  local dir="${WORK}/two-attachments" app
  rm -rf "${dir}"; mkdir -p "${dir}"
  for app in orders billing; do
    mkdir -p "${dir}/${app}"
    cat >"${dir}/${app}/deployment.yaml" <<YAML
apiVersion: apps/v1
kind: Deployment
metadata:
  name: ${app}
  labels:
    redlock.io/attach: "true"
spec:
  selector:
    matchLabels: {app: ${app}}
  template:
    metadata:
      labels: {app: ${app}}
      annotations:
        redlock.io/lock: ${app}-writer
    spec:
      serviceAccountName: ${app}-sa
      containers:
        - name: app
          image: registry.example.com/${app}:1.0
YAML
    printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: shop\nresources:\n  - deployment.yaml\ncomponents:\n  - %s\n' \
      "$(realpath --relative-to="${dir}/${app}" "${REPO_ROOT}/manifests/attach")" >"${dir}/${app}/kustomization.yaml"
    kubectl kustomize "${dir}/${app}" >"${dir}/attached-${app}.yaml"
  done
  local ext=(--set redis.deploy.enabled=false --set 'redis.urls={redis://redis-a.data:6379}')
  helm template inventory "${CHART}" -n shop "${REQ[@]}" "${ext[@]}" >"${dir}/release-inventory.yaml"
  helm template payments "${CHART}" -n shop "${REQ[@]}" "${ext[@]}" --set serviceAccount.create=false \
    --set serviceAccount.name=payments-sa >"${dir}/release-payments.yaml"
  "${PY}" - "${dir}"/attached-orders.yaml "${dir}"/attached-billing.yaml "${dir}"/release-inventory.yaml "${dir}"/release-payments.yaml <<'PY'
import itertools, sys, yaml
installs = []
for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    accounts = {d["spec"]["template"]["spec"]["serviceAccountName"] for d in docs if d["kind"] == "Deployment"}
    rbac = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "RoleBinding")}
    assert len(accounts) == 1, (path, accounts)
    installs.append((path.rsplit("/", 1)[-1], accounts.pop(), rbac))
owner = {}
for name, account, rbac in installs:
    for key in rbac:
        assert key not in owner, f"{key} is rendered by {owner[key]} and {name}"
        owner[key] = name
    bindings = [d for (kind, _), d in rbac.items() if kind == "RoleBinding"]
    assert len(bindings) == 1, (name, list(rbac))
    (b,) = bindings
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": account, **({"namespace": "shop"} if "namespace" in b["subjects"][0] else {})}], (name, b["subjects"])
    assert ("Role", b["roleRef"]["name"]) in rbac, f"{name}: its RoleBinding binds a Role it does not render"
    print(f"{name}: RoleBinding {b['metadata']['name']} -> Role {b['roleRef']['name']} -> ServiceAccount {account}")
def can(cluster, account, verb):
    for (kind, _), b in cluster.items():
        if kind == "RoleBinding" and any(s["name"] == account for s in b["subjects"]):
            role = cluster.get(("Role", b["roleRef"]["name"]))
            if role and any("pods" in r["resources"] and verb in r["verbs"] for r in role["rules"]):
                return True
    return False
for order in itertools.permutations(installs):
    cluster = {}
    for _, _, rbac in order:      # kubectl apply: an object of the same kind and name is replaced
        cluster.update(rbac)
    for name, account, _ in installs:
        for verb in ("watch", "patch"):
            assert can(cluster, account, verb), f"after applying {[n for n, _, _ in order]}, {account} ({name}) cannot {verb} pods"
print(f"{len(installs)} installations in one namespace, applied in every order: every ServiceAccount keeps watch and patch on pods")
PY
  # No chart release can take a name of the Components.
  one_line_refusal 'the full name "redlock-sidecar-attach" .*starts with "redlock-sidecar-attach"' \
    helm template redlock-sidecar-attach "${CHART}" "${REQ[@]}"
  one_line_refusal 'the full name "redlock-sidecar-attach-orders" .*fullnameOverride' \
    helm template x "${CHART}" "${REQ[@]}" --set fullnameOverride=redlock-sidecar-attach-orders
}
check "platform 1: a RoleBinding per attached Deployment and per release, each binding its own ServiceAccount" attachments_own_rolebindings

redis_update_policy() {
  # The bundled Redis' StatefulSet never takes a second voter while one is not Ready (counted): the
  # controller's OrderedReady gate (every pod Running, Ready and Available for minReadySeconds before
  # it acts), one pod unavailable at most, every pod updated; in every rendering that deploys it.
  local dir="${WORK}/redis-policy"
  mkdir -p "${dir}"
  helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.nodes=5 --set lock.ttl=30s --set lock.renewInterval=5s \
    --show-only templates/redis.yaml >"${dir}/five.yaml"
  "${PY}" - "${WORK}"/rendered/*.yaml manifests/redlock-sidecar.yaml "${dir}/five.yaml" <<'PY'
import math, re, sys, yaml
seen = 0
for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        spec, where = sts["spec"], f"{path}: {sts['metadata']['name']}"
        assert spec["podManagementPolicy"] == "OrderedReady", (where, spec.get("podManagementPolicy"))
        assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0, "maxUnavailable": 1}}, \
            (where, spec["updateStrategy"])
        # minReadySeconds kept: one renew interval (ttl/3, or lock.renewInterval), rounded up.
        assert spec["minReadySeconds"] >= 1, (where, spec["minReadySeconds"])
        if path.endswith("/five.yaml"):
            assert spec["replicas"] == 5 and spec["minReadySeconds"] == 5, (where, spec["replicas"], spec["minReadySeconds"])
        # Ready means counted again: the readiness probe's uptime threshold, and the PDB beside it.
        probe = " ".join(spec["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"])
        assert re.search(r'-ge [1-9][0-9]* \]', probe), where
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == sts["metadata"]["name"]]
        assert [p["spec"]["minAvailable"] for p in pdbs] == [spec["replicas"] - 1], (where, pdbs)
        seen += 1
assert seen >= 4, seen
print(f"{seen} StatefulSets: OrderedReady, RollingUpdate partition 0 maxUnavailable 1, minReadySeconds kept")
PY
  grep -q 'minReadySeconds: 4$' "${WORK}/rendered/default.yaml"
}
check "platform 2: bundled Redis updates are OrderedReady, maxUnavailable 1, minReadySeconds kept" redis_update_policy

scope_scrape_refused() {
  local rule=(--set monitoring.prometheusRule.enabled=true --set monitoring.prometheusRule.runbookBaseUrl=https://r.example.com/r.md)
  local h
  for h in helm helm3; do
    one_line_refusal 'monitoring\.prometheusRule\.scope=namespace .*monitoring\.scrape=release' \
      "${h}" template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.prometheusRule.scope=namespace --set monitoring.podMonitor.enabled=true
  done
  one_line_refusal 'monitoring\.prometheusRule\.scope=namespace .*monitoring\.scrape=release' \
    helm template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.prometheusRule.scope=namespace
  # What renders: namespace rules with the namespace scraped (by this release, or by another's
  # PodMonitor), and release rules with either scrape.
  helm template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.prometheusRule.scope=namespace \
    --set monitoring.scrape=namespace --set monitoring.podMonitor.enabled=true | grep -q 'redlock.io/scrape: namespace'
  helm template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.prometheusRule.scope=namespace --set monitoring.scrape=namespace >/dev/null
  helm template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.podMonitor.enabled=true | grep -q 'redlock.io/scrape: release'
  helm template x "${CHART}" "${REQ[@]}" "${rule[@]}" --set monitoring.scrape=namespace --set monitoring.podMonitor.enabled=true >/dev/null
}
check "platform 3: prometheusRule.scope=namespace with monitoring.scrape=release refused (one line)" scope_scrape_refused

username_with_bundled_redis_refused() {
  local h out
  for h in helm helm3; do
    one_line_refusal 'redis\.username \("locker"\) is not a user of the bundled Redis \(redis\.deploy\.enabled\)' \
      "${h}" template x "${CHART}" "${REQ[@]}" --set redis.username=locker
  done
  # With your own nodes the user is passed on.
  out="$(helm template x "${CHART}" "${REQ[@]}" --set redis.deploy.enabled=false --set 'redis.urls={redis://a:6379}' --set redis.username=locker)"
  grep -A1 'name: REDLOCK_REDIS_USERNAME' <<<"${out}" | grep -q 'value: "locker"'
  refute grep -q REDLOCK_REDIS_USERNAME "${WORK}/rendered/default.yaml"
}
check "platform 4: redis.username with the bundled Redis refused (one line); passed on with redis.urls" username_with_bundled_redis_refused

cronjob_name_required() {
  local base=(--set cronjob.enabled=true --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC) h
  for h in helm helm3; do
    one_line_refusal 'cronjob\.name is required with cronjob\.enabled: .*\$\(JOB_NAME\)' "${h}" template x "${CHART}" "${REQ[@]}" "${base[@]}"
  done
  one_line_refusal 'cronjob\.name is required with cronjob\.enabled' helm template x "${CHART}" "${REQ[@]}" "${base[@]}" \
    --set cronjob.lockPerScheduleSlot=true --set cronjob.guard.minHold=90s
  # Given, it is the CronJob's name in every release (never derived from the release), and the slot is the Job name.
  local a b
  a="$(helm template one "${CHART}" -n team-a "${REQ[@]}" "${base[@]}" --set cronjob.name=nightly-report --show-only templates/cronjob.yaml)"
  b="$(helm template two "${CHART}" -n team-b "${REQ[@]}" "${base[@]}" --set cronjob.name=nightly-report --show-only templates/cronjob.yaml)"
  [ "$(grep -m1 '^  name:' <<<"${a}")" = "  name: nightly-report" ] && [ "$(grep -m1 '^  name:' <<<"${b}")" = "  name: nightly-report" ]
  grep -A1 'name: REDLOCK_SLOT' <<<"${a}" | grep -q 'value: "$(JOB_NAME)"'
  # The schema keeps it a name the CronJob controller can append its 11 characters to.
  expect_failure '/cronjob/name' helm template x "${CHART}" "${REQ[@]}" "${base[@]}" --set "cronjob.name=$(printf 'a%.0s' $(seq 53))"
}
check "platform 5: cronjob.name required whenever the CronJob is on (one line), the same in every release" cronjob_name_required

locks_prefix_per_app() {
  # shellcheck source=scripts/cargo-target.sh
  source scripts/cargo-target.sh
  cargo build --quiet --bin redlock-sidecar
  local bin out prefix_of long
  bin="$(cargo_target_dir)/debug/redlock-sidecar"
  prefix_of() { helm template "$@" --show-only templates/example.yaml | grep -A1 'name: REDLOCK_LOCKS_PREFIX' | sed -n 's/.*value: "\(.*\)"/\1/p'; }
  # The lock's name by default: per app, the same in every cluster that shares the lock.
  [ "$(prefix_of redlock "${CHART}" -n redlock "${REQ[@]}")" = redlock-redlock ]
  [ "$(prefix_of orders "${CHART}" -n shop "${REQ[@]}")" = shop-orders ]
  [ "$(prefix_of billing "${CHART}" -n shop "${REQ[@]}")" = shop-billing ]
  [ "$(prefix_of orders "${CHART}" -n shop "${REQ[@]}" --set lock.name=orders-writer)" = orders-writer ]
  [ "$(prefix_of orders "${CHART}" -n other-cluster-ns "${REQ[@]}" --set lock.name=orders-writer)" = orders-writer ]
  # An explicit value is kept (to share request locks between apps, or the former `app`).
  [ "$(prefix_of orders "${CHART}" -n shop "${REQ[@]}" --set sidecar.locks.prefix=app)" = app ]
  expect_failure '/sidecar/locks/prefix' helm template x "${CHART}" "${REQ[@]}" --set 'sidecar.locks.prefix=a:b'
  refute grep -q REDLOCK_LOCKS_PREFIX <(helm template x "${CHART}" "${REQ[@]}" --set sidecar.locks.enabled=false)
  # A lock name longer than the sidecar's 64 characters: shortened, with a hash of the whole name.
  long="$(printf 'a%.0s' $(seq 199))b"
  out="$(prefix_of x "${CHART}" "${REQ[@]}" --set "lock.name=${long}")"
  [ "${#out}" -eq 64 ] && [[ "${out}" =~ ^a{55}-[0-9a-f]{8}$ ]]
  [ "$(prefix_of x "${CHART}" "${REQ[@]}" --set "lock.name=$(printf 'a%.0s' $(seq 200))")" != "${out}" ]
  # The sidecar accepts each rendered prefix with its lock (it validates, then fails to bind TEST-NET-1).
  local lock prefix
  for lock in redlock-redlock "${long}"; do
    prefix="$(prefix_of x "${CHART}" "${REQ[@]}" --set "lock.name=${lock}")"
    out="$("${bin}" run --lock "${lock}" --locks-prefix "${prefix}" --redis redis://127.0.0.1:1 --kubernetes off --listen 192.0.2.1:9 2>&1 || true)"
    grep -q -- "--listen: cannot bind" <<<"${out}" || { echo "prefix ${prefix}: ${out}"; return 1; }
  done
  # The attach Components: the Deployment's own lock name, defined before it (so the kubelet expands it).
  "${PY}" - manifests/attach/sidecar/sidecar.yaml <<'PY'
import sys, yaml
patch = yaml.safe_load(open(sys.argv[1]))
env = [e["name"] for e in patch["spec"]["template"]["spec"]["initContainers"][0]["env"]]
values = {e["name"]: e for e in patch["spec"]["template"]["spec"]["initContainers"][0]["env"]}
assert values["REDLOCK_LOCKS_PREFIX"] == {"name": "REDLOCK_LOCKS_PREFIX", "value": "$(REDLOCK_LOCK)"}, values["REDLOCK_LOCKS_PREFIX"]
assert env.index("REDLOCK_LOCK") < env.index("REDLOCK_LOCKS_PREFIX"), env
PY
  grep -A1 'name: REDLOCK_LOCKS_PREFIX' manifests/redlock-sidecar.yaml | grep -q 'value: "redlock-redlock"'
}
check "platform 6: request-lock prefix per app by default (the lock name; chart and attach), explicit value kept" locks_prefix_per_app

selector_check_catches_partial_selection() {
  # Selectors broken on purpose so that each still selects something (the former check passed them
  # all) but misses a pod it must select: scripts/check-selectors.py must fail on each, naming it.
  local dir="${WORK}/broken-selectors" case
  mkdir -p "${dir}"
  helm template x "${CHART}" "${REQ[@]}" --set cronjob.enabled=true --set cronjob.name=report --set cronjob.lockName=report \
    --set cronjob.timeZone=Etc/UTC >"${dir}/cron.yaml"
  "${PY}" scripts/check-selectors.py "${dir}/cron.yaml" >/dev/null
  "${PY}" - "${dir}" "${WORK}/rendered/servicemonitor-values.yaml" <<'PY'
import copy, sys, yaml
out, smon = sys.argv[1:]
def load(path):
    return [d for d in yaml.safe_load_all(open(path)) if d]
def find(docs, kind, suffix=""):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))
def dump(name, docs):
    yaml.safe_dump_all(docs, open(f"{out}/{name}.yaml", "w"))
# 1. The CronJob's pods lose the label the Redis NetworkPolicy admits (the example's pods keep it).
docs = load(f"{out}/cron.yaml")
del find(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]["redlock.io/redis-client"]
dump("netpol", docs)
# 2. The Redis PodDisruptionBudget selects the example's pods instead of the Redis pods.
docs = load(f"{out}/cron.yaml")
find(docs, "PodDisruptionBudget", "-redis")["spec"]["selector"] = copy.deepcopy(find(docs, "Deployment")["spec"]["selector"])
dump("pdb", docs)
# 3. The metrics Service behind the ServiceMonitor selects the leader only.
docs = load(smon)
find(docs, "Service", "-metrics")["spec"]["selector"]["redlock.io/leader"] = "true"
dump("servicemonitor", docs)
PY
  # 4. A PodMonitor that claims the namespace but selects its own release's sidecars only, beside an
  # attached Deployment.
  helm template orders "${CHART}" -n shop "${REQ[@]}" --set monitoring.podMonitor.enabled=true >"${dir}/podmonitor-release.yaml"
  "${PY}" - "${dir}/podmonitor-release.yaml" "${WORK}/attach-selectors.yaml" "${dir}/podmonitor.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for d in docs:
    if d["kind"] == "PodMonitor":
        d["metadata"]["annotations"]["redlock.io/scrape"] = "namespace"   # claims the namespace, selects the release
yaml.safe_dump_all(docs + [d for d in yaml.safe_load_all(open(sys.argv[2])) if d], open(sys.argv[3], "w"))
PY
  local expected=(
    'netpol|NetworkPolicy/x-redlock-sidecar-redis spec.ingress misses CronJob/report, which it must select'
    'pdb|PodDisruptionBudget/x-redlock-sidecar-redis spec.selector misses StatefulSet/x-redlock-sidecar-redis, which it must select'
    'servicemonitor|ServiceMonitor/redlock-redlock-sidecar spec.selector \(through its Services\) misses Deployment/redlock-redlock-sidecar-example, which it must select'
    'podmonitor|PodMonitor/orders-redlock-sidecar spec.selector misses Deployment/orders, Deployment/orders \(leader\), which it must select \(every sidecar of the namespace\)'
  )
  local out
  for case in "${expected[@]}"; do
    expect_failure "${case#*|}" "${PY}" scripts/check-selectors.py --default-namespace redlock "${dir}/${case%%|*}.yaml"
    # Each broken selector still selects something: "at least one" alone would have passed it.
    out="$("${PY}" scripts/check-selectors.py --default-namespace redlock "${dir}/${case%%|*}.yaml" 2>&1 || true)"
    refute grep -q 'selects no ' <<<"${out}"
    echo "caught: ${case#*|}"
  done
}
check "platform 7: check-selectors.py fails on selectors that select some but not every pod they must" selector_check_catches_partial_selection

first_install_waits() {
  # README's first install, the chart README's and docs/kubernetes.md's: helm test only after the
  # Redis StatefulSet and the Deployment rolled out and a pod carries the leader label; the names are
  # those the chart renders for release "redlock" in namespace "redlock".
  "${PY}" - README.md "${CHART}/README.md" docs/kubernetes.md "${WORK}/rendered/default.yaml" <<'PY'
import re, sys, yaml
rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(open(sys.argv[4])) if d}
assert ("StatefulSet", "redlock-redlock-sidecar-redis") in rendered and ("Deployment", "redlock-redlock-sidecar-example") in rendered
steps = [("install", r"^helm install redlock "),
         ("Redis rolled out", r"^kubectl rollout status statefulset/redlock-redlock-sidecar-redis -n redlock "),
         ("Deployment rolled out", r"^kubectl rollout status deployment/redlock-redlock-sidecar-example -n redlock "),
         ("a leader", r"^timeout [0-9]+ sh -c 'until kubectl get pods -n redlock -l [^']*redlock\.io/leader=true"),
         ("helm test", r"^helm test redlock -n redlock")]
for path in sys.argv[1:4]:
    text = open(path).read()
    if path == "README.md":
        text = text.split("## A first install in a cluster", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "helm install redlock" in b)
    lines = block.splitlines()
    at = []
    for what, pattern in steps:
        hits = [i for i, l in enumerate(lines) if re.search(pattern, l)]
        assert len(hits) == 1, f"{path}: {what}: {hits}"
        at.append(hits[0])
    assert at == sorted(at), f"{path}: steps out of order {list(zip([s for s, _ in steps], at))}"
    print(f"{path}: install, Redis rolled out, Deployment rolled out, a leader, then helm test")
PY
  # The NOTES say the same.
  local out
  out="$(helm install redlock "${CHART}" --namespace redlock "${REQ[@]}" --dry-run=client)"
  grep -n 'kubectl rollout status statefulset/redlock-redlock-sidecar-redis' <<<"${out}" | cut -d: -f1 >"${WORK}/notes-rollout"
  grep -n 'helm test redlock -n redlock' <<<"${out}" | cut -d: -f1 >"${WORK}/notes-test"
  [ "$(cat "${WORK}/notes-rollout")" -lt "$(cat "${WORK}/notes-test")" ]
}
check "platform 8: the first install waits for the Redis rollout, the Deployment and a leader before helm test" first_install_waits

chart_version_and_upgrade_notes() {
  # Every change of behaviour bumps the chart version and adds an upgrade note: the newest note is
  # for the version in Chart.yaml, and names every change of this version the checks above test.
  local version
  version="$(sed -n 's/^version: //p' "${CHART}/Chart.yaml")"
  [ "${version}" = 0.5.0 ]
  "${PY}" - "${CHART}/README.md" "${version}" <<'PY'
import re, sys
text, version = open(sys.argv[1]).read(), sys.argv[2]
notes = text.split("\n## Upgrading\n", 1)[1]
headings = re.findall(r"^### (.*)$", notes, re.M)
assert headings and headings[0].endswith(f" to {version}"), headings[:2]
newest = notes.split(f"### {headings[0]}\n", 1)[1].split("\n### ", 1)[0]
for needle in ("sidecar.shards", "REDLOCK_SHARDS", "RedlockShardsUnowned", "row Shards"):
    assert needle in newest, f"the {version} upgrade note does not mention {needle}"
print(f"chart {version}: upgrade note '{headings[0]}' covers every change")
PY
}
check "platform 9: chart version 0.5.0 with an upgrade note naming each change of behaviour" chart_version_and_upgrade_notes

# --- Checked-in copies ----------------------------------------------------------------------
manifests_drift() {
  bash scripts/render-manifests.sh "${WORK}/manifests" >/dev/null
  diff -r manifests "${WORK}/manifests"
}
check "manifests/ is up to date (scripts/render-manifests.sh)" manifests_drift

chart_copies() {
  diff dashboards/redlock.json "${CHART}/dashboards/redlock.json"
  python3 scripts/chart-alerts.py --check
  # The `cluster` scope is dashboards/alerts.yaml, rule for rule.
  helm template x "${CHART}" "${REQ[@]}" --set monitoring.prometheusRule.enabled=true \
    --set monitoring.prometheusRule.scope=cluster \
    --set monitoring.prometheusRule.runbookBaseUrl=https://redlock-sidecar.invalid/docs/runbooks.md \
    --show-only templates/prometheusrule.yaml >"${WORK}/rule.yaml"
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/rule.yaml" dashboards/alerts.yaml <<'PY'
import sys, yaml
rendered = yaml.safe_load(open(sys.argv[1]))["spec"]["groups"]
plain = yaml.safe_load(open(sys.argv[2]))["groups"]
if rendered != plain:
    sys.exit("PrometheusRule groups differ from dashboards/alerts.yaml")
PY
}
check "chart copies of dashboard and alerts current; PrometheusRule scope=cluster == alerts.yaml" chart_copies

alert_scopes() {
  # scope=release: promtool tests, must-fire and must-not for every alert, against this release's
  # namespace ("shop"), lock ("orders") and CronJob ("orders-report") only.
  mkdir -p "${WORK}/scoped"
  helm template orders "${CHART}" --namespace shop "${REQ[@]}" --set lock.name=orders \
    --set monitoring.prometheusRule.enabled=true --set monitoring.prometheusRule.runbookBaseUrl=https://redlock-sidecar.invalid/docs/runbooks.md \
    --set cronjob.enabled=true --set cronjob.name=orders-report --set cronjob.lockName=report --set cronjob.timeZone=Etc/UTC \
    --show-only templates/prometheusrule.yaml >"${WORK}/scoped/rule.yaml"
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/scoped/rule.yaml" "${WORK}/scoped/alerts.release-scope.yaml" <<'PY'
import sys, yaml
rule = yaml.safe_load(open(sys.argv[1]))
assert rule["metadata"]["annotations"]["redlock.io/alert-scope"] == "release"
groups = rule["spec"]["groups"]
for r in (r for g in groups for r in g["rules"]):
    r.pop("annotations", None)  # their text is tested in dashboards/alerts.test.yaml
yaml.safe_dump({"groups": groups}, open(sys.argv[2], "w"), sort_keys=False)
PY
  cp dashboards/alerts.release-scope.test.yaml "${WORK}/scoped/"
  promtool check rules "${WORK}/scoped/alerts.release-scope.yaml"
  (cd "${WORK}/scoped" && promtool test rules alerts.release-scope.test.yaml)
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/scoped/alerts.release-scope.yaml" dashboards/alerts.release-scope.test.yaml <<'PY'
import sys, yaml
alerts = {r["alert"] for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"] if "alert" in r}
cases = [c for t in yaml.safe_load(open(sys.argv[2]))["tests"] for c in t.get("alert_rule_test", [])]
fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
missing = [f"{a}: no firing case" for a in sorted(alerts - fires)] + [f"{a}: no must-not case" for a in sorted(alerts - quiet)]
if missing:
    sys.exit("\n".join(missing))
print(f"release scope: {len(alerts)} alerts, each with both kinds of case")
PY
  # Without a CronJob, the release scope has no CronJob alert; the namespace scope narrows every
  # selector to the namespace; both load into Prometheus.
  helm template x "${CHART}" --namespace shop "${REQ[@]}" --set monitoring.prometheusRule.enabled=true \
    --set monitoring.prometheusRule.runbookBaseUrl=https://r.example.com/r.md --show-only templates/prometheusrule.yaml >"${WORK}/scoped/nocron.yaml"
  refute grep -q RedlockGuardedCronJobNotSucceeding "${WORK}/scoped/nocron.yaml"
  helm template x "${CHART}" --namespace shop "${REQ[@]}" --set monitoring.prometheusRule.enabled=true --set monitoring.prometheusRule.scope=namespace \
    --set monitoring.scrape=namespace --set monitoring.podMonitor.enabled=true \
    --set monitoring.prometheusRule.runbookBaseUrl=https://r.example.com/r.md --show-only templates/prometheusrule.yaml >"${WORK}/scoped/ns.yaml"
  "${TOOLS_DIR}/venv/bin/python" - "${WORK}/scoped/ns.yaml" "${WORK}/scoped/ns-rules.yaml" <<'PY'
import re, sys, yaml
rule = yaml.safe_load(open(sys.argv[1]))
groups = rule["spec"]["groups"]
selectors = 0
for r in (r for g in groups for r in g["rules"]):
    for name, matchers in re.findall(r"(?<![A-Za-z0-9_:])(redlock[_:][a-z_]+|up|kube_cronjob_[a-z_]+)(\{[^}]*\})?", r["expr"]):
        if name == "redlock_must_lead":
            continue
        selectors += 1
        assert 'namespace="shop"' in matchers, (r.get("alert") or r.get("record"), name, matchers)
yaml.safe_dump({"groups": groups}, open(sys.argv[2], "w"))
print(f"namespace scope: {selectors} selectors, each narrowed to the namespace")
PY
  promtool check rules "${WORK}/scoped/ns-rules.yaml"
}
check "alerts scoped to the release (promtool tests: in scope fires, out of scope does not) or namespace" alert_scopes

monitoring_values() {
  local out
  # One value labels all three objects the Prometheus Operator selects.
  out="$(helm template x "${CHART}" "${REQ[@]}" --set monitoring.podMonitor.enabled=true --set monitoring.prometheusRule.enabled=true \
    --set monitoring.prometheusRule.runbookBaseUrl=https://runbooks.example.com/r.md --set monitoring.selectorLabels.release=kps)"
  [ "$(grep -c '^    release: kps$' <<<"${out}")" -eq 2 ]
  out="$(helm template x "${CHART}" "${REQ[@]}" --set monitoring.serviceMonitor.enabled=true --set monitoring.selectorLabels.release=kps)"
  [ "$(grep -c '^    release: kps$' <<<"${out}")" -eq 1 ]
  # Every runbook_url is absolute, built from the value.
  out="$(helm template x "${CHART}" "${REQ[@]}" --set monitoring.prometheusRule.enabled=true --set monitoring.prometheusRule.scope=cluster \
    --set monitoring.prometheusRule.runbookBaseUrl=https://runbooks.example.com/r.md)"
  [ "$(grep -c 'runbook_url: https://runbooks.example.com/r.md#redlock' <<<"${out}")" -eq "$(grep -c '^ *- alert:' dashboards/alerts.yaml)" ]
  refute grep -q 'redlock-sidecar.invalid' <<<"${out}"
  # The must-lead opt-in reaches the scrape config of either monitor.
  helm template x "${CHART}" "${REQ[@]}" --set monitoring.podMonitor.enabled=true --set monitoring.mustAlwaysLead=true | grep -q 'targetLabel: redlock_must_lead'
  helm template x "${CHART}" "${REQ[@]}" --set monitoring.serviceMonitor.enabled=true --set monitoring.mustAlwaysLead=true | grep -q 'targetLabel: redlock_must_lead'
  refute grep -q redlock_must_lead <<<"$(helm template x "${CHART}" "${REQ[@]}" --set monitoring.podMonitor.enabled=true)"
  # Two releases install dashboards with different uids and titles, in the folder of the annotation.
  local a b
  a="$(helm template one "${CHART}" "${REQ[@]}" --namespace team-a --set monitoring.grafanaDashboard.enabled=true --show-only templates/dashboard.yaml)"
  b="$(helm template two "${CHART}" "${REQ[@]}" --namespace team-b --set monitoring.grafanaDashboard.enabled=true --show-only templates/dashboard.yaml)"
  grep -q '^    grafana_folder: Redlock$' <<<"${a}"
  "${TOOLS_DIR}/venv/bin/python" - <(echo "${a}") <(echo "${b}") <<'PY'
import json, sys, yaml
boards = [json.loads(yaml.safe_load(open(f))["data"]["redlock.json"]) for f in sys.argv[1:]]
uids = [b["uid"] for b in boards]
titles = [b["title"] for b in boards]
assert len(set(uids)) == 2 and all(len(u) <= 40 for u in uids), uids
assert len(set(titles)) == 2, titles
PY
}
check "monitoring: selectorLabels on all monitors/rules, absolute runbooks, per-release dashboard uid" monitoring_values

# --- Dashboard ------------------------------------------------------------------------------
dashboard_typecheck() {
  mkdir -p "${WORK}/ts"
  ln -sfn "${TOOLS_DIR}/node/node_modules" "${WORK}/ts/node_modules"
  python3 - dashboards/redlock.json "${WORK}/ts/dashboard.ts" <<'PY'
import json, sys
dashboard = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write("""import type { AnnotationQuery, Dashboard, DataQuery, Panel, RowPanel } from '@grafana/schema';

// The schema leaves the data source's own query open; this dashboard only uses Prometheus,
// whose query and annotation options (as Grafana 12 stores them) are these.
interface PromQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  format?: 'time_series' | 'table' | 'heatmap';
  instant?: boolean;
  range?: boolean;
  interval?: string;
}
interface PromAnnotation extends AnnotationQuery<PromQuery> {
  titleFormat?: string;
  textFormat?: string;
  tagKeys?: string;
  step?: string;
  useValueForTime?: boolean;
}
type PromPanel = Omit<Panel, 'targets'> & { targets?: PromQuery[] };
type PromDashboard = Omit<Dashboard, 'annotations' | 'panels'> & {
  annotations?: { list?: PromAnnotation[] };
  panels?: Array<PromPanel | RowPanel>;
};

// JSON spells the schema's string enums by value ("absolute", not ThresholdsMode.Absolute):
// map every string enum to the union of its values, everything else stays as strict as it is.
type Json<T> =
  T extends string ? (string extends T ? string : `${T}`) :
  T extends number | boolean | null | undefined ? T :
  T extends ReadonlyArray<infer U> ? Array<Json<U>> :
  T extends object ? { [K in keyof T]: Json<T[K]> } :
  T;

const dashboard: Json<PromDashboard> = """ + json.dumps(dashboard, indent=2) + """;
export default dashboard;
""")
PY
  cat >"${WORK}/ts/tsconfig.json" <<'JSON'
{ "compilerOptions": { "strict": true, "noEmit": true, "skipLibCheck": true, "target": "es2022",
    "module": "esnext", "moduleResolution": "bundler", "types": [] },
  "files": ["dashboard.ts"] }
JSON
  (cd "${WORK}/ts" && tsc --noEmit --strict -p .)
}
check "dashboard type-checks against @grafana/schema (tsc --strict)" dashboard_typecheck

check "dashboard conventions (uid, datasource variable, known metrics, rate windows, bars that tile)" \
  python3 - dashboards/redlock.json <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
KNOWN = {
    "redlock_is_leader", "redlock_leader_transitions_total", "redlock_fencing_token",
    "redlock_validity_remaining_seconds", "redlock_lease_expiry_timestamp_seconds",
    "redlock_leader_since_timestamp_seconds",
    "redlock_acquire_duration_seconds_bucket", "redlock_acquire_duration_seconds_sum",
    "redlock_acquire_duration_seconds_count", "redlock_acquire_attempts_total", "redlock_contention_total",
    "redlock_renewals_total", "redlock_renew_duration_seconds_bucket", "redlock_lock_lost_total",
    "redlock_renew_lag_seconds_bucket", "redlock_node_up", "redlock_node_request_duration_seconds_bucket",
    "redlock_node_errors_total", "redlock_node_vote_counted", "redlock_build_info",
    "redlock_kubernetes_errors_total", "redlock_guard_runs_total", "redlock_push_subscribed",
    "redlock_standby_reads_total", "redlock_standby_reads_skipped_total", "redlock_standby_waiters",
    "redlock_release_watch", "redlock_candidacy", "redlock_app_ready",
    "redlock_app_leases", "redlock_app_lock_waiting", "redlock_app_lock_acquire_seconds_bucket",
    "redlock_app_lock_acquire_seconds_count", "redlock_app_leases_ended_total",
    "process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
    "redlock_ttl_seconds", "redlock_renew_interval_seconds", "redlock_safety_margin_seconds", "redlock_info", "up",
    "redlock_shards_owned", "redlock_shards_unowned", "redlock_shards_unowned_seconds", "redlock_shard_moves_total",
    "redlock_shards_rebalance_seconds_bucket", "redlock_shards_rebalance_seconds_sum",
    "redlock_shards_rebalance_seconds_count",
    # kube-state-metrics (kube-prometheus-stack ships it): guarded CronJobs, whose pods live too briefly to scrape.
    "kube_cronjob_labels", "kube_cronjob_status_last_successful_time", "kube_cronjob_created",
    "kube_cronjob_next_schedule_time", "kube_cronjob_status_last_schedule_time",
}
FUNCS = {"sum", "max", "min", "count", "group", "rate", "increase", "histogram_quantile", "by", "on", "and", "or",
         "unless", "bool", "time", "timestamp", "max_over_time", "group_left", "group_right", "label_values", "le"}
errors = []
if d.get("uid") != "redlock-sidecar":
    errors.append("uid must be redlock-sidecar")
variables = {v["name"]: v for v in d["templating"]["list"]}
if variables.get("datasource", {}).get("type") != "datasource":
    errors.append("missing datasource variable")
for name in ("cluster", "namespace", "pod", "lock"):
    v = variables.get(name)
    if not v or v["type"] != "query" or v.get("allValue") != ".*":
        errors.append(f"variable {name} must be a query variable with allValue '.*'")
DS = {"type": "prometheus", "uid": "${datasource}"}
exprs = []
panels = [p for p in d["panels"] if p["type"] != "row"]
bars = set()
for p in panels:
    if p.get("datasource") != DS:
        errors.append(f"panel {p['title']!r} does not use $datasource")
    is_bars = p.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("drawStyle") == "bars"
    if is_bars:
        bars.add(p["title"])
        # Bars count events per bar: windows equal to the bar's own interval tile the time axis
        # (a $__rate_interval window, longer than the step, would count each event in several bars).
        if not p.get("interval"):
            errors.append(f"bars {p['title']!r} set no minimum interval (the panel's `interval`)")
    for t in p.get("targets", []):
        if t.get("datasource") != DS:
            errors.append(f"target of {p['title']!r} does not use $datasource")
        exprs.append((p["title"], t["expr"]))
for a in d["annotations"]["list"]:
    if a.get("target"):
        if a["datasource"] != DS:
            errors.append(f"annotation {a['name']!r} does not use $datasource")
        exprs.append((a["name"], a["target"]["expr"]))
for title, e in exprs:
    for r in re.findall(r"\b(?:rate|increase)\((.*?)\)", e):
        if title in bars:
            if not r.endswith("[$__interval]"):
                errors.append(f"bars {title!r}: increase() must use [$__interval]: {r}")
        # A fixed window only where a panel shows an alert's own window (RedlockLeadershipFlapping: 30m).
        elif "[$__rate_interval]" not in r and not r.endswith("[30m]"):
            errors.append(f"{title!r}: rate()/increase() without [$__rate_interval]: {r}")
    body = re.sub(r'"[^"]*"', '""', e)  # drop label values
    body = re.sub(r"\{[^}]*\}", "", body)  # drop matchers
    body = re.sub(r"\[[^\]]*\]", "", body)  # drop ranges
    # Every aggregation and join keeps cluster and namespace (a lock name may repeat across them).
    for labels in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", body):
        names = {l.strip() for l in labels.split(",")}
        if not {"cluster", "namespace"} <= names:
            errors.append(f"{title!r}: by/on ({labels}) drops cluster or namespace")
    body = re.sub(r"\((cluster|namespace|pod|instance|lock|le|node|op|kind|result|reason|direction|job)(\s*,\s*\w+)*\)", "", body)
    for ident in re.findall(r"\b[a-z_][a-z0-9_]*\b", body):
        if ident not in KNOWN and ident not in FUNCS:
            errors.append(f"{title!r}: unknown metric or function {ident!r}")
ids = [p["id"] for p in d["panels"]]
if len(ids) != len(set(ids)):
    errors.append("duplicate panel ids")
if errors:
    sys.exit("\n".join(errors))
print(f"{len(panels)} panels, {len(exprs)} queries")
PY

# --- Alerts ---------------------------------------------------------------------------------
check "promtool check rules dashboards/alerts.yaml" promtool check rules dashboards/alerts.yaml
check "promtool test rules dashboards/alerts.test.yaml" promtool test rules dashboards/alerts.test.yaml
check "every alert has a firing and a must-not case in alerts.test.yaml" \
  "${TOOLS_DIR}/venv/bin/python" - dashboards/alerts.yaml dashboards/alerts.test.yaml <<'PY'
import sys, yaml
alerts = {r["alert"] for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"] if "alert" in r}
cases = [c for t in yaml.safe_load(open(sys.argv[2]))["tests"] for c in t.get("alert_rule_test", [])]
fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
errors = [f"{a}: no case where it fires" for a in sorted(alerts - fires)]
errors += [f"{a}: no case where it must not fire" for a in sorted(alerts - quiet)]
if errors:
    sys.exit("\n".join(errors))
print(f"{len(alerts)} alerts, each with both kinds of case")
PY

check "every alert has summary, description and a runbook section" \
  "${TOOLS_DIR}/venv/bin/python" - dashboards/alerts.yaml docs/runbooks.md <<'PY'
import re, sys, yaml
rules = [r for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"] if "alert" in r]
doc = open(sys.argv[2]).read()
# GitHub-style anchors of the runbook's headings.
anchors = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
           for h in re.findall(r"^#+\s+(.*)$", doc, re.M)}
errors = []
for r in rules:
    a = r.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        if not a.get(key):
            errors.append(f"{r['alert']}: no {key}")
    url = a.get("runbook_url", "")
    if not url.startswith("https://redlock-sidecar.invalid/docs/runbooks.md#") or url.split("#", 1)[1] not in anchors:
        errors.append(f"{r['alert']}: runbook_url {url!r} does not point to a heading of docs/runbooks.md")
if errors:
    sys.exit("\n".join(errors))
print(f"{len(rules)} alerts documented")
PY

echo
if [ "${FAILED}" -gt 0 ]; then
  echo "failed: ${FAILED_NAMES[*]}"
fi
echo "ci-k8s: ${PASSED} passed, ${FAILED} failed"
[ "${FAILED}" -eq 0 ]
