#!/usr/bin/env bash
# Tests scripts/release.sh end to end against real registries on loopback (Debian's
# docker-registry, the CNCF distribution registry; storage in a temp dir), as a platform team
# would use what it publishes:
#
#   1. bad arguments: exit 2 with one line naming the argument; an unreachable registry: exit 1
#      before any build (as for 5, 6 and 8's refusals)
#   2. scripts/release.sh 127.0.0.1:PORT/redlock VERSION builds both binaries and publishes
#   3. the index pulled back (skopeo): exactly linux/amd64 and linux/arm64; each platform's image
#      copied out by platform, its digest the one the index names, unpacked (umoci), its config
#      (user 65532, entrypoint, labels) and files checked, and its binary run: amd64 natively
#      (chrooted into the image, as 65532), arm64 under qemu-aarch64-static; the SBOM found
#      through the referrers tag, its subject the index
#   4. the chart from oci://127.0.0.1:PORT/redlock/charts/redlock-sidecar, rendered with no image
#      setting: every sidecar image is the pushed index by digest
#   5. the same VERSION again: refused, nothing changed
#   6. a read-only registry refuses the push: one clear line, exit 1, no tag anywhere
#   7. a registry that refuses only the last tag: the chart and referrers tag are deleted again
#   8. a registry that wants credentials: refused without, published after `helm registry login`
#
# Not part of scripts/test.sh (CI runs it after it: .ci/run). Needs root (chroot; and to install skopeo, umoci,
# docker-registry, the arm64 cross toolchain and qemu-user-static when missing); helm through
# scripts/ci-tools.sh. With the amd64 static binary already built by scripts/test.sh (same
# target directory), it takes the arm64 build (5-8 minutes on two cores) and about 40 s more.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
# shellcheck source=scripts/ci-tools.sh
source scripts/ci-tools.sh
install_helm
need=()
command -v skopeo >/dev/null || need+=(skopeo)
command -v umoci >/dev/null || need+=(umoci)
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v curl >/dev/null || need+=(curl)
[ "$(dpkg --print-architecture)" = amd64 ] || { echo "release-test: runs on amd64 (it runs arm64 under qemu)"; exit 1; }
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
[ -x /usr/bin/qemu-aarch64-static ] || need+=(qemu-user-static)
[ -s /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates)
[ "${#need[@]}" -eq 0 ] || apt_install "${need[@]}"

VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "${pid}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "${pid}" 2>/dev/null || true; done
  rm -rf "${WORK}"
}
trap cleanup EXIT
PASSED=0
pass() { PASSED=$((PASSED + 1)); echo "PASS  $*"; }
fail() { echo "FAIL: $*"; echo "release-test: ${PASSED} passed, 1 failed"; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_until() { # wait_until WHAT COMMAND...: retry every 0.1 s for up to 20 s
  local what="$1" end=$((SECONDS + 20)); shift
  until "$@" >/dev/null 2>&1; do
    [ "${SECONDS}" -lt "${end}" ] || fail "timed out waiting for ${what}"
    sleep 0.1
  done
}

# start_registry NAME [readonly] [HTPASSWD]: a registry on a free loopback port (plain HTTP,
# deletes allowed; with HTPASSWD, only its users may read or push); sets PORT.
start_registry() {
  local name="$1" readonly="${2:-false}" htpasswd="${3:-}"
  PORT="$(free_port)"
  mkdir -p "${WORK}/${name}"
  cat >"${WORK}/${name}/config.yml" <<EOF
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage:
  filesystem: {rootdirectory: ${WORK}/${name}/data}
  delete: {enabled: true}
  maintenance: {readonly: {enabled: ${readonly}}, uploadpurging: {enabled: false}}
http: {addr: "127.0.0.1:${PORT}", secret: release-test}
EOF
  [ -z "${htpasswd}" ] || printf 'auth: {htpasswd: {realm: release-test, path: "%s"}}\n' "${htpasswd}" >>"${WORK}/${name}/config.yml"
  docker-registry serve "${WORK}/${name}/config.yml" >"${WORK}/${name}/log" 2>&1 &
  PIDS+=($!)
  wait_until "registry ${name}" curl -s -o /dev/null "http://127.0.0.1:${PORT}/v2/"
}
# tags REPO-PATH PORT: the repository's tags, one a line (none where it does not exist)
tags() {
  curl -s "http://127.0.0.1:$2/v2/$1/tags/list" | python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("tags") or []))'
}
# release ARGS...: scripts/release.sh, its exit code in RC and its stderr in ERR
release() {
  RC=0
  bash scripts/release.sh "$@" >"${WORK}/release.out" 2>"${WORK}/release.err" || RC=$?
  ERR="$(cat "${WORK}/release.err")"
}
one_line() { # one_line CODE PATTERN: exited CODE with exactly one line, matching PATTERN
  [ "${RC}" = "$1" ] || fail "exit ${RC}, not $1: ${ERR}"
  [ "$(printf '%s\n' "${ERR}" | grep -c .)" = 1 ] || fail "not one line: ${ERR}"
  grep -qE -- "$2" <<<"${ERR}" || fail "unclear message (not /$2/): ${ERR}"
}
last_line() { # last_line CODE PATTERN: exited CODE, its last line (after the progress) matching PATTERN
  [ "${RC}" = "$1" ] || fail "exit ${RC}, not $1: ${ERR}"
  ERR="$(printf '%s\n' "${ERR}" | tail -n 1)"
  grep -qE -- "$2" <<<"${ERR}" || fail "unclear message (not /$2/): ${ERR}"
}

start_registry main
MAIN="${PORT}"
REG="127.0.0.1:${MAIN}/redlock"

# --- 1. Bad input: caught before any build --------------------------------------------------------
release
one_line 2 'REGISTRY\[/PATH\] and VERSION are missing'
release "${REG}"
one_line 2 'VERSION is missing'
release "${REG}" 1.2
one_line 2 "VERSION '1.2' is not a semantic version"
release "${REG}" 1.2.3+build.4
one_line 2 "VERSION '1.2.3\+build.4' is not a semantic version"
release "${REG}" v1.2.3
one_line 2 "VERSION 'v1.2.3' is not a semantic version"
release "http://${REG}" 1.2.3
one_line 2 "REGISTRY 'http://.*' has a scheme"
release "127.0.0.1:${MAIN}/Redlock" 1.2.3
one_line 2 "REGISTRY '127.0.0.1:${MAIN}/Redlock' is not HOST"
CLOSED="$(free_port)"
release "127.0.0.1:${CLOSED}/redlock" 1.2.3
one_line 1 "127.0.0.1:${CLOSED} did not answer"
pass "bad input: exit 2 naming the argument (both missing, VERSION missing, semver, +build, v-prefix, scheme, upper case); a closed port: exit 1 before any build"

# --- 2. The release ---------------------------------------------------------------------------------
start=${SECONDS}
release "${REG}" "${VERSION}"
[ "${RC}" = 0 ] || fail "release.sh exited ${RC}: $(tail -n 20 "${WORK}/release.err")"
. scripts/cargo-target.sh
DIST="$(cargo_target_dir)/dist/${VERSION}"
for f in oci/index.json "redlock-sidecar-${VERSION}.tgz" "redlock-sidecar-${VERSION}.spdx.json" release.txt \
  bin/redlock-sidecar-linux-amd64 bin/redlock-sidecar-linux-arm64; do
  [ -e "${DIST}/${f}" ] || fail "release.sh left no ${f} in ${DIST}"
done
pass "scripts/release.sh ${REG} ${VERSION} published ($((SECONDS - start)) s, both builds included)"

# --- 3. The index, each platform's image and the SBOM, pulled back --------------------------------
IMAGE="${REG}/redlock-sidecar"
skopeo inspect --raw --tls-verify=false "docker://${IMAGE}:${VERSION}" >"${WORK}/index.json" \
  || fail "skopeo cannot read ${IMAGE}:${VERSION}"
INDEX_DIGEST="sha256:$(sha256sum "${WORK}/index.json" | cut -d' ' -f1)"
python3 - "${WORK}/index.json" >"${WORK}/platforms" <<'PY' || fail "index: $(cat "${WORK}/platforms")"
import json, sys
index = json.load(open(sys.argv[1]))
assert index["mediaType"] == "application/vnd.oci.image.index.v1+json", index.get("mediaType")
got = sorted((m["platform"]["os"] + "/" + m["platform"]["architecture"], m["digest"]) for m in index["manifests"])
assert [p for p, _ in got] == ["linux/amd64", "linux/arm64"], got
for p, d in got:
    print(p.split("/")[1], d)
PY
grep -q "^image ${IMAGE}:${VERSION}@${INDEX_DIGEST}\$" "${DIST}/release.txt" \
  || fail "release.txt does not name the index the registry serves (${INDEX_DIGEST})"
pass "the index ${IMAGE}:${VERSION} (${INDEX_DIGEST}) holds exactly linux/amd64 and linux/arm64"

while read -r arch digest; do
  skopeo copy -q --src-tls-verify=false --override-os linux --override-arch "${arch}" \
    "docker://${IMAGE}:${VERSION}" "oci:${WORK}/pulled:${arch}" || fail "skopeo copy of ${arch} failed"
  got="sha256:$(skopeo inspect --raw "oci:${WORK}/pulled:${arch}" | sha256sum | cut -d' ' -f1)"
  [ "${got}" = "${digest}" ] || fail "${arch}: the copied manifest is ${got}, the index names ${digest}"
  skopeo inspect --config "oci:${WORK}/pulled:${arch}" >"${WORK}/config-${arch}.json"
  python3 - "${WORK}/config-${arch}.json" "${arch}" "${VERSION}" <<'PY' || fail "${arch} config"
import json, sys
c, arch, version = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
assert (c["os"], c["architecture"]) == ("linux", arch), (c["os"], c["architecture"])
cfg = c["config"]
assert cfg["User"] == "65532:65532", cfg["User"]
assert cfg["Entrypoint"] == ["/usr/local/bin/redlock-sidecar"] and cfg["Cmd"] == ["run"], cfg
assert "9707/tcp" in cfg["ExposedPorts"], cfg
labels = cfg["Labels"]
assert labels["org.opencontainers.image.version"] == version, labels
assert labels["org.opencontainers.image.revision"], labels
PY
  umoci unpack --rootless --image "${WORK}/pulled:${arch}" "${WORK}/bundle-${arch}" >/dev/null \
    || fail "umoci cannot unpack the ${arch} image"
  rootfs="${WORK}/bundle-${arch}/rootfs"
  [ "$(cd "${rootfs}" && find . -type f | sort | tr '\n' ' ')" = \
    "./etc/group ./etc/passwd ./etc/ssl/certs/ca-certificates.crt ./usr/local/bin/redlock-sidecar " ] \
    || fail "${arch}: unexpected files: $(cd "${rootfs}" && find . -type f | sort | tr '\n' ' ')"
  grep -q '^nonroot:x:65532:65532:' "${rootfs}/etc/passwd" || fail "${arch}: no nonroot user"
  if [ "${arch}" = amd64 ]; then
    # Inside the image's own root, as its user: nothing but what the image holds.
    said="$(chroot --userspec=65532:65532 "${rootfs}" /usr/local/bin/redlock-sidecar --version)" \
      || fail "the amd64 binary does not run in the image's root"
    how="natively, chrooted into the image as 65532"
  else
    said="$(qemu-aarch64-static "${rootfs}/usr/local/bin/redlock-sidecar" --version)" || fail "the arm64 binary does not run under qemu"
    how="under qemu-aarch64-static"
  fi
  grep -qF "${VERSION}" <<<"${said}" || fail "${arch}: --version says '${said}'"
  LC_ALL=C readelf -l "${rootfs}/usr/local/bin/redlock-sidecar" | grep -q 'program interpreter' && fail "${arch}: not static"
  pass "linux/${arch}: ${digest} as the index says; user 65532, entrypoint, labels; '${said}' ${how}"
done <"${WORK}/platforms"

# The SBOM: the referrers tag of the index lists it, its subject is the index, its blob is the file.
REFS_TAG="${INDEX_DIGEST/:/-}"
skopeo inspect --raw --tls-verify=false "docker://${IMAGE}:${REFS_TAG}" >"${WORK}/referrers.json" \
  || fail "no referrers tag ${REFS_TAG}"
SBOM_DIGEST="$(python3 -c 'import json,sys; print(" ".join(m["digest"] for m in json.load(open(sys.argv[1]))["manifests"] if m.get("artifactType") == "application/spdx+json"))' "${WORK}/referrers.json")"
[ -n "${SBOM_DIGEST}" ] && [ "${SBOM_DIGEST}" = "${SBOM_DIGEST% *}" ] || fail "the referrers tag lists no single SBOM: $(cat "${WORK}/referrers.json")"
curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
  "http://127.0.0.1:${MAIN}/v2/redlock/redlock-sidecar/manifests/${SBOM_DIGEST}" >"${WORK}/sbom-manifest.json" \
  || fail "the SBOM manifest ${SBOM_DIGEST} is not there"
SBOM_BLOB="$(python3 - "${WORK}/sbom-manifest.json" "${INDEX_DIGEST}" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
assert m["artifactType"] == "application/spdx+json", m
assert m["subject"]["digest"] == sys.argv[2], m["subject"]
(layer,) = m["layers"]
assert layer["mediaType"] == "application/spdx+json", layer
print(layer["digest"])
PY
)" || fail "SBOM manifest: ${SBOM_BLOB:-}"
curl -sf "http://127.0.0.1:${MAIN}/v2/redlock/redlock-sidecar/blobs/${SBOM_BLOB}" >"${WORK}/sbom.json" || fail "no SBOM blob"
cmp -s "${WORK}/sbom.json" "${DIST}/redlock-sidecar-${VERSION}.spdx.json" || fail "the SBOM in the registry differs from the one in ${DIST}"
python3 - "${WORK}/sbom.json" "${VERSION}" <<'PY' || fail "SBOM content"
import json, sys
doc, version = json.load(open(sys.argv[1])), sys.argv[2]
assert doc["spdxVersion"] == "SPDX-2.3", doc["spdxVersion"]
pkgs = {p["name"]: p for p in doc["packages"]}
root = pkgs["redlock-sidecar"]
assert root["versionInfo"] == version
described = [r["relatedSpdxElement"] for r in doc["relationships"] if r["relationshipType"] == "DESCRIBES"]
assert described == [root["SPDXID"]], described
for name in ("tokio", "redis", "rustls", "kube", "ring"):
    p = pkgs[name]
    assert p["externalRefs"][0]["referenceLocator"].startswith(f"pkg:cargo/{name}@"), p
    assert p["checksums"][0]["algorithm"] == "SHA256", p
    assert "comment" not in p, f"{name} is linked but marked build-only"
assert "comment" in pkgs["protox"], "protox only builds the binary"
assert not {"proptest", "stateright", "rslock"} & set(pkgs), "dev-dependencies in the SBOM"
ids = {p["SPDXID"] for p in doc["packages"]}
assert all(r["relatedSpdxElement"] in ids for r in doc["relationships"])
PY
pass "SBOM ${SBOM_DIGEST}: SPDX 2.3, subject the index, listed by the referrers tag ${REFS_TAG:0:16}…, same as ${DIST##*/}/redlock-sidecar-${VERSION}.spdx.json"

# --- 4. The chart from the registry, rendered with no image setting -------------------------------
CHART="oci://${REG}/charts/redlock-sidecar"
helm show chart "${CHART}" --version "${VERSION}" --plain-http >"${WORK}/Chart.yaml" 2>"${WORK}/helm.err" \
  || fail "helm show chart ${CHART}: $(cat "${WORK}/helm.err")"
grep -qx "version: ${VERSION}" "${WORK}/Chart.yaml" && grep -qx "appVersion: ${VERSION}" "${WORK}/Chart.yaml" \
  || fail "chart version/appVersion are not ${VERSION}: $(cat "${WORK}/Chart.yaml")"
helm template redlock "${CHART}" --version "${VERSION}" --plain-http -n redlock \
  --set redis.existingSecret=redlock-redis >"${WORK}/rendered.yaml" 2>"${WORK}/helm.err" \
  || fail "helm template ${CHART}: $(cat "${WORK}/helm.err")"
WANT="${IMAGE}:${VERSION}@${INDEX_DIGEST}"
sidecar_images="$(sed -n 's/^ *image: *"\{0,1\}\([^"]*redlock-sidecar[^"]*\)"\{0,1\}$/\1/p' "${WORK}/rendered.yaml" | sort | uniq -c)"
[ -n "${sidecar_images}" ] || fail "no sidecar image in the rendered chart"
[ "$(sed 's/^ *[0-9]* //' <<<"${sidecar_images}")" = "${WANT}" ] || fail "sidecar images are not ${WANT}: ${sidecar_images}"
pass "helm template ${CHART} --version ${VERSION}: every sidecar image ($(awk '{s+=$1} END {print s}' <<<"${sidecar_images}") containers) is ${WANT}"

# --- 5. The same VERSION again: refused, nothing changed ------------------------------------------
before="$(tags redlock/redlock-sidecar "${MAIN}"; tags redlock/charts/redlock-sidecar "${MAIN}")"
release "${REG}" "${VERSION}"
one_line 1 "${IMAGE}:${VERSION} already exists"
[ "$(skopeo inspect --raw --tls-verify=false "docker://${IMAGE}:${VERSION}" | sha256sum | cut -d' ' -f1)" = "${INDEX_DIGEST#sha256:}" ] \
  || fail "the tag ${VERSION} moved"
[ "$(tags redlock/redlock-sidecar "${MAIN}"; tags redlock/charts/redlock-sidecar "${MAIN}")" = "${before}" ] || fail "tags changed"
pass "releasing ${VERSION} again: exit 1, '${ERR#release: }' (nothing changed)"

# The next cases reuse the binaries just built.
export RELEASE_AMD64_BIN="${DIST}/bin/redlock-sidecar-linux-amd64" RELEASE_ARM64_BIN="${DIST}/bin/redlock-sidecar-linux-arm64"
cp "${RELEASE_AMD64_BIN}" "${RELEASE_ARM64_BIN}" "${WORK}/"
export RELEASE_AMD64_BIN="${WORK}/redlock-sidecar-linux-amd64" RELEASE_ARM64_BIN="${WORK}/redlock-sidecar-linux-arm64"

# --- 6. A registry that refuses every push (read-only): found before any build --------------------
start_registry readonly true
RO="${PORT}"
release "127.0.0.1:${RO}/redlock" 0.0.1-refused
one_line 1 "^release: 127\.0\.0\.1:${RO} refuses pushes to 127\.0\.0\.1:${RO}/redlock/redlock-sidecar: .*nothing was pushed"
[ -z "$(tags redlock/redlock-sidecar "${RO}")$(tags redlock/charts/redlock-sidecar "${RO}")" ] || fail "the read-only registry has tags"
pass "read-only registry: exit 1 before any build, '${ERR#release: }'; no tag"

# --- 7. A registry that refuses only the image's tag (the last write): the rest is taken back ------
# A proxy in front of the main registry answers 403 to that one PUT and passes everything else.
PROXY="$(free_port)"
python3 - "${PROXY}" "${MAIN}" >"${WORK}/proxy.log" 2>&1 <<'PY' &
import http.client, http.server, sys
port, upstream = int(sys.argv[1]), int(sys.argv[2])
DENY = "/v2/redlock/redlock-sidecar/manifests/0.0.2-tag-refused"
class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def handle_one(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "PUT" and self.path == DENY:
            msg = b'{"errors":[{"code":"DENIED","message":"tag writes are closed"}]}'
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
        conn.request(self.command, self.path, body=body, headers=dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
    do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = handle_one
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()
PY
PIDS+=($!)
wait_until "the proxy" curl -sf "http://127.0.0.1:${PROXY}/v2/"
release "127.0.0.1:${PROXY}/redlock" 0.0.2-tag-refused
last_line 1 "^release: 127\.0\.0\.1:${PROXY} refused the manifest 0\.0\.2-tag-refused .*DENIED.*deleted again: .*charts/redlock-sidecar:0\.0\.2-tag-refused"
grep -q 'COULD NOT DELETE' <<<"${ERR}" && fail "left something behind: ${ERR}"
tags redlock/redlock-sidecar "${MAIN}" | grep -q '0\.0\.2' && fail "the image tag exists"
tags redlock/charts/redlock-sidecar "${MAIN}" | grep -q '0\.0\.2' && fail "the chart was not deleted"
[ "$(tags redlock/redlock-sidecar "${MAIN}"; tags redlock/charts/redlock-sidecar "${MAIN}")" = "${before}" ] \
  || fail "tags left behind: $(tags redlock/redlock-sidecar "${MAIN}"; tags redlock/charts/redlock-sidecar "${MAIN}")"
helm show chart "${CHART/${MAIN}/${PROXY}}" --version 0.0.2-tag-refused --plain-http >/dev/null 2>&1 && fail "the chart can still be pulled"
pass "the image's tag refused: exit 1, '${ERR#release: }'; only ${VERSION}'s tags remain"

# --- 8. A registry that wants credentials: refused without, published after helm registry login ---
if ! python3 -W ignore -c 'import crypt; print("ci:" + crypt.crypt("ci-secret", crypt.mksalt(crypt.METHOD_BLOWFISH)))' \
  >"${WORK}/htpasswd" 2>/dev/null; then
  command -v htpasswd >/dev/null || apt_install apache2-utils
  htpasswd -Bbn ci ci-secret >"${WORK}/htpasswd"
fi
start_registry auth false "${WORK}/htpasswd"
AUTH="${PORT}"
release "127.0.0.1:${AUTH}/redlock" 0.0.3-auth
one_line 1 "^release: 127\.0\.0\.1:${AUTH} refused to show .*HTTP 401.*helm registry login 127\.0\.0\.1:${AUTH}.*nothing was pushed"
no_creds="${ERR#release: }"
helm registry login "127.0.0.1:${AUTH}" --plain-http --username ci --password-stdin <<<"ci-secret" >/dev/null 2>&1 \
  || fail "helm registry login failed"
release "127.0.0.1:${AUTH}/redlock" 0.0.3-auth
helm registry logout "127.0.0.1:${AUTH}" >/dev/null 2>&1 || true
[ "${RC}" = 0 ] || fail "with credentials, release.sh exited ${RC}: $(tail -n 5 "${WORK}/release.err")"
[ "$(curl -s -u ci:ci-secret "http://127.0.0.1:${AUTH}/v2/redlock/redlock-sidecar/tags/list" \
  | python3 -c 'import json,sys; print(" ".join(sorted(t for t in json.load(sys.stdin)["tags"] if not t.startswith("sha256-"))))')" = 0.0.3-auth ] \
  || fail "with credentials, the image tag is not there"
pass "registry with credentials: without, exit 1, '${no_creds}'; after helm registry login, published"

echo "release-test: ${PASSED} passed, 0 failed"
