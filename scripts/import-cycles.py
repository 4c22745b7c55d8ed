#!/usr/bin/env python3
"""Import circles between the files of a Rust crate's src/.

Builds the file-level graph of who uses whom, from `use crate::...`, `use super::...` and
`use child::...` statements (braces expanded), from paths written in place (`crate::a::f()`,
`super::x::Y`, and in a module file `child::f()`), and from inherent `impl Type` blocks written
in a file other than the type's own (the type's methods then live there: whoever uses the type
uses that file). `pub use` re-exports are followed to the file that defines the item. Comments
and string literals are ignored; inline `mod tests { ... }` blocks count as part of their file.

Prints every circle (each strongly connected set of files, with the edges inside it and where
each comes from). For the extension's src/ it then checks the folders: each top-level folder (and
root file) sits on a layer of LAYERS, and a file may import only from its own folder or from a
folder on a lower layer; every import that runs up or sideways is printed with where it comes
from. Exits 1 if there is a circle or such an import, 0 if none.

Usage: scripts/import-cycles.py [SRC_DIR]   (default: src)
"""

import os
import re
import sys

# The extension's folders, top layer first, as src/lib.rs describes them: a folder imports only
# from layers below its own (folders on one layer do not import each other).
LAYERS = [
    ["lib"],
    ["hooks", "status"],
    ["relay", "write"],
    ["retention"],
    ["shmem"],
    ["gucs"],
    ["pg"],
    ["model"],
]


def strip(text):
    """`text` with comments and string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif re.match(r'(b|c)?r#*"', text[i:i + 12]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'(b|c)?r(#*)"', text[i:])
            end = '"' + m.group(2)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)


def expand_use(tree):
    """`a::{b, c::{d, self}}` as [['a','b'], ['a','c','d'], ['a','c']]."""
    tree = re.sub(r"\s+", "", tree)
    tree = re.sub(r"\bas\w+", "", tree.replace("as", " as ")) if " as " in tree else tree

    def parse(s):
        if "{" not in s:
            return [[p for p in s.split("::") if p]]
        head, rest = s.split("{", 1)
        assert rest.endswith("}"), s
        inner, parts, depth, cur = rest[:-1], [], 0, ""
        for ch in inner:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        prefix = [p for p in head.split("::") if p]
        paths = []
        for part in parts:
            if not part:
                continue
            for sub in parse(part):
                paths.append(prefix + [seg for seg in sub if seg != "self"] if sub != ["self"] else prefix)
        return paths

    return parse(tree)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "src"
    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                files[module_of(src, path)] = path
    texts = {m: strip(open(p, encoding="utf-8").read()) for m, p in files.items()}
    children = {m: set(re.findall(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?mod\s+(\w+)\s*;", t, re.M)) for m, t in texts.items()}

    def inline_mods(text):
        """Spans of inline `mod name { ... }` blocks."""
        spans = []
        for m in re.finditer(r"\bmod\s+(\w+)\s*\{", text):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += text[j] == "{"
                depth -= text[j] == "}"
                j += 1
            spans.append((m.start(), j, m.group(1)))
        return spans

    def resolve(base, segs, mod):
        """Absolute module path of `segs` written in module `base` of file module `mod`."""
        segs = list(segs)
        if not segs:
            return None
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] in ("super", "self"):
            cur = list(base)
            while segs and segs[0] in ("super", "self"):
                if segs.pop(0) == "super":
                    if not cur:
                        return None
                    cur.pop()
            return cur + segs
        if tuple(base) == mod and segs[0] in children.get(mod, ()):
            return list(mod) + segs
        return None

    reexports = {}
    for mod, text in texts.items():
        for m in re.finditer(r"\bpub(?:\([\w:]+\))?\s+use\s+([^;]+);", text):
            for path in expand_use(m.group(1)):
                target = resolve(mod, path, mod)
                if target:
                    reexports[(mod, path[-1])] = target

    def file_of(absolute, seen=0):
        for k in range(len(absolute), -1, -1):
            prefix = tuple(absolute[:k])
            if prefix in files:
                rest = absolute[k:]
                if rest and (prefix, rest[0]) in reexports and seen < 8:
                    return file_of(reexports[(prefix, rest[0])] + rest[1:], seen + 1)
                return prefix
        return None

    defined = {}
    for mod, text in texts.items():
        for name in re.findall(r"\b(?:struct|enum|union|trait|type)\s+(\w+)", text):
            defined.setdefault(name, set()).add(mod)

    edges = {}

    def add(a, b, why):
        if a != b and a is not None and b is not None:
            edges.setdefault((a, b), []).append(why)

    for mod, text in texts.items():
        spans = inline_mods(text)

        def base_at(pos):
            inner = [s for s in spans if s[0] <= pos < s[1]]
            return list(mod) + [s[2] for s in sorted(inner)]

        def line(pos):
            return text.count("\n", 0, pos) + 1

        where = files[mod]
        used = set()
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            for path in expand_use(m.group(1)):
                target = resolve(base_at(m.start()), path, mod)
                if target is not None:
                    add(mod, file_of(target), f"{where}:{line(m.start())} use {'::'.join(path)}")
                    used.add(path[-1])
        heads = {"crate", "super"} | children.get(mod, set())
        for m in re.finditer(r"(?<![\w:])(\w+)((?:::\w+)+)", text):
            if m.group(1) not in heads:
                continue
            if re.search(r"\buse\s+[^;]*$", text[max(0, m.start() - 300):m.start()]):
                continue
            path = [m.group(1)] + m.group(2).split("::")[1:]
            target = resolve(base_at(m.start()), path, mod)
            if target is not None:
                add(mod, file_of(target), f"{where}:{line(m.start())} {'::'.join(path)}")
        for m in re.finditer(r"\bimpl\s*(?:<[^>{]*>)?\s*([\w:]+)\s*(?:<[^{]*>)?\s*\{", text):
            name = m.group(1).split("::")[-1]
            if mod in defined.get(name, ()):
                continue
            owners = [o for o in defined.get(name, ()) if (mod, o) in edges]
            for owner in owners:
                add(owner, mod, f"{where}:{line(m.start())} impl {name} (defined in {files[owner]})")

    graph = {m: sorted(b for (a, b) in edges if a == m) for m in files}
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(files):
        if v not in index:
            visit(v)

    print(f"{len(files)} files, {len(edges)} file-to-file edges")
    wrong = folder_order(files, edges) if is_extension(src) else 0
    if not sccs:
        print("no import circles")
        return 1 if wrong else 0
    for scc in sccs:
        print("circle: " + ", ".join(files[m] for m in scc))
        for (a, b), whys in sorted(edges.items()):
            if a in scc and b in scc:
                print(f"  {files[a]} -> {files[b]}")
                for why in sorted(set(whys))[:3]:
                    print(f"      {why}")
    return 1


def is_extension(src):
    """Whether `src` is the extension's own src/ (the crates' have no folders to order)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.abspath(src) == os.path.join(os.path.dirname(here), "src")


def folder_order(files, edges):
    """Prints the imports between top-level folders that do not run down LAYERS; their count."""
    layer = {name: depth for depth, names in enumerate(LAYERS) for name in names}
    wrong = 0
    folders = sorted({(m[0] if m else "lib") for m in files})
    for folder in folders:
        if folder not in layer:
            print(f"folder {folder} is on no layer of LAYERS in {os.path.basename(__file__)}")
            wrong += 1
    for (a, b), whys in sorted(edges.items()):
        fa, fb = (a[0] if a else "lib"), (b[0] if b else "lib")
        if fa == fb or fa not in layer or fb not in layer or layer[fa] < layer[fb]:
            continue
        wrong += 1
        print(f"import up or sideways: {files[a]} -> {files[b]} ({fa} -> {fb})")
        for why in sorted(set(whys))[:3]:
            print(f"      {why}")
    if not wrong:
        print("folders import only downward: " + " > ".join("/".join(names) for names in LAYERS))
    return wrong


if __name__ == "__main__":
    sys.exit(main())
