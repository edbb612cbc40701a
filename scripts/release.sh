#!/usr/bin/env bash
# Cuts a release and publishes it to an OCI registry, without a container daemon and without
# downloading anything (no base image: the images are FROM scratch):
#
#   scripts/release.sh REGISTRY[/PATH] VERSION        e.g. scripts/release.sh registry.example.com/platform 0.1.0
#
# It builds the static binary for amd64 and arm64 (scripts/build-static.sh, in the target
# directory's static/ like scripts/test.sh), assembles two images and their OCI image index,
# writes an SPDX 2.3 SBOM of the Rust packages, packages the chart so that it defaults to that
# index by digest, and publishes (scripts/release-oci.py):
#
#   REGISTRY/PATH/redlock-sidecar:VERSION             the image index: linux/amd64 and linux/arm64
#   REGISTRY/PATH/redlock-sidecar@sha256:…            the SBOM, an OCI artifact (artifactType
#                                                     application/spdx+json) whose subject is the
#                                                     index; found through the registry's referrers
#                                                     API, or its referrers tag sha256-<index hex>
#   REGISTRY/PATH/charts/redlock-sidecar:VERSION      the chart (what `helm push` writes), whose
#                                                     image defaults to the index above by digest
#
# and leaves the same in $(cargo_target_dir)/dist/VERSION/ (or RELEASE_OUT, new or empty): oci/ (the OCI
# image layout, with the SBOM), redlock-sidecar-VERSION.tgz (the chart),
# redlock-sidecar-VERSION.spdx.json, bin/redlock-sidecar-linux-{amd64,arm64}, release.txt.
# Then `helm install NAME oci://REGISTRY/PATH/charts/redlock-sidecar --version VERSION` needs no
# image setting.
#
# Nothing is half-published: blobs, manifests, the index and the SBOM go in by digest first
# (untagged), then the chart, and the image's tag VERSION last; a tag that cannot be written takes
# the chart and the tags written before it back out. A registry that refuses, or a VERSION
# already there (a released version is never overwritten), stops it with one line on stderr
# before anything is tagged.
#
# Environment:
#   RELEASE_AMD64_BIN, RELEASE_ARM64_BIN  static binaries built before (skip those builds)
#   RELEASE_PLAIN_HTTP=1   plain HTTP to the registry (always for 127.0.0.0/8, localhost, [::1])
#   RELEASE_SOURCE_URL     the image's org.opencontainers.image.source label (default: the
#                          `origin` remote, where it is an https URL)
#   HELM                   the helm binary (default: helm on PATH, else scripts/ci-tools.sh's)
#   Credentials: `helm registry login REGISTRY` (the chart and the images use them), or a
#   docker-format auth file (REGISTRY_AUTH_FILE, ~/.docker/config.json).
#
# Exit: 0 published; 1 failed (one line saying what, and that nothing is tagged, or what was
# deleted again); 2 invalid arguments.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"

usage() {
  echo "release: $1 (usage: scripts/release.sh REGISTRY[/PATH] VERSION, e.g. registry.example.com/platform 0.1.0)" >&2
  exit 2
}
case "$#" in
  0) usage "REGISTRY[/PATH] and VERSION are missing" ;;
  1) usage "VERSION is missing" ;;
  2) ;;
  *) usage "too many arguments ($#): REGISTRY[/PATH] and VERSION only" ;;
esac
REGISTRY="${1%/}" VERSION="$2"
case "${REGISTRY}" in
  *://*) usage "REGISTRY '${REGISTRY}' has a scheme: give HOST[:PORT][/PATH]" ;;
esac
# Host (a name, an IPv4 address or [IPv6]) and port, then repository path components as the OCI
# distribution spec allows them (lower case).
[[ "${REGISTRY}" =~ ^([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:[0-9]{1,5})?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*$ ]] \
  || usage "REGISTRY '${REGISTRY}' is not HOST[:PORT][/PATH] (the path in lower case: a-z, 0-9, '.', '_', '-' between them)"
# Semantic versioning (helm needs it for a chart version); no +build metadata, which a tag
# cannot hold.
[[ "${VERSION}" =~ ^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$ ]] \
  || usage "VERSION '${VERSION}' is not a semantic version MAJOR.MINOR.PATCH[-PRERELEASE] (no leading 'v', no '+build')"
[ "${#VERSION}" -le 128 ] || usage "VERSION is longer than a tag may be (128 characters)"
if [ -n "${RELEASE_OUT:-}" ] && [ -e "${RELEASE_OUT}" ] && [ -n "$(ls -A "${RELEASE_OUT}")" ]; then
  usage "RELEASE_OUT '${RELEASE_OUT}' is not empty"
fi

HOST="${REGISTRY%%/*}"
IMAGE_REPO="${REGISTRY}/redlock-sidecar"
CHART_REPO="${REGISTRY}/charts/redlock-sidecar"
PLAIN=()
case "${HOST%:*}" in
  127.* | localhost | '[::1]') PLAIN=(--plain-http) ;;
esac
[ "${HOST}" = '[::1]' ] && PLAIN=(--plain-http)
[ "${RELEASE_PLAIN_HTTP:-}" = 1 ] && PLAIN=(--plain-http)

log() { printf 'release: %s\n' "$*" >&2; }
fail() { printf 'release: %s\n' "$*" >&2; exit 1; }
# shellcheck source=scripts/cargo-target.sh
. scripts/cargo-target.sh

# --- Tools: python3 and helm; for the arm64 build, Debian's cross toolchain -----------------------
command -v python3 >/dev/null || fail "needs python3 (Debian: python3)"
install_with_ci_tools() { # in a subshell: ci-tools.sh also points helm's homes at target/ci-tools
  (
    # shellcheck source=scripts/ci-tools.sh
    source scripts/ci-tools.sh
    "$@"
  ) || fail "could not install what it needs ($*): see target/ci-tools/apt.log"
}
if [ -z "${HELM:-}" ]; then
  if command -v helm >/dev/null; then
    HELM="$(command -v helm)"
  else
    [ -x target/ci-tools/bin/helm ] || install_with_ci_tools install_helm
    HELM="${REPO_ROOT}/target/ci-tools/bin/helm"
  fi
fi
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
if [ ! -s "${CA_BUNDLE}" ]; then
  [ "$(id -u)" = 0 ] || fail "needs ${CA_BUNDLE} (Debian: ca-certificates), the images' CA roots"
  install_with_ci_tools apt_install ca-certificates
fi

# --- Before any build: the registry answers and VERSION is not there yet --------------------------
python3 scripts/release-oci.py check --repo "${IMAGE_REPO}" --chart-repo "${CHART_REPO}" \
  --version "${VERSION}" "${PLAIN[@]}"

if [ -n "${RELEASE_OUT:-}" ]; then
  OUT="${RELEASE_OUT}"
else
  OUT="$(cargo_target_dir)/dist/${VERSION}"
  rm -rf "${OUT}"
fi
mkdir -p "${OUT}/bin"
WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT

# --- The binaries ---------------------------------------------------------------------------------
HOST_ARCH="$(dpkg --print-architecture 2>/dev/null || uname -m)"
case "${HOST_ARCH}" in x86_64) HOST_ARCH=amd64 ;; aarch64) HOST_ARCH=arm64 ;; esac
CRATE_VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
for arch in amd64 arm64; do
  var="RELEASE_${arch^^}_BIN"
  bin="${!var:-}"
  if [ -z "${bin}" ]; then
    if [ "${arch}" != "${HOST_ARCH}" ]; then
      case "${arch}" in
        arm64) gcc=aarch64-linux-gnu-gcc pkgs=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross) ;;
        amd64) gcc=x86_64-linux-gnu-gcc pkgs=(gcc-x86-64-linux-gnu libc6-dev-amd64-cross) ;;
      esac
      if ! command -v "${gcc}" >/dev/null; then
        [ "$(id -u)" = 0 ] || fail "cross-building for ${arch} needs ${gcc} (Debian: ${pkgs[*]})"
        install_with_ci_tools apt_install "${pkgs[@]}"
      fi
    fi
    log "building the static binary for ${arch} (a few minutes)"
    bin="$(CARGO_TARGET_DIR="$(cargo_target_dir)/static" bash scripts/build-static.sh --arch "${arch}")" \
      || fail "the ${arch} build failed"
  fi
  [ -f "${bin}" ] || fail "${var}: no file at ${bin}"
  case "${arch}" in amd64) machine='X86-64' ;; arm64) machine='AArch64' ;; esac
  LC_ALL=C readelf -h "${bin}" 2>/dev/null | grep -q "Machine: .*${machine}" || fail "${bin} is not a linux/${arch} executable"
  ! LC_ALL=C readelf -l "${bin}" | grep -q 'Requesting program interpreter' || fail "${bin} is not static"
  install -m 0755 "${bin}" "${OUT}/bin/redlock-sidecar-linux-${arch}"
done
if [ "${HOST_ARCH}" = amd64 ] || [ "${HOST_ARCH}" = arm64 ]; then
  said="$("${OUT}/bin/redlock-sidecar-linux-${HOST_ARCH}" --version)" || fail "the ${HOST_ARCH} binary does not run"
  log "binary: ${said}"
  [ "${VERSION%%-*}" = "${CRATE_VERSION}" ] \
    || log "note: VERSION ${VERSION} is not the crate's version ${CRATE_VERSION}; the binary says '${said}'"
fi

# --- Image index and SBOM -------------------------------------------------------------------------
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ -z "${RELEASE_AMD64_BIN:-}${RELEASE_ARM64_BIN:-}" ] \
  && [ -n "$(git status --porcelain --untracked-files=no -- src Cargo.toml Cargo.lock build.rs proto 2>/dev/null)" ]; then
  REVISION="${REVISION}-dirty"
  log "note: built from uncommitted changes (revision ${REVISION})"
fi
EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"
CREATED="$(date -u -d "@${EPOCH}" +%Y-%m-%dT%H:%M:%SZ)"
SOURCE="${RELEASE_SOURCE_URL:-}"
if [ -z "${SOURCE}" ]; then
  origin="$(git remote get-url origin 2>/dev/null || true)"
  # Only a public-looking https URL, without credentials.
  [[ "${origin}" =~ ^https://[^@/]+/ ]] && SOURCE="${origin%.git}"
fi
SBOM="${OUT}/redlock-sidecar-${VERSION}.spdx.json"
python3 scripts/release-oci.py sbom --version "${VERSION}" --created "${CREATED}" --out "${SBOM}" \
  || fail "could not write the SBOM (cargo metadata --locked)"
INDEX_DIGEST="$(python3 scripts/release-oci.py layout --out "${OUT}/oci" --version "${VERSION}" \
  --bin "amd64=${OUT}/bin/redlock-sidecar-linux-amd64" --bin "arm64=${OUT}/bin/redlock-sidecar-linux-arm64" \
  --ca "${CA_BUNDLE}" --created "${CREATED}" --revision "${REVISION}" --source "${SOURCE}" --sbom "${SBOM}")"
IMAGE_REF="${IMAGE_REPO}:${VERSION}@${INDEX_DIGEST}"
log "image index ${INDEX_DIGEST} (linux/amd64, linux/arm64)"

# --- The chart, defaulting to that index by digest -------------------------------------------------
cp -r charts/redlock-sidecar "${WORK}/redlock-sidecar"
python3 scripts/release-oci.py chart-values --values "${WORK}/redlock-sidecar/values.yaml" \
  --repository "${IMAGE_REPO}" --tag "${VERSION}" --digest "${INDEX_DIGEST}"
"${HELM}" package "${WORK}/redlock-sidecar" --version "${VERSION}" --app-version "${VERSION}" \
  -d "${OUT}" >"${WORK}/package.log" 2>&1 || fail "helm package failed: $(tail -n 1 "${WORK}/package.log")"
CHART_TGZ="${OUT}/redlock-sidecar-${VERSION}.tgz"
# It must render with no image setting, every sidecar image the index by digest.
"${HELM}" template check "${CHART_TGZ}" --set redis.existingSecret=check >"${WORK}/rendered.yaml" 2>"${WORK}/render.log" \
  || fail "the packaged chart does not render: $(tail -n 1 "${WORK}/render.log")"
grep -qF "${IMAGE_REF}" "${WORK}/rendered.yaml" \
  || fail "the packaged chart does not default to ${IMAGE_REF}"

# --- Publish ---------------------------------------------------------------------------------------
python3 scripts/release-oci.py publish --layout "${OUT}/oci" --repo "${IMAGE_REPO}" --chart-repo "${CHART_REPO}" \
  --version "${VERSION}" --chart "${CHART_TGZ}" --helm "${HELM}" "${PLAIN[@]}"

cat >"${OUT}/release.txt" <<EOF
version ${VERSION}
image ${IMAGE_REPO}:${VERSION}@${INDEX_DIGEST}
chart oci://${CHART_REPO} --version ${VERSION}
sbom ${IMAGE_REPO}@$(python3 -c 'import json,sys; print(next(m["digest"] for m in json.load(open(sys.argv[1]))["manifests"] if m.get("artifactType")))' "${OUT}/oci/index.json") (SPDX 2.3, subject ${INDEX_DIGEST})
revision ${REVISION}
EOF
log "published ${VERSION}:"
sed 's/^/  /' "${OUT}/release.txt" >&2
log "install: helm install NAME oci://${CHART_REPO} --version ${VERSION}${PLAIN:+ --plain-http} --set redis.existingSecret=SECRET"
