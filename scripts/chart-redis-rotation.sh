#!/usr/bin/env bash
# Rotating the bundled Redis password keeps the quorum (docs/kubernetes.md, "Rotating the
# password"): the chart's own start script and readiness probe, taken from the rendered
# StatefulSet, run against three real redis-server processes, each with its own copy of the
# mounted Secret (a directory per node, rewritten atomically one node after the other, as the
# kubelet does at different moments on different Kubernetes nodes).
#
# The three steps of the procedure, with the probe run on every node at every tick:
#   1. add extraPassword=NEW: every node comes to accept NEW, OLD stays accepted throughout;
#   2. password=NEW, extraPassword=OLD (clients switch to NEW): both accepted throughout,
#      also by a node restarted with the start script in the middle;
#   3. remove extraPassword: OLD comes to be refused everywhere, NEW stays accepted.
# Throughout, every probe is green (Ready), the clients' current password is accepted by every
# node, and connections opened with OLD before the rotation (one of them subscribed) keep working.
# Last, a one-step change (a password no node knows, no extraPassword) turns the probe red with
# its message: the probe cannot log in with a password the server never had.
#
# Needs helm and the tools venv (scripts/ci-tools.sh) and redis-server/redis-cli. Exit 0 on success.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/ci-tools.sh
source "${REPO_ROOT}/scripts/ci-tools.sh"
command -v helm >/dev/null || install_helm
install_kubernetes_validate   # its venv brings PyYAML
install_redis

WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT
helm template x "${REPO_ROOT}/charts/redlock-sidecar" --set image.repository=r.example.com/x \
  --set redis.existingSecret=redlock-redis --set redis.deploy.readyAfterSeconds=1 \
  --show-only templates/redis.yaml >"${WORK}/redis.yaml"

"${TOOLS_DIR}/venv/bin/python" - "${WORK}" <<'PY'
import os, socket, subprocess, sys, time, yaml

work = sys.argv[1]
sts = next(d for d in yaml.safe_load_all(open(f"{work}/redis.yaml")) if d and d["kind"] == "StatefulSet")
pod = sts["spec"]["template"]["spec"]
container = pod["containers"][0]
assert container["command"] == ["sh", "-c"], container["command"]
START = container["args"][0]
probe = container["readinessProbe"]["exec"]["command"]
assert probe[:2] == ["sh", "-c"], probe
PROBE = probe[2]
secret = next(v for v in pod["volumes"] if v["name"] == "redis-auth")["secret"]
assert [i["key"] for i in secret["items"]] == ["password", "extraPassword"] and secret["optional"], secret
PORT = str(container["ports"][0]["containerPort"])

OLD, NEW, OTHER = 'old "pass\\word', "new pass word $(x)", "nobody knows"

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

def local(script, node):
    """The chart's script with the pod's paths and port pointed at this node's directories."""
    out = script.replace("/etc/redis-auth", node["auth"]).replace("--dir /data", f"--dir {node['data']}")
    out = out.replace(f"--port {PORT}", f"--port {node['port']}").replace(f"-p {PORT}", f"-p {node['port']}")
    # Loopback only on this machine (in the pod the server listens on the pod's address).
    out = out.replace("--protected-mode yes", "--bind 127.0.0.1 --protected-mode yes")
    assert out.count(str(node["port"])) == 1, out
    return out

def resp(*args):
    return b"".join([b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in (x.encode() for x in args)])

class Conn:
    def __init__(self, port, password):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=2)
        self.auth = self.call("AUTH", password)
    def call(self, *args):
        self.s.sendall(resp(*args))
        return self.s.recv(4096)
    def close(self):
        self.s.close()

def accepts(node, password):
    c = Conn(node["port"], password)
    try:
        return c.auth == b"+OK\r\n"
    finally:
        c.close()

def write_secret(node, **keys):
    """Rewrites the node's copy of the Secret: the given keys, the others removed (atomic per file)."""
    for key in ("password", "extraPassword"):
        path = f"{node['auth']}/{key}"
        if key in keys:
            with open(path + ".tmp", "w") as f:
                f.write(keys[key])
            os.replace(path + ".tmp", path)
        elif os.path.exists(path):
            os.remove(path)

def start(node):
    node["proc"] = subprocess.Popen(["sh", "-c", local(START, node)], stdout=open(node["log"], "a"), stderr=subprocess.STDOUT)

def stop(node):
    node["proc"].terminate(); node["proc"].wait()

nodes = []
for i in range(3):
    n = {"auth": f"{work}/node{i}/etc/redis-auth", "data": f"{work}/node{i}/data", "port": free_port(), "log": f"{work}/node{i}.log"}
    os.makedirs(n["auth"]); os.makedirs(n["data"])
    write_secret(n, password=OLD)
    nodes.append(n)
for n in nodes:
    start(n)

def run_probe(node):
    r = subprocess.run(["sh", "-c", local(PROBE, node)], capture_output=True, text=True, timeout=10)
    return r.returncode == 0, (r.stdout + r.stderr).strip()

ticks = 0
def tick(step, client_password, also=(), skip=()):
    """One kubelet round: the probe on every node (each must pass), then the clients' password
    (and `also`) must be accepted by every node."""
    global ticks
    ticks += 1
    for i, n in enumerate(nodes):
        if i in skip:
            continue
        ok, out = run_probe(n)
        assert ok, f"{step}: the readiness probe of node {i} failed: {out!r}"
        for p in (client_password, *also):
            what = "the clients' password" if p == client_password else repr(p)
            assert accepts(n, p), f"{step}: node {i} refused {what}"

def await_(step, condition, client_password, also=(), deadline=15.0):
    end = time.monotonic() + deadline
    while True:
        tick(step, client_password, also)
        if condition():
            return
        if time.monotonic() > end:
            sys.exit(f"{step}: not reached within {deadline}s")
        time.sleep(0.1)

# Before: every node Ready (uptime >= 1 s), OLD accepted, NEW not.
def all_ready():
    return all(run_probe(n)[0] for n in nodes)
end = time.monotonic() + 20
while not all_ready():
    assert time.monotonic() < end, [run_probe(n) for n in nodes]
    time.sleep(0.2)
assert not any(accepts(n, NEW) for n in nodes)
held = [Conn(n["port"], OLD) for n in nodes]
assert all(c.auth == b"+OK\r\n" for c in held)
sub = Conn(nodes[0]["port"], OLD)
assert sub.call("SUBSCRIBE", "rotation").startswith(b"*3\r\n$9\r\nsubscribe")

# 1. extraPassword=NEW, one node after the other; the clients keep using OLD.
for n in nodes:
    write_secret(n, password=OLD, extraPassword=NEW)
    tick("step 1", OLD)
await_("step 1: every node accepts NEW", lambda: all(accepts(n, NEW) for n in nodes), OLD)

# 2. password=NEW, extraPassword=OLD; the clients switch to NEW (their own copy may change
# before any node's). Node 1 restarts in the middle: the start script takes password (NEW).
for i, n in enumerate(nodes):
    write_secret(n, password=NEW, extraPassword=OLD)
    tick("step 2", NEW, also=(OLD,))
    if i == 1:
        stop(n); start(n)
        end = time.monotonic() + 10
        while True:   # the restarted node: NEW from its first answer on, then Ready again
            try:
                if accepts(n, NEW):
                    break
            except OSError:
                pass
            assert time.monotonic() < end, "the restarted node never accepted NEW"
            time.sleep(0.05)
        tick("step 2, node 1 restarted", NEW, skip=(1,))
        end = time.monotonic() + 10
        while not run_probe(n)[0]:
            assert time.monotonic() < end, run_probe(n)
            tick("step 2, node 1 restarting", NEW, skip=(1,))
            time.sleep(0.1)
for _ in range(3):
    tick("step 2", NEW, also=(OLD,))

# 3. Remove extraPassword; OLD comes to be refused everywhere.
for n in nodes:
    write_secret(n, password=NEW)
    tick("step 3", NEW)
await_("step 3: no node accepts OLD", lambda: not any(accepts(n, OLD) for n in nodes), NEW)

# Connections opened with OLD before the rotation still work (node 1's was closed by its restart).
for i, c in enumerate(held):
    if i != 1:
        assert c.call("PING") == b"+PONG\r\n", f"held connection to node {i} lost"
publisher = Conn(nodes[0]["port"], NEW)
assert publisher.call("PUBLISH", "rotation", "done") == b":1\r\n"
assert b"done" in sub.s.recv(4096), "the subscriber opened with OLD lost its subscription"

# A one-step change to a password no node has: the probe turns red and says why.
write_secret(nodes[2], password=OTHER)
ok, out = run_probe(nodes[2])
assert not ok and "accepts neither" in out, (ok, out)

for n in nodes:
    stop(n)
print(f"3 nodes, {ticks} probe rounds: every probe green, the clients' password accepted by every node "
      "at every round, connections opened before the rotation kept; a one-step change turns the probe red")
PY
