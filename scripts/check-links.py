#!/usr/bin/env python3
"""Checks that every relative link in the project's Markdown resolves: the file it names exists,
and its `#anchor`, if any, is a heading of that file (slugged as GitHub does: lowercase,
punctuation other than '-' and '_' removed, each space a '-', repeats numbered -1, -2 ...).
Links with a scheme (https:, mailto:) are not followed.

Checks README.md, BENCHMARKS.md, docs/*.md, crates/*/README.md and examples/' READMEs, or the
files named on the command line. Prints each broken link and exits 1 if there is any. Python 3
standard library only; `make lint` and scripts/test.sh run it.
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def default_files():
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted(ROOT.glob("crates/*/README.md"))
    files += [ROOT / "examples" / "README.md"] + sorted(ROOT.glob("examples/*/README.md"))
    return [f for f in files if f.exists()]


def outside_code(path):
    """The file's lines with their numbers, fenced code blocks left out."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_text(raw):
    """What a heading shows: links by their text, code spans by their content, emphasis bare."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    return re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)


def slug(text):
    text = heading_text(text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchors = {}


def anchors(path):
    if path not in _anchors:
        found, seen = set(), {}
        for _, line in outside_code(path):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            found.update(HTML_ANCHOR.findall(line))
        _anchors[path] = found
    return _anchors[path]


def links(path):
    for number, line in outside_code(path):
        m = REFERENCE.match(line)
        if m:
            yield number, m.group(1)
            continue
        for m in INLINE_LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, m.group(1)


def shown(path):
    return os.path.relpath(path, ROOT)


def check(path):
    broken = []
    for number, target in links(path):
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{shown(path)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading with that anchor in {shown(dest)}")
    return broken


def main():
    files = [Path(a).resolve() for a in sys.argv[1:]] or default_files()
    broken, count = [], 0
    for path in files:
        count += sum(1 for _ in links(path))
        broken += check(path)
    if broken:
        print(f"{len(broken)} broken link(s):")
        print("\n".join(f"  {b}" for b in broken))
        return 1
    print(f"{count} links in {len(files)} files: every relative link and anchor resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
