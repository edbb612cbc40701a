#!/usr/bin/env python3
"""Every relative link in the documentation must resolve: the file exists and, for a link with
`#anchor` into a markdown file, a heading of that file has that anchor (GitHub's rule: lower
case, punctuation dropped, spaces as hyphens, `-1`, `-2`... for repeats).

Checks README.md, docs/*.md and charts/redlock-sidecar/README.md; links inside fenced code
blocks and absolute URLs are not judged. Exit 1 with one line per broken link.

    python3 scripts/check-doc-links.py
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
FILES = ["README.md", "charts/redlock-sidecar/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def lines_outside_code(path):
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield number, line


def slug(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for _, line in lines_outside_code(path):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


errors = []
checked = 0
for name in FILES:
    path = os.path.join(ROOT, name)
    for number, line in lines_outside_code(path):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                errors.append(f"{name}:{number}: {target}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                errors.append(f"{name}:{number}: {target}: no such heading")
if errors:
    sys.exit("\n".join(errors))
print(f"{checked} links in {len(FILES)} files resolve")
