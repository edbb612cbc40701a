#!/usr/bin/env python3
"""The OCI half of scripts/release.sh: builds the image index and the SBOM, and publishes them.

Standard library only (no container daemon, no base image, no download):

    release-oci.py sbom --version V --created RFC3339 --out FILE
        An SPDX 2.3 JSON document of the Rust packages in the binary (`cargo metadata --locked`
        for linux/amd64 and linux/arm64: every package the binary links, DEPENDS_ON edges) and of
        the packages that only build it (build scripts, code generators, proc-macros:
        BUILD_DEPENDENCY_OF);
        dev-dependencies are left out. Each package has its purl (pkg:cargo/NAME@VERSION), its
        declared licence and the SHA-256 that Cargo.lock records for its source.

    release-oci.py layout --out DIR --version V --bin amd64=PATH --bin arm64=PATH --ca FILE
                          --created RFC3339 --revision REV [--source URL] [--sbom FILE]
        An OCI image layout in DIR: one image per architecture, FROM scratch (what the
        Dockerfile's distroless static:nonroot base gives the binary: /etc/passwd and /etc/group
        with nonroot 65532, the CA bundle, /tmp, /home/nonroot; then /usr/local/bin/redlock-sidecar),
        an image index of the two (tagged V in the layout) and, with --sbom, the SBOM as an OCI
        artifact whose subject is the index. Layers are gzip and tar with fixed times, so the same
        binaries give the same digests. Prints the index digest.

    release-oci.py publish --layout DIR --repo HOST/NAME --version V --chart-repo HOST/NAME
                           --chart TGZ --helm HELM [--plain-http]
        Publishes in an order that tags nothing before everything it names is in the registry:
        blobs, the two image manifests and the index by digest, the SBOM by digest; then the chart
        (`helm push`, tag V in the chart repository); then the tags of the image repository:
        the referrers tag of the index (`sha256-<hex>`, where the registry has no referrers API) and
        last V itself. If a tag cannot be written, the chart and the tags written so far are
        deleted again. Any failure is one line on stderr naming the registry and what failed; exit 1.

    release-oci.py check --repo HOST/NAME --chart-repo HOST/NAME --version V [--plain-http]
        Preflight: the registry answers, neither the image tag V nor the chart version V exists
        (a released version is never overwritten), and both repositories take pushes (a blob
        upload started and cancelled). Exit 1 with one line otherwise.

Credentials: none, HTTP basic or bearer tokens; user and password come from the first of
$REGISTRY_AUTH_FILE, helm's registry config ($HELM_REGISTRY_CONFIG, else
~/.config/helm/registry/config.json, what `helm registry login` writes), ~/.docker/config.json that
has the host (an `auths` entry, or a `credHelpers`/`credsStore` helper).
"""
import argparse
import base64
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
SPDX_JSON = "application/spdx+json"
MANIFEST_TYPES = ",".join([
    OCI_INDEX, OCI_MANIFEST,
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])
ARCHES = {"amd64": "x86_64-unknown-linux-gnu", "arm64": "aarch64-unknown-linux-gnu"}
UID = GID = 65532
BIN_PATH = "usr/local/bin/redlock-sidecar"
CA_PATH = "etc/ssl/certs/ca-certificates.crt"


class Failure(Exception):
    """One line for the user: what failed, and what that means for the release."""


def die(msg):
    print(f"release: {msg}", file=sys.stderr)
    sys.exit(1)


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- SBOM ------------------------------------------------------------------------------------

def spdx_id(name, version):
    return "SPDXRef-Package-" + re.sub(r"[^A-Za-z0-9.-]", "-", f"{name}-{version}")


def spdx_license(expr):
    # Cargo's old "MIT/Apache-2.0" means "MIT OR Apache-2.0".
    if not expr:
        return "NOASSERTION"
    return " OR ".join(part.strip() for part in expr.split("/")) if "/" in expr else expr


def cmd_sbom(args):
    repo = Path(__file__).resolve().parent.parent
    lock = tomllib.loads((repo / "Cargo.lock").read_text())
    checksums = {(p["name"], p["version"]): p.get("checksum") for p in lock.get("package", [])}
    packages, runtime, build = {}, set(), set()
    edges = set()  # (from_id, kind, to_id)
    root_id = None
    for triple in ARCHES.values():
        meta = json.loads(subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", triple],
            cwd=repo, check=True, capture_output=True).stdout)
        for p in meta["packages"]:
            packages[p["id"]] = p
        nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
        root_id = meta["resolve"]["root"]

        def kinds(dep):
            return {k["kind"] for k in dep.get("dep_kinds", [])}

        def proc_macro(pid):
            return any("proc-macro" in t["kind"] for t in packages[pid]["targets"])

        # Linked into the binary: normal edges from the root, transitively (proc-macros run in
        # the compiler: they and what they use only build it).
        todo, macros = [root_id], []
        while todo:
            pid = todo.pop()
            if pid in runtime:
                continue
            runtime.add(pid)
            for dep in nodes[pid]["deps"]:
                if None in kinds(dep) and not proc_macro(dep["pkg"]):
                    edges.add((pid, "DEPENDS_ON", dep["pkg"]))
                    todo.append(dep["pkg"])
                elif None in kinds(dep):
                    macros.append((dep["pkg"], pid))
        # Only building it: build-dependencies and proc-macros of those, and all they pull in.
        todo = []
        for dep_id, pid in macros:
            edges.add((dep_id, "BUILD_DEPENDENCY_OF", pid))
            todo.append(dep_id)
        for pid in list(runtime):
            for dep in nodes[pid]["deps"]:
                if "build" in kinds(dep):
                    edges.add((dep["pkg"], "BUILD_DEPENDENCY_OF", pid))
                    todo.append(dep["pkg"])
        while todo:
            pid = todo.pop()
            if pid in build:
                continue
            build.add(pid)
            for dep in nodes[pid]["deps"]:
                if kinds(dep) & {None, "build"}:
                    edges.add((dep["pkg"], "BUILD_DEPENDENCY_OF", pid))
                    todo.append(dep["pkg"])

    root = packages[root_id]
    spdx_packages, ids = [], {}
    for pid in sorted(runtime | build, key=lambda i: (packages[i]["name"], packages[i]["version"])):
        p = packages[pid]
        ids[pid] = spdx_id(p["name"], p["version"])
        entry = {
            "SPDXID": ids[pid],
            "name": p["name"],
            "versionInfo": args.version if pid == root_id else p["version"],
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": spdx_license(p.get("license")),
            "copyrightText": "NOASSERTION",
            "primaryPackagePurpose": "APPLICATION" if pid == root_id else "LIBRARY",
            "externalRefs": [{
                "referenceCategory": "PACKAGE-MANAGER",
                "referenceType": "purl",
                "referenceLocator": f"pkg:cargo/{p['name']}@{p['version']}",
            }],
        }
        if p.get("description"):
            entry["description"] = " ".join(p["description"].split())
        checksum = checksums.get((p["name"], p["version"]))
        if checksum:
            entry["checksums"] = [{"algorithm": "SHA256", "checksumValue": checksum}]
        if pid != root_id and pid not in runtime:
            entry["comment"] = "Used only to build redlock-sidecar (build script, code generator or proc-macro); not linked into it."
        spdx_packages.append(entry)
    relationships = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
                      "relatedSpdxElement": ids[root_id]}]
    for a, kind, b in sorted(edges):
        if a in ids and b in ids:
            relationships.append({"spdxElementId": ids[a], "relationshipType": kind, "relatedSpdxElement": ids[b]})
    digest = hashlib.sha256((repo / "Cargo.lock").read_bytes()).hexdigest()
    doc = {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{root['name']}-{args.version}",
        "documentNamespace": f"https://spdx.org/spdxdocs/{root['name']}-{args.version}-{digest[:32]}",
        "creationInfo": {
            "created": args.created,
            "creators": ["Tool: redlock-sidecar scripts/release-oci.py"],
            "comment": "Rust packages of the redlock-sidecar binary for linux/amd64 and linux/arm64, "
                       "from cargo metadata --locked over Cargo.lock.",
        },
        "packages": spdx_packages,
        "relationships": relationships,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"release: SBOM: {len(runtime)} packages linked into the binary, {len(build - runtime)} only building it",
          file=sys.stderr)


# --- Layout ----------------------------------------------------------------------------------

def tar_layer(entries, mtime):
    """entries: (path, kind, mode, uid, gid, data). Returns (gzip bytes, diff_id)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, kind, mode, uid, gid, data in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, mtime
            info.uname = info.gname = ""
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(plain)
    return packed.getvalue(), sha256(plain)


class Layout:
    def __init__(self, root):
        self.root = Path(root)
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)

    def put(self, data, media_type, **extra):
        digest = sha256(data)
        (self.root / "blobs" / "sha256" / digest.split(":", 1)[1]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    def get(self, digest):
        return (self.root / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()


def cmd_layout(args):
    created = args.created
    mtime = int(__import__("datetime").datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    bins = dict(b.split("=", 1) for b in args.bin)
    if sorted(bins) != sorted(ARCHES):
        die(f"layout needs --bin amd64=PATH and --bin arm64=PATH, got {sorted(bins)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        die(f"layout: {out} is not empty")
    layout = Layout(out)
    passwd = (b"root:x:0:0:root:/root:/sbin/nologin\n"
              b"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
              b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")
    group = b"root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"
    base, base_diff = tar_layer([
        ("etc", "dir", 0o755, 0, 0, None),
        ("etc/group", "file", 0o644, 0, 0, group),
        ("etc/passwd", "file", 0o644, 0, 0, passwd),
        ("etc/ssl", "dir", 0o755, 0, 0, None),
        ("etc/ssl/certs", "dir", 0o755, 0, 0, None),
        (CA_PATH, "file", 0o644, 0, 0, Path(args.ca).read_bytes()),
        ("home", "dir", 0o755, 0, 0, None),
        ("home/nonroot", "dir", 0o700, UID, GID, None),
        ("tmp", "dir", 0o1777, 0, 0, None),
    ], mtime)
    base_desc = layout.put(base, OCI_LAYER)
    common = {
        "org.opencontainers.image.version": args.version,
        "org.opencontainers.image.revision": args.revision,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.title": "redlock-sidecar",
        "org.opencontainers.image.description": "A Redlock (quorum lock over independent Redis masters) for the pod next to it, with fencing tokens",
        "org.opencontainers.image.licenses": "Apache-2.0",
    }
    if args.source:
        common["org.opencontainers.image.source"] = args.source
    images = []
    for arch in ("amd64", "arm64"):
        binary = Path(bins[arch]).read_bytes()
        layer, diff = tar_layer([
            ("usr", "dir", 0o755, 0, 0, None),
            ("usr/local", "dir", 0o755, 0, 0, None),
            ("usr/local/bin", "dir", 0o755, 0, 0, None),
            (BIN_PATH, "file", 0o755, 0, 0, binary),
        ], mtime)
        layer_desc = layout.put(layer, OCI_LAYER)
        config = {
            "created": created,
            "architecture": arch,
            "os": "linux",
            "config": {
                "User": f"{UID}:{GID}",
                "Env": ["PATH=/usr/local/bin", f"SSL_CERT_FILE=/{CA_PATH}"],
                "Entrypoint": [f"/{BIN_PATH}"],
                "Cmd": ["run"],
                "ExposedPorts": {"9707/tcp": {}},
                "WorkingDir": "/",
                "Labels": common,
            },
            "rootfs": {"type": "layers", "diff_ids": [base_diff, diff]},
            "history": [
                {"created": created, "created_by": "release: /etc (nonroot 65532, CA certificates), /home/nonroot, /tmp"},
                {"created": created, "created_by": f"release: /{BIN_PATH} (static, linux/{arch})"},
            ],
        }
        config_desc = layout.put(canonical(config), OCI_CONFIG)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config_desc,
            "layers": [base_desc, layer_desc],
            "annotations": common,
        }
        images.append(layout.put(canonical(manifest), OCI_MANIFEST,
                                 platform={"architecture": arch, "os": "linux"}))
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": images, "annotations": common}
    index_desc = layout.put(canonical(index), OCI_INDEX)
    entries = [{**index_desc, "annotations": {"org.opencontainers.image.ref.name": args.version}}]
    if args.sbom:
        entries.append(sbom_artifact(layout, Path(args.sbom), index_desc, created))
    (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (out / "index.json").write_bytes(canonical({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}))
    print(index_desc["digest"])


def sbom_artifact(layout, sbom, subject, created):
    empty = layout.put(b"{}", OCI_EMPTY)
    blob = layout.put(sbom.read_bytes(), SPDX_JSON,
                      annotations={"org.opencontainers.image.title": sbom.name})
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": SPDX_JSON,
        "config": empty,
        "layers": [blob],
        "subject": {k: subject[k] for k in ("mediaType", "digest", "size")},
        "annotations": {"org.opencontainers.image.created": created},
    }
    return layout.put(canonical(manifest), OCI_MANIFEST, artifactType=SPDX_JSON)


# --- Registry client -------------------------------------------------------------------------

def split_repo(ref):
    host, _, name = ref.partition("/")
    return host, name


def credentials(host):
    """(user, password) for host from the docker-format config files, or None."""
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(os.environ["REGISTRY_AUTH_FILE"])
    home = Path.home()
    files.append(os.environ.get("HELM_REGISTRY_CONFIG")
                 or str(Path(os.environ.get("HELM_CONFIG_HOME", home / ".config" / "helm")) / "registry" / "config.json"))
    files.append(str(Path(os.environ.get("DOCKER_CONFIG", home / ".docker")) / "config.json"))
    for f in files:
        try:
            cfg = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        for key, entry in (cfg.get("auths") or {}).items():
            if re.sub(r"^https?://", "", key).rstrip("/").split("/")[0] == host and entry.get("auth"):
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
                return user, password
        helper = (cfg.get("credHelpers") or {}).get(host) or cfg.get("credsStore")
        if helper:
            try:
                out = subprocess.run([f"docker-credential-{helper}", "get"], input=host.encode(),
                                     capture_output=True, check=True, timeout=30).stdout
                got = json.loads(out)
                return got["Username"], got["Secret"]
            except (OSError, subprocess.SubprocessError, ValueError, KeyError):
                continue
    return None


class Registry:
    def __init__(self, host, plain_http):
        self.host = host
        self.base = f"{'http' if plain_http else 'https'}://{host}"
        self.tokens = {}
        self.creds = credentials(host)

    def _auth(self, challenge, scope):
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic":
            if not self.creds:
                return None
            return "Basic " + base64.b64encode(f"{self.creds[0]}:{self.creds[1]}".encode()).decode()
        if scheme.lower() != "bearer":
            return None
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        query = {"service": fields.get("service", "")}
        if scope:
            query["scope"] = scope
        req = urllib.request.Request(fields["realm"] + "?" + urllib.parse.urlencode(query))
        if self.creds:
            req.add_header("Authorization", "Basic " + base64.b64encode(
                f"{self.creds[0]}:{self.creds[1]}".encode()).decode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = json.loads(resp.read())
        token = got.get("token") or got.get("access_token")
        return f"Bearer {token}" if token else None

    def request(self, method, path, scope=None, data=None, headers=None, url=None):
        """(status, headers, body); 4xx/5xx are returned, not raised."""
        url = url or self.base + path
        for attempt in (0, 1):
            req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
            if scope in self.tokens:
                req.add_header("Authorization", self.tokens[scope])
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    return resp.status, resp.headers, resp.read()
            except urllib.error.HTTPError as err:
                body = err.read()
                if err.code == 401 and attempt == 0 and "WWW-Authenticate" in err.headers:
                    try:
                        token = self._auth(err.headers["WWW-Authenticate"], scope)
                    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                        raise Failure(f"{self.host}: could not get a token to {method} {path}: {exc}") from exc
                    if token:
                        self.tokens[scope] = token
                        continue
                return err.code, err.headers, body
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise Failure(f"{self.host} did not answer {method} {path}: {reason}") from exc
        raise AssertionError("unreachable")


def explain(status, body, host=None):
    """What a registry's refusal says; for 401/403, how to log in."""
    try:
        errors = json.loads(body).get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    except (ValueError, AttributeError):
        text = body.decode(errors="replace").strip().splitlines()[0] if body.strip() else ""
    hint = ""
    if host and status in (401, 403):
        hint = f"; log in as a user who may push there (helm registry login {host})"
    return f"HTTP {status}" + (f" ({text})" if text else "") + hint


class Repo:
    def __init__(self, registry, name):
        self.reg, self.name = registry, name
        self.push_scope = f"repository:{name}:pull,push"
        self.ref = f"{registry.host}/{name}"

    def has_blob(self, digest):
        status, _, _ = self.reg.request("HEAD", f"/v2/{self.name}/blobs/{digest}", self.push_scope)
        return status == 200

    def push_blob(self, digest, data):
        if self.has_blob(digest):
            return
        status, headers, body = self.reg.request("POST", f"/v2/{self.name}/blobs/uploads/", self.push_scope, data=b"",
                                                 headers={"Content-Length": "0"})
        if status != 202:
            raise Failure(f"{self.reg.host} refused to start the upload of blob {digest} to {self.ref}: {explain(status, body, self.reg.host)}")
        location = urllib.parse.urljoin(self.reg.base + "/", headers["Location"])
        sep = "&" if "?" in location else "?"
        status, _, body = self.reg.request("PUT", None, self.push_scope, data=data, url=f"{location}{sep}digest={digest}",
                                           headers={"Content-Type": "application/octet-stream",
                                                    "Content-Length": str(len(data))})
        if status != 201:
            raise Failure(f"{self.reg.host} refused blob {digest} in {self.ref}: {explain(status, body, self.reg.host)}")

    def probe_push(self):
        """Starts a blob upload and cancels it: does the registry take pushes here, from us?"""
        status, headers, body = self.reg.request("POST", f"/v2/{self.name}/blobs/uploads/", self.push_scope, data=b"",
                                                 headers={"Content-Length": "0"})
        if status != 202:
            raise Failure(f"{self.reg.host} refuses pushes to {self.ref}: {explain(status, body, self.reg.host)}")
        location = urllib.parse.urljoin(self.reg.base + "/", headers["Location"])
        self.reg.request("DELETE", None, self.push_scope, url=location)

    def put_manifest(self, ref, data, media_type):
        status, _, body = self.reg.request("PUT", f"/v2/{self.name}/manifests/{ref}", self.push_scope, data=data,
                                           headers={"Content-Type": media_type})
        if status != 201:
            raise Failure(f"{self.reg.host} refused the manifest {ref} in {self.ref}: {explain(status, body)}")

    def manifest(self, ref):
        """(digest, media type, bytes) of ref, or None where it does not exist."""
        status, headers, body = self.reg.request("GET", f"/v2/{self.name}/manifests/{ref}", self.push_scope,
                                                 headers={"Accept": MANIFEST_TYPES})
        if status == 404:
            return None
        if status in (401, 403):
            # Without push rights a registry may refuse even to look: ask for pull only.
            status, headers, body = self.reg.request("GET", f"/v2/{self.name}/manifests/{ref}",
                                                     f"repository:{self.name}:pull", headers={"Accept": MANIFEST_TYPES})
            if status == 404:
                return None
        if status in (401, 403):
            raise Failure(f"{self.reg.host} refused to show {self.ref}:{ref}: {explain(status, body, self.reg.host)}")
        if status != 200:
            raise Failure(f"{self.reg.host} did not say whether {self.ref}:{ref} exists: {explain(status, body, self.reg.host)}")
        return headers.get("Docker-Content-Digest") or sha256(body), headers.get("Content-Type"), body

    def delete(self, digest):
        status, _, body = self.reg.request("DELETE", f"/v2/{self.name}/manifests/{digest}", self.push_scope)
        if status not in (200, 202, 404):
            raise Failure(f"{explain(status, body, self.reg.host)}")

    def referrers_api(self, digest):
        status, headers, _ = self.reg.request("GET", f"/v2/{self.name}/referrers/{digest}", self.push_scope,
                                              headers={"Accept": OCI_INDEX})
        return status == 200 and (headers.get("Content-Type") or "").startswith(OCI_INDEX)


def ping(registry):
    status, _, body = registry.request("GET", "/v2/")
    if status not in (200, 401):
        raise Failure(f"{registry.host} does not answer as an OCI registry (GET /v2/: {explain(status, body)})")


def check_unpublished(image, chart, version):
    if image.manifest(version):
        raise Failure(f"{image.ref}:{version} already exists: a released version is never overwritten; choose a new VERSION")
    if chart.manifest(version):
        raise Failure(f"the chart {chart.ref}:{version} already exists: a released version is never overwritten; choose a new VERSION")


def cmd_check(args):
    host, name = split_repo(args.repo)
    reg = Registry(host, args.plain_http)
    try:
        ping(reg)
        image, chart = Repo(reg, name), Repo(reg, split_repo(args.chart_repo)[1])
        check_unpublished(image, chart, args.version)
        image.probe_push()
        chart.probe_push()
    except Failure as exc:
        die(f"{exc}; nothing was pushed")


def cmd_publish(args):
    layout = Layout(args.layout)
    top = json.loads((layout.root / "index.json").read_bytes())["manifests"]
    index_desc = next(m for m in top if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == args.version)
    sboms = [m for m in top if m.get("artifactType") == SPDX_JSON]
    host, name = split_repo(args.repo)
    reg = Registry(host, args.plain_http)
    image = Repo(reg, name)
    chart = Repo(reg, split_repo(args.chart_repo)[1])
    index_digest = index_desc["digest"]
    nothing = "nothing was tagged: the release is not published"
    try:
        ping(reg)
        check_unpublished(image, chart, args.version)
        # 1. Blobs, then manifests by digest: children before what names them.
        index = json.loads(layout.get(index_digest))
        for m in index["manifests"]:
            manifest = json.loads(layout.get(m["digest"]))
            for blob in [manifest["config"], *manifest["layers"]]:
                image.push_blob(blob["digest"], layout.get(blob["digest"]))
            image.put_manifest(m["digest"], layout.get(m["digest"]), m["mediaType"])
        image.put_manifest(index_digest, layout.get(index_digest), OCI_INDEX)
        for s in sboms:
            manifest = json.loads(layout.get(s["digest"]))
            for blob in [manifest["config"], *manifest["layers"]]:
                image.push_blob(blob["digest"], layout.get(blob["digest"]))
            image.put_manifest(s["digest"], layout.get(s["digest"]), OCI_MANIFEST)
        print(f"release: pushed {image.ref}@{index_digest} (untagged) and its SBOM", file=sys.stderr)
    except Failure as exc:
        die(f"{exc}; {nothing}")

    # 2. The chart: helm push tags it in the chart repository.
    chart_dir = "oci://" + args.chart_repo.rsplit("/", 1)[0]
    helm = [args.helm, "push", args.chart, chart_dir] + (["--plain-http"] if args.plain_http else [])
    run = subprocess.run(helm, capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()[-1]
        die(f"{host} refused the chart (helm push to {chart_dir}: {last}); {nothing}")
    for line in (run.stdout.strip() or run.stderr.strip()).splitlines():
        print(f"release: helm push: {line}", file=sys.stderr)

    # 3. Tags, the image's VERSION last. On a failure, take back what was published.
    written = []
    try:
        got = chart.manifest(args.version)
        if not got:
            raise Failure(f"helm push reported success but {chart.ref}:{args.version} is not there")
        written.append((chart, got[0], f"the chart {chart.ref}:{args.version}"))
        if sboms and not image.referrers_api(index_digest):
            # The referrers tag schema (OCI distribution 1.1) for registries without the API.
            tag = index_digest.replace(":", "-")
            refs = {"schemaVersion": 2, "mediaType": OCI_INDEX,
                    "manifests": [{k: s[k] for k in ("mediaType", "digest", "size", "artifactType")} for s in sboms]}
            data = canonical(refs)
            image.put_manifest(tag, data, OCI_INDEX)
            written.append((image, sha256(data), f"{image.ref}:{tag}"))
        image.put_manifest(args.version, layout.get(index_digest), OCI_INDEX)
    except Failure as exc:
        undone, kept = [], []
        for repo, digest, what in reversed(written):
            try:
                repo.delete(digest)
                undone.append(what)
            except Failure as why:
                kept.append(f"{what} ({why})")
        msg = f"{exc}; the tag {args.version} of the image was not written"
        if undone:
            msg += "; deleted again: " + ", ".join(undone)
        if kept:
            msg += "; COULD NOT DELETE, remove by hand: " + ", ".join(kept)
        die(msg)
    print(f"release: tagged {image.ref}:{args.version}", file=sys.stderr)


# --- Chart values ------------------------------------------------------------------------------

def cmd_chart_values(args):
    """Sets image.repository, image.tag and image.digest in a (copied) chart's values.yaml."""
    path = Path(args.values)
    lines = path.read_text().splitlines(keepends=True)
    try:
        start = lines.index("image:\n")
    except ValueError:
        die(f"{path}: no top-level `image:` block")
    want = {"repository": args.repository, "tag": args.tag, "digest": args.digest}
    done = set()
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.strip() and not line.startswith(" "):
            break
        m = re.match(r"^  (repository|tag|digest): .*$", line)
        if m and m.group(1) not in done:
            lines[i] = f"  {m.group(1)}: {json.dumps(want[m.group(1)])}\n"
            done.add(m.group(1))
    if done != set(want):
        die(f"{path}: image.{', image.'.join(sorted(set(want) - done))} not found")
    path.write_text("".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sbom")
    p.add_argument("--version", required=True)
    p.add_argument("--created", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("layout")
    p.add_argument("--out", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--bin", action="append", default=[])
    p.add_argument("--ca", required=True)
    p.add_argument("--created", required=True)
    p.add_argument("--revision", required=True)
    p.add_argument("--source", default="")
    p.add_argument("--sbom")
    for name in ("publish", "check"):
        p = sub.add_parser(name)
        p.add_argument("--repo", required=True)
        p.add_argument("--chart-repo", required=True)
        p.add_argument("--version", required=True)
        p.add_argument("--plain-http", action="store_true")
        if name == "publish":
            p.add_argument("--layout", required=True)
            p.add_argument("--chart", required=True)
            p.add_argument("--helm", required=True)
    p = sub.add_parser("chart-values")
    p.add_argument("--values", required=True)
    p.add_argument("--repository", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--digest", required=True)
    args = ap.parse_args()
    {"sbom": cmd_sbom, "layout": cmd_layout, "publish": cmd_publish, "check": cmd_check,
     "chart-values": cmd_chart_values}[args.cmd](args)


if __name__ == "__main__":
    main()
