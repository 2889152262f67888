#!/usr/bin/env python3
"""Checks that every reference in the docs resolves inside this repository (issue 40 item 9).

Scanned: README.md, docs/*.md, chart/README.md, and — when the binaries are found
($IC_BIN_DIR, else target/debug) — the --help text of every ic-agent and ic-controller command.

  1. every relative Markdown link [text](path#anchor) names a file or folder of the repository
     (not outside it), and an anchor into a Markdown file names one of its headings;
  2. every repository path quoted in backticks (`scripts/test.sh`, `agent/src/main.rs`, …)
     exists; placeholders (<…>, *, $, {…}) are not checked;
  3. no doc cites a file this repository does not have (DESIGN.md), and every "spec NNN" or
     "issue N" it cites is listed in docs/glossary.md, which says what each stands for;
  4. docs/README.md (the index) links every page in docs/.

Exit 0 when all hold; else 1 with one line per broken reference (file:line: what). Needs only
Python 3; takes well under a second plus the --help runs.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
TOP = ("agent/", "controller/", "shared/", "scripts/", "chart/", "docs/", "config/", "testdata/",
       "node-tests/", "fleet/", "bench/", "cluster/", "examples/", "chart-tests/", ".ci/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TICK = re.compile(r"`([^`\n]+)`")
CITE = re.compile(r"\b(spec|issues?)[ -](\d+)", re.I)


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, out = {}, set()
        in_code = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    in_code = not in_code
                if in_code:
                    continue
                m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    a = slug(m.group(1))
                    n = seen.get(a, 0)
                    seen[a] = n + 1
                    out.add(a if n == 0 else f"{a}-{n}")
        cache[path] = out
    return cache[path]


def glossary_cites():
    cites = set()
    with open(os.path.join(ROOT, "docs/glossary.md"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\|\s*(spec|issue) (\d+)\s*\|", line, re.I)
            if m:
                cites.add((m.group(1).lower(), int(m.group(2))))
    return cites


def check_path(p):
    """None when the repository has the path, else why not."""
    full = os.path.realpath(os.path.join(ROOT, p))
    if not (full == ROOT or full.startswith(ROOT + os.sep)):
        return "points outside the repository"
    if not os.path.exists(full):
        return "does not exist"
    return None


def check_text(name, text, base_dir, problems, cites, links=True):
    in_code = False
    for no, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{no}"
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if "DESIGN.md" in line:
            problems.append(f"{where}: cites DESIGN.md, which this repository does not have")
        for m in CITE.finditer(line):
            kind = "spec" if m.group(1).lower() == "spec" else "issue"
            if (kind, int(m.group(2))) not in cites:
                problems.append(f"{where}: cites {kind} {m.group(2)}, not listed in docs/glossary.md")
        if links and not in_code:
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
                    continue
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(base_dir, path)) if path else None
                if path:
                    why = check_path(os.path.relpath(full, ROOT))
                    if why:
                        problems.append(f"{where}: link {target} {why}")
                        continue
                else:
                    full = os.path.join(ROOT, name)
                if anchor and full.endswith(".md") and anchor not in anchors(full):
                    problems.append(f"{where}: link {target}: no heading #{anchor} in "
                                    f"{os.path.relpath(full, ROOT)}")
        for m in TICK.finditer(line):
            tok = m.group(1).strip()
            tok = re.split(r"::|:\d|\s", tok)[0].rstrip(".,;:)")
            if not tok.startswith(TOP) or re.search(r"[<>*${}…|]", tok):
                continue
            why = check_path(tok)
            if why:
                problems.append(f"{where}: `{tok}` {why}")


def help_texts():
    bindir = os.environ.get("IC_BIN_DIR") or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "debug")
    out = []
    for binary in ("ic-agent", "ic-controller"):
        exe = os.path.join(bindir, binary)
        if not os.access(exe, os.X_OK):
            print(f"check-docs: {exe} not built: its --help texts are not checked", file=sys.stderr)
            continue
        todo = [[]]
        while todo:
            cmd = todo.pop()
            text = subprocess.run([exe, *cmd, "--help"], capture_output=True, text=True,
                                  timeout=30).stdout
            out.append((" ".join([binary, *cmd, "--help"]), text))
            section = False
            for line in text.splitlines():
                if line.startswith("Commands:"):
                    section = True
                    continue
                if section:
                    m = re.match(r"  (\S+)\s", line)
                    if not m:
                        section = False
                    elif m.group(1) != "help":
                        todo.append([*cmd, m.group(1)])
    return out


def main():
    cites = glossary_cites()
    problems = []
    files = ["README.md", "chart/README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            check_text(name, f.read(), os.path.dirname(os.path.join(ROOT, name)), problems, cites)
    # Every page is one hop from the index.
    with open(os.path.join(ROOT, "docs/README.md"), encoding="utf-8") as f:
        index = set(m.group(1).partition("#")[0] for m in LINK.finditer(f.read()))
    for name in files:
        if name.startswith("docs/") and name != "docs/README.md" and os.path.basename(name) not in index:
            problems.append(f"docs/README.md: does not link {name} (every page is one hop from the index)")
    for name, text in help_texts():
        check_text(name, text, ROOT, problems, cites, links=False)
    for p in problems:
        print(p)
    if problems:
        print(f"check-docs: {len(problems)} broken reference(s)", file=sys.stderr)
        return 1
    print(f"check-docs: every reference in {len(files)} docs and the --help texts resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
