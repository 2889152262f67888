#!/usr/bin/env python3
"""Checks that the product code's imports between files form no circle (issue 42 item 2).

For every crate of the repository (each `<crate>/src/` with a `lib.rs` or `main.rs`) it reads
each product `.rs` file under `src/` and collects the paths it names into its own crate:
`use crate::…`, `use super::…`, `use self::…`, a child module's name (`use prom::…`), the same
paths written inline in code (`super::shm::pod_not_found(…)`), and `pub use` re-exports. Comments,
string literals and `#[cfg(test)]` items (the `mod tests { … }` blocks) are left out: a test may
import whatever it tests. Each path resolves to the file of the longest module prefix it names
(an item of an inline `mod x { … }` belongs to its file); a `mod x;` declaration alone is no
import, and neither is a path into a module that encloses the file (`super::Context` to the
`mod.rs` above, `crate::BUILD_INFO` to `lib.rs`): a folder's `mod.rs` and its children are one
room, the parent may use its children and the children what the parent holds. A circle is a set of two or more files each reachable from the others (a strongly
connected component of that file graph).

Circles already known are listed in KNOWN with the issue that removes them. That list may only
shrink: the check fails when a circle holds a file that no entry lists (a new circle, or a known
one that grew), and also when a listed file is no longer in a circle (the entry is stale: delete
it). Exit 0 when every circle is known and every entry still needed, else 1 with one line per
finding. Needs only Python 3; well under a second.

`--self-test` runs the check on two small crates written to a temporary folder (one with a
circle through an inline `super::` path and a grouped `use crate::{…}`, one without) and exits 1
unless it finds exactly the first one's circle.
"""
import os
import re
import sys
import tempfile

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))

# Circles that exist today, each with the issue that removes it. Only ever delete from this.
KNOWN = {
}

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHAR = re.compile(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'")
RAW = re.compile(r'b?r(#*)"')


def tokens(text):
    """Identifiers, `::` and single punctuation characters of Rust source; comments, string,
    byte-string, raw-string and char literals dropped (lifetimes are kept as `'`, harmless)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif (m := RAW.match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + m.group(1), m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
        elif c == '"' or (c == "b" and text.startswith('b"', i)):
            i = text.index('"', i) + 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "'" and (m := CHAR.match(text, i)):
            i = m.end()
        elif (m := IDENT.match(text, i)):
            out.append(m.group(0))
            i = m.end()
        elif text.startswith("::", i):
            out.append("::")
            i += 2
        else:
            out.append(c)
            i += 1
    return out


def skip_item(toks, i):
    """Index just past the item starting at toks[i]: through its `;` or its `{ … }` block,
    whichever closes first at depth 0 (`( )` and `[ ]` nesting respected)."""
    depth = 0
    while i < len(toks):
        t = toks[i]
        if t in "([":
            depth += 1
        elif t in ")]":
            depth -= 1
        elif t == ";" and depth == 0:
            return i + 1
        elif t == "{" and depth == 0:
            braces = 1
            i += 1
            while i < len(toks) and braces:
                braces += {"{": 1, "}": -1}.get(toks[i], 0)
                i += 1
            return i
        i += 1
    return i


def use_paths(toks, i):
    """The paths of the use tree starting at toks[i] (just after `use`); returns (paths, index
    past the `;`). `a::{b, c::{d, self}}` gives a::b, a::c::d, a::c; `*` and `as` end a path."""
    def tree(i, prefix):
        paths, path = [], list(prefix)
        while i < len(toks):
            t = toks[i]
            if t == "{":
                sub, i = group(i + 1, path)
                paths += sub
                path = None
                continue
            elif t == "::":
                i += 1
                continue
            elif t == "as":
                i += 2
                continue
            elif t in (",", "}", ";"):
                break
            elif t == "*":
                pass
            elif t == "self" and path and path == list(prefix):
                pass  # `{self, …}`: the prefix itself
            elif path is not None:
                path.append(t)
            i += 1
        if path is not None:
            paths.append(path)
        return paths, i

    def group(i, prefix):
        paths = []
        while i < len(toks) and toks[i] != "}":
            sub, i = tree(i, prefix)
            paths += sub
            if i < len(toks) and toks[i] == ",":
                i += 1
        return paths, i + 1

    paths, i = tree(i, [])
    while i < len(toks) and toks[i] != ";":
        i += 1
    return paths, i + 1


def is_cfg_test(toks, i):
    """toks[i:] starts with `# [ cfg ( test ) ]`."""
    return toks[i:i + 7] == ["#", "[", "cfg", "(", "test", ")", "]"]


def file_paths(toks):
    """(inline module path, path) for every crate-relative path a file names outside
    `#[cfg(test)]` items."""
    found, stack, inline, i = [], [], [], 0
    # stack: for each open brace, the inline module it opens (or None)
    while i < len(toks):
        t = toks[i]
        if t == "#" and is_cfg_test(toks, i):
            i = skip_item(toks, i + 7)
        elif t == "use":
            paths, i = use_paths(toks, i + 1)
            found += [(list(inline), p) for p in paths]
        elif t == "mod" and i + 2 < len(toks) and toks[i + 2] == "{":
            stack.append(toks[i + 1])
            inline.append(toks[i + 1])
            i += 3
        elif t == "{":
            stack.append(None)
            i += 1
        elif t == "}":
            if stack and stack.pop() is not None:
                inline.pop()
            i += 1
        elif IDENT.fullmatch(t) and toks[i + 1:i + 2] == ["::"] and (i == 0 or toks[i - 1] != "::"):
            path = [t]
            j = i + 1
            while j + 1 < len(toks) and toks[j] == "::" and IDENT.fullmatch(toks[j + 1]):
                path.append(toks[j + 1])
                j += 2
            found.append((list(inline), path))
            i = j
        else:
            i += 1
    return found


def crate_files(src):
    """{module path tuple: file} of one crate's `src/`: the root (`lib.rs`, else `main.rs`) and
    every other `.rs` under it (`a/mod.rs` and `a.rs` are module `a`). With a `lib.rs`, `main.rs`
    and `bin/` are other crates (they reach the library by its name) and are left out."""
    has_lib = os.path.exists(os.path.join(src, "lib.rs"))
    files = {}
    for dirpath, _, names in os.walk(src):
        for name in names:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            parts = rel[:-3].split(os.sep)
            if parts in (["lib"], ["main"]):
                if parts == ["main"] and has_lib:
                    continue
                parts = []
            elif has_lib and parts[0] == "bin":
                continue
            elif parts[-1] == "mod":
                parts = parts[:-1]
            files[tuple(parts)] = os.path.join(dirpath, name)
    return files


def resolve(files, module, path):
    """The module (tuple) whose file `path`, named in `module`, lands in; None when it leaves
    the crate (another crate, std, a local name)."""
    head = path[0]
    if head == "crate":
        full, rest = [], path[1:]
    elif head in ("self", "super"):
        full, rest = list(module), list(path)
        while rest and rest[0] in ("self", "super"):
            if rest.pop(0) == "super":
                if not full:
                    return None
                full.pop()
    elif tuple(module) + (head,) in files:
        full, rest = list(module), list(path)
    else:
        return None
    full += rest
    for k in range(len(full), -1, -1):
        if tuple(full[:k]) in files:
            return tuple(full[:k])
    return None


def graph(root):
    """{file: set of files it imports}, paths relative to `root`, over every crate under it."""
    edges = {}
    for crate in sorted(os.listdir(root)):
        src = os.path.join(root, crate, "src")
        if not (os.path.isfile(os.path.join(src, "lib.rs")) or os.path.isfile(os.path.join(src, "main.rs"))):
            continue
        files = crate_files(src)
        for module, path in files.items():
            with open(path, encoding="utf-8") as f:
                toks = tokens(f.read())
            me = os.path.relpath(path, root)
            out = edges.setdefault(me, set())
            for inline, p in file_paths(toks):
                target = resolve(files, module + tuple(inline), p)
                # An enclosing module's own file (`super::X` to the `mod.rs` above, `crate::X`
                # to `lib.rs`) holds this file: containment, not an import.
                if target is not None and target != module[:len(target)]:
                    other = os.path.relpath(files[target], root)
                    if other != me:
                        out.add(other)
    return edges


def circles(edges):
    """The strongly connected components of two or more files (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def check(root, known):
    """Problems (lines), and the circles found."""
    edges = graph(root)
    found = circles(edges)
    problems = []
    allowed = set().union(*known.values()) if known else set()
    in_circles = set().union(*found) if found else set()
    for comp in found:
        new = sorted(comp - allowed)
        if new:
            ties = [f"    {a} -> {b}" for a in sorted(comp) for b in sorted(edges[a] & comp)]
            problems.append(
                f"import circle through {', '.join(sorted(comp))} (not in KNOWN: {', '.join(new)}):\n"
                + "\n".join(ties))
    for issue, files in sorted(known.items()):
        for f in sorted(files - in_circles):
            problems.append(f"{f} ({issue}) is in no circle any more: delete it from KNOWN in {__file__}")
    return problems, found


def self_test():
    with tempfile.TemporaryDirectory() as d:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w", encoding="utf-8") as f:
                f.write(text)
        write("a/src/lib.rs", "pub mod checks;\npub mod state;\n")
        write("a/src/checks/mod.rs", "pub mod pods;\npub mod shm;\n")
        write("a/src/checks/pods.rs",
              "// use crate::state; (a comment)\nconst S: &str = \"crate::state::X\";\n"
              "pub fn f() { super::shm::g() }\n")
        write("a/src/checks/shm.rs", "use crate::{state::Y, checks::pods::f};\npub fn g() {}\n"
              "#[cfg(test)]\nmod tests { use crate::checks::pods::f; }\n")
        write("a/src/state.rs", "pub struct Y;\n#[cfg(test)]\nmod tests { use crate::checks::shm::g; }\n")
        write("b/src/main.rs", "mod x;\nmod y { pub use super::x::Z; }\n")
        write("b/src/x.rs", "pub struct Z;\n")
        problems, found = check(d, {})
        want = [{"a/src/checks/pods.rs", "a/src/checks/shm.rs"}]
        if found != want or len(problems) != 1:
            print(f"check-imports self-test: found {found}, want {want}; problems {problems}")
            return 1
        stale, _ = check(d, {"issue 0": {"a/src/checks/pods.rs", "a/src/checks/shm.rs", "a/src/state.rs"}})
        if len(stale) != 1 or "a/src/state.rs" not in stale[0]:
            print(f"check-imports self-test: a stale KNOWN entry not reported: {stale}")
            return 1
    print("check-imports self-test: ok")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    problems, found = check(ROOT, KNOWN)
    for p in problems:
        print(p)
    if problems:
        print(f"check-imports: {len(problems)} problem(s); see the docstring of {os.path.relpath(__file__, ROOT)}")
        return 1
    known = ", ".join(f"{len(c)} files ({', '.join(i for i, fs in KNOWN.items() if c <= fs)})" for c in found)
    print(f"check-imports: no new import circle between files; known: {known or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
