#!/usr/bin/env python3
"""Every label selector in the given YAML files must select what it is written for: at least one
pod, and every pod it must.

The files are one installation (e.g. one `helm template`, or manifests/ together, or a chart
release plus a kustomization of the attach Component): their pod templates (Deployment,
StatefulSet, DaemonSet, Job, CronJob, Pod) are the pods every selector is evaluated against,
with matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) as Kubernetes does.

At least one pod (or Service) of the same namespace:

  PodMonitor spec.selector, Service spec.selector, PodDisruptionBudget spec.selector,
  NetworkPolicy spec.podSelector and its ingress/egress peers' podSelector (peers with a
  namespaceSelector reach other namespaces and are not judged), a workload's own
  spec.selector (must select its own template), pod (anti-)affinity and topology spread
  label selectors; ServiceMonitor spec.selector (Services).

Every pod it must, from what the objects say about themselves:

  Service, PodDisruptionBudget, NetworkPolicy spec.podSelector
      named like a workload of the namespace (the chart's convention), or a StatefulSet's
      serviceName: every pod of that workload.
  Service whose selector tests the sidecars' leader label
      the leader pod of every workload of its release (app.kubernetes.io/instance) that runs
      the sidecar (`run`).
  PodMonitor
      every pod that runs the sidecar: of its release, or of the namespace when annotated
      `redlock.io/scrape: namespace` (the chart's monitoring.scrape).
  ServiceMonitor
      together, the Services it selects select every pod of its release that runs the sidecar.
  NetworkPolicy whose podSelector selects Redis pods of a StatefulSet
      its ingress rules admit every pod of the namespace that connects to those pods: a
      container whose REDLOCK_REDIS (a value, or from a ConfigMap of the files through envFrom)
      names one of them (<pod>.<service>[.<namespace>[.svc[.cluster.local]]], or the Service).

A pod whose sidecar labels it at run time (env REDLOCK_LEADER_LABEL, REDLOCK_KUBERNETES not off)
counts twice: with that label "true" (the leader) and "false".

Exit 1 with one line per selector that selects nothing or misses a pod it must; otherwise print
what was checked. `--allow-empty KIND/NAME` lets one object's selectors select nothing (say why
where it is used); it never excuses a missed pod it must select.
"""
import argparse
import sys

import yaml

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")
INSTANCE = "app.kubernetes.io/instance"


def matches(selector, labels):
    """Kubernetes' LabelSelector semantics; an empty selector matches everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown operator {op}")
    return True


def selector_keys(selector):
    return set((selector.get("matchLabels") or {})) | {e["key"] for e in selector.get("matchExpressions") or []}


def as_selector(spec_selector):
    """Service.spec.selector is a plain map: equality only."""
    return {"matchLabels": spec_selector}


def pod_template(doc):
    kind = doc.get("kind")
    if kind in WORKLOADS:
        return doc["spec"]["template"]
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]
    if kind == "Pod":
        return doc
    return None


def hosts_of(urls):
    """The host names of a REDLOCK_REDIS list (redis://, rediss://, Sentinel groups with several hosts)."""
    hosts = set()
    for url in (urls or "").split(","):
        rest = url.strip().split("://", 1)[-1]
        hostport = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        host = hostport.rsplit(":", 1)[0] if ":" in hostport and not hostport.endswith("]") else hostport
        if host:
            hosts.add(host.lower().removesuffix(".cluster.local"))
    return hosts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allow-empty", action="append", default=[], metavar="KIND/NAME")
    parser.add_argument("--default-namespace", default="default")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()

    docs = [d for f in args.files for d in yaml.safe_load_all(open(f)) if d and isinstance(d, dict)]
    if not docs:
        sys.exit("no objects in " + " ".join(args.files))

    def ns(doc):
        return doc.get("metadata", {}).get("namespace") or args.default_namespace

    def name(doc):
        return f"{doc['kind']}/{doc['metadata']['name']}"

    def meta_labels(doc):
        return (doc.get("metadata") or {}).get("labels") or {}

    configmaps = {(ns(d), d["metadata"]["name"]): d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}

    def containers(template):
        spec = template.get("spec") or {}
        return (spec.get("initContainers") or []) + (spec.get("containers") or [])

    def leader_label(template):
        for c in containers(template):
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            if "REDLOCK_LEADER_LABEL" in env and env.get("REDLOCK_KUBERNETES") != "off":
                return env["REDLOCK_LEADER_LABEL"]
        return None

    def runs_sidecar(template):
        return any((c.get("args") or [None])[0] == "run" for c in containers(template))

    def redis_targets(doc, template):
        """Host names the pod's containers connect to (REDLOCK_REDIS), or None if it names none."""
        hosts, found = set(), False
        for c in containers(template):
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            if env.get("REDLOCK_REDIS"):
                found = True
                hosts |= hosts_of(env["REDLOCK_REDIS"])
            for source in c.get("envFrom") or []:
                ref = (source.get("configMapRef") or {}).get("name")
                data = configmaps.get((ns(doc), ref)) or {}
                if data.get("REDLOCK_REDIS"):
                    found = True
                    hosts |= hosts_of(data["REDLOCK_REDIS"])
        return hosts if found else None

    # One entry per pod (per leader-label value where the sidecar sets one).
    pods = []
    for d in docs:
        t = pod_template(d)
        if t is None:
            continue
        labels = (t.get("metadata") or {}).get("labels") or {}
        base = {"ns": ns(d), "workload": name(d), "release": labels.get(INSTANCE) or meta_labels(d).get(INSTANCE),
                "sidecar": runs_sidecar(t), "targets": redis_targets(d, t), "leader_key": leader_label(t)}
        key = base["leader_key"]
        if key:
            pods.append({**base, "labels": {**labels, key: "true"}, "owner": name(d) + " (leader)", "leader": "true"})
            pods.append({**base, "labels": {**labels, key: "false"}, "owner": name(d), "leader": "false"})
        else:
            pods.append({**base, "labels": labels, "owner": name(d), "leader": None})
    services = [(ns(d), meta_labels(d), name(d)) for d in docs if d["kind"] == "Service"]
    leader_keys = {p["leader_key"] for p in pods if p["leader_key"]}

    # The names each StatefulSet's pods (and its governing Service) are reached by.
    redis_hosts = {}
    for d in docs:
        if d["kind"] != "StatefulSet":
            continue
        sts, svc, n = d["metadata"]["name"], d["spec"].get("serviceName"), ns(d)
        hosts = set()
        if svc:
            for base in [svc] + [f"{sts}-{i}.{svc}" for i in range(int(d["spec"].get("replicas", 1)))]:
                hosts |= {base, f"{base}.{n}", f"{base}.{n}.svc"}
        redis_hosts[(n, name(d))] = hosts

    errors, checked = [], []

    def selected(selector, doc):
        return [p for p in pods if p["ns"] == ns(doc) and matches(selector, p["labels"])]

    def judge(doc, where, selector, targets=None, what="pods"):
        if targets is None:
            hits = [p["owner"] for p in selected(selector, doc)]
        else:
            hits = [owner for (n, labels, owner) in targets if n == ns(doc) and matches(selector, labels)]
        checked.append(f"{name(doc)} {where}: {len(hits)} ({', '.join(sorted(set(hits)))})")
        if not hits and name(doc) not in args.allow_empty:
            errors.append(f"{name(doc)} {where} {selector} selects no {what} in namespace {ns(doc)}")
        return hits

    def must(doc, where, selector, required, reason):
        """Every pod of `required` must be selected by `selector` (a function of a pod entry)."""
        if not required:
            return
        missing = sorted({p["owner"] for p in required if not selector(p)})
        if missing:
            errors.append(f"{name(doc)} {where} misses {', '.join(missing)}, which it must select ({reason})")
        else:
            owners = sorted({p["owner"] for p in required})
            checked.append(f"{name(doc)} {where}: selects all {len(owners)} it must ({reason}): {', '.join(owners)}")

    def by_selector(selector):
        return lambda p: matches(selector, p["labels"])

    def workload_pods(doc):
        """Pods of the workloads an object is for: named like it, or governed by it (Service)."""
        wanted = {w for w in (f"{k}/{doc['metadata']['name']}" for k in WORKLOADS + ("CronJob", "Pod"))}
        if doc["kind"] == "Service":
            wanted |= {name(d) for d in docs if d["kind"] == "StatefulSet" and ns(d) == ns(doc)
                       and d["spec"].get("serviceName") == doc["metadata"]["name"]}
        return [p for p in pods if p["ns"] == ns(doc) and p["workload"] in wanted]

    def sidecars_in_scope(doc):
        scope = ((doc.get("metadata") or {}).get("annotations") or {}).get("redlock.io/scrape", "release")
        if scope == "namespace":
            return [p for p in pods if p["ns"] == ns(doc) and p["sidecar"]], "every sidecar of the namespace"
        release = meta_labels(doc).get(INSTANCE)
        if not release:
            return [], ""
        return ([p for p in pods if p["ns"] == ns(doc) and p["sidecar"] and p["release"] == release],
                f"every sidecar of release {release}")

    def peer_admits(peer, doc):
        """Whether a NetworkPolicy peer admits pods of the policy's own namespace, as a selector."""
        if "ipBlock" in peer:
            return None
        if "namespaceSelector" in peer:
            ns_sel = peer["namespaceSelector"]
            if not matches(ns_sel, {"kubernetes.io/metadata.name": ns(doc)}):
                return None
        return peer.get("podSelector") or {}

    def scheduling(doc, spec, where):
        affinity = spec.get("affinity") or {}
        for kind in ("podAffinity", "podAntiAffinity"):
            terms = affinity.get(kind) or {}
            for t in terms.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
                judge(doc, f"{where}.{kind}", t["labelSelector"])
            for t in terms.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
                judge(doc, f"{where}.{kind}", t["podAffinityTerm"]["labelSelector"])
        for i, c in enumerate(spec.get("topologySpreadConstraints") or []):
            if "labelSelector" in c:
                judge(doc, f"{where}.topologySpreadConstraints[{i}]", c["labelSelector"])

    for d in docs:
        kind = d["kind"]
        spec = d.get("spec") or {}
        if kind == "PodMonitor":
            judge(d, "spec.selector", spec["selector"])
            required, reason = sidecars_in_scope(d)
            must(d, "spec.selector", by_selector(spec["selector"]), required, reason)
        elif kind == "ServiceMonitor":
            judge(d, "spec.selector", spec["selector"], services, "Services")
            chosen = [s for s in docs if s["kind"] == "Service" and ns(s) == ns(d)
                      and matches(spec["selector"], meta_labels(s)) and (s.get("spec") or {}).get("selector")]
            required, reason = sidecars_in_scope(d)
            must(d, "spec.selector (through its Services)",
                 lambda p: any(matches(as_selector(s["spec"]["selector"]), p["labels"]) for s in chosen), required, reason)
        elif kind == "Service" and spec.get("selector"):
            selector = as_selector(spec["selector"])
            judge(d, "spec.selector", selector)
            must(d, "spec.selector", by_selector(selector), workload_pods(d), "its workload")
            for key in leader_keys & set(spec["selector"]):
                release = meta_labels(d).get(INSTANCE)
                required = [p for p in pods if p["ns"] == ns(d) and p["sidecar"] and p["release"] == release
                            and p["leader_key"] == key and p["leader"] == spec["selector"][key]] if release else []
                must(d, "spec.selector", by_selector(selector), required,
                     f"the pods labelled {key}={spec['selector'][key]} of every sidecar workload of release {release}")
        elif kind == "PodDisruptionBudget":
            judge(d, "spec.selector", spec["selector"])
            must(d, "spec.selector", by_selector(spec["selector"]), workload_pods(d), "its workload")
        elif kind == "NetworkPolicy":
            judge(d, "spec.podSelector", spec["podSelector"])
            must(d, "spec.podSelector", by_selector(spec["podSelector"]), workload_pods(d), "its workload")
            for direction, peers_key in (("ingress", "from"), ("egress", "to")):
                for i, rule in enumerate(spec.get(direction) or []):
                    for j, peer in enumerate(rule.get(peers_key) or []):
                        if "podSelector" in peer and "namespaceSelector" not in peer:
                            judge(d, f"spec.{direction}[{i}].{peers_key}[{j}].podSelector", peer["podSelector"])
            # The Redis pods it guards must admit every pod of the namespace that connects to them.
            guarded = {p["workload"] for p in selected(spec["podSelector"], d)}
            hosts = set().union(*[redis_hosts.get((ns(d), w), set()) for w in guarded])
            if hosts and "Ingress" in (spec.get("policyTypes") or ["Ingress"]):
                clients = [p for p in pods if p["ns"] == ns(d) and p["targets"] and p["targets"] & hosts]

                def admitted(p, rules=spec.get("ingress") or []):
                    for rule in rules:
                        peers = rule.get("from")
                        if not peers:
                            return True   # a rule without peers admits everyone
                        for peer in peers:
                            sel = peer_admits(peer, d)
                            if sel is not None and matches(sel, p["labels"]):
                                return True
                    return False
                must(d, "spec.ingress", admitted, clients, "every pod of the namespace that connects to the pods it guards")
        if pod_template(d) is not None and kind != "Pod":
            template = pod_template(d)
            if kind in WORKLOADS and "selector" in spec:
                own = (template.get("metadata") or {}).get("labels") or {}
                checked.append(f"{name(d)} spec.selector: its own template")
                if not matches(spec["selector"], own):
                    errors.append(f"{name(d)} spec.selector does not select its own pod template")
            scheduling(d, template.get("spec") or {}, "pod template")

    if errors:
        sys.exit("\n".join(errors))
    print(f"{len(checked)} selectors over {len(pods)} pod templates and {len(services)} Services, "
          "each selects something and every pod it must:")
    for line in checked:
        print("  " + line)


if __name__ == "__main__":
    main()
