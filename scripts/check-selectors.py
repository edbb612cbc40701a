#!/usr/bin/env python3
"""Every label selector in the given YAML files must select what it is written for.

The files are one installation (e.g. one `helm template`, or manifests/ together, or a chart
release plus a kustomization of the attach Component): their pod templates (Deployment,
StatefulSet, DaemonSet, Job, CronJob, Pod) are the pods every selector is evaluated against,
with matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) as Kubernetes does:

  PodMonitor spec.selector, Service spec.selector, PodDisruptionBudget spec.selector,
  NetworkPolicy spec.podSelector and its ingress/egress peers' podSelector (peers with a
  namespaceSelector reach other namespaces and are not judged), a workload's own
  spec.selector (must select its own template), pod (anti-)affinity and topology spread
  label selectors                                   -> at least one pod of the same namespace;
  ServiceMonitor spec.selector                      -> at least one Service of the same namespace.

A pod whose sidecar labels it at run time (env REDLOCK_LEADER_LABEL, REDLOCK_KUBERNETES not off)
counts twice: with that label "true" (the leader) and "false".

Exit 1 with one line per selector that selects nothing; otherwise print what was checked.
`--allow-empty KIND/NAME` lets one object's selectors select nothing (say why where it is used).
"""
import argparse
import sys

import yaml

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


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

    def leader_label(template):
        spec = template.get("spec") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            if "REDLOCK_LEADER_LABEL" in env and env.get("REDLOCK_KUBERNETES") != "off":
                return env["REDLOCK_LEADER_LABEL"]
        return None

    pods = []  # (namespace, labels, owner)
    for d in docs:
        t = pod_template(d)
        if t is not None:
            labels = (t.get("metadata") or {}).get("labels") or {}
            key = leader_label(t)
            if key:
                pods.append((ns(d), {**labels, key: "true"}, name(d) + " (leader)"))
                pods.append((ns(d), {**labels, key: "false"}, name(d)))
            else:
                pods.append((ns(d), labels, name(d)))
    services = [(ns(d), (d.get("metadata") or {}).get("labels") or {}, name(d)) for d in docs if d["kind"] == "Service"]

    errors, checked = [], []

    def judge(doc, where, selector, targets, what="pods"):
        hits = [owner for (n, labels, owner) in targets if n == ns(doc) and matches(selector, labels)]
        checked.append(f"{name(doc)} {where}: {len(hits)} ({', '.join(sorted(set(hits)))})")
        if not hits and name(doc) not in args.allow_empty:
            errors.append(f"{name(doc)} {where} {selector} selects no {what} in namespace {ns(doc)}")
        return hits

    def scheduling(doc, spec, where):
        affinity = spec.get("affinity") or {}
        for kind in ("podAffinity", "podAntiAffinity"):
            terms = affinity.get(kind) or {}
            for t in terms.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
                judge(doc, f"{where}.{kind}", t["labelSelector"], pods)
            for t in terms.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
                judge(doc, f"{where}.{kind}", t["podAffinityTerm"]["labelSelector"], pods)
        for i, c in enumerate(spec.get("topologySpreadConstraints") or []):
            if "labelSelector" in c:
                judge(doc, f"{where}.topologySpreadConstraints[{i}]", c["labelSelector"], pods)

    for d in docs:
        kind = d["kind"]
        spec = d.get("spec") or {}
        if kind == "PodMonitor":
            judge(d, "spec.selector", spec["selector"], pods)
        elif kind == "ServiceMonitor":
            judge(d, "spec.selector", spec["selector"], services, "Services")
        elif kind == "Service" and spec.get("selector"):
            judge(d, "spec.selector", as_selector(spec["selector"]), pods)
        elif kind == "PodDisruptionBudget":
            judge(d, "spec.selector", spec["selector"], pods)
        elif kind == "NetworkPolicy":
            judge(d, "spec.podSelector", spec["podSelector"], pods)
            for direction, peers_key in (("ingress", "from"), ("egress", "to")):
                for i, rule in enumerate(spec.get(direction) or []):
                    for j, peer in enumerate(rule.get(peers_key) or []):
                        if "podSelector" in peer and "namespaceSelector" not in peer:
                            judge(d, f"spec.{direction}[{i}].{peers_key}[{j}].podSelector", peer["podSelector"], pods)
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
    print(f"{len(checked)} selectors over {len(pods)} pod templates and {len(services)} Services, each selects something:")
    for line in checked:
        print("  " + line)


if __name__ == "__main__":
    main()
