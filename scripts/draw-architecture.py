#!/usr/bin/env python3
"""Draws docs/architecture.svg: one event's path through the outbox, the relay's two threads,
and where each crash window lies. `make docs` runs it; edit the description below and run it
again rather than editing the SVG.

Python 3 standard library only. Usage: scripts/draw-architecture.py [output.svg]
"""

import sys
from pathlib import Path
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 900, 665
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"

# The description. Boxes: name -> (x, y, width, height, title, lines, fill). A title or line
# starting with "`" is drawn in a monospace font.
BOXES = {
    "app": (20, 40, 270, 96, "Application transaction",
            ["`BEGIN;", "`INSERT INTO accounts ...;", "`SELECT outbox_enqueue(topic, payload);",
             "`COMMIT;"], "#eef4ff"),
    "table": (420, 40, 250, 96, "Table outbox",
              ["ring of 16 partitions", "index of unpublished rows, by lane",
               "outbox_delayed: events not yet due"], "#eef4ff"),
    "retention": (700, 40, 180, 96, "Retention",
                  ["TRUNCATE a partition once", "all its rows are published",
                   "and older than", "`outbox.retention"], "#f4f4f4"),
    "worker": (20, 220, 650, 210, "Relay worker (background worker, one per lane range)", [],
               "#fbfbf2"),
    "main": (40, 262, 280, 150, "Main thread: PostgreSQL",
             ["claim: ... FOR UPDATE SKIP LOCKED", "hand each chunk to the Redis thread",
              "mark published_at while Redis works", "COMMIT once Redis answered all,",
              "ROLLBACK if Redis was unreachable"], "#ffffff"),
    "redis_thread": (370, 262, 280, 150, "Redis thread: outbox-redis",
                     ["`publish.rs: owns the connection", "pipelined XADD per chunk",
                      "dedupe: IDMP or markers script", "optional WAIT n replicas",
                      "deletes markers once commit is on disk"], "#ffffff"),
    "redis": (705, 262, 175, 150, "Redis",
              ["stream", "`<prefix><topic>", "one entry per event:", "`id topic payload",
               "`created_at [key headers]"], "#fff1ee"),
    "consumer": (700, 500, 180, 112, "Consumer",
                 ["`crates/outbox-consumer", "XREADGROUP", "apply + inbox row in one",
                  "PG transaction, then XACK"], "#eefaee"),
}

# Arrows: from (x, y), to (x, y), label lines, where the label starts (x, y), its anchor,
# dashed or not.
ARROWS = [
    ((290, 88), (420, 88), ["1 enqueue"], (355, 80), "middle", False),
    ((290, 112), (420, 112), [], None, "middle", False),
    ((670, 88), (700, 88), ["6"], (685, 80), "middle", False),
    ((120, 136), (120, 262), ["2 commit sets", "the relay's latch"], (128, 182), "start", True),
    ((470, 136), (250, 262), ["3 claim"], (338, 180), "end", False),
    ((290, 262), (520, 136), ["5 mark, commit"], (430, 204), "start", False),
    ((320, 320), (370, 320), ["chunk"], (345, 312), "middle", False),
    ((370, 360), (320, 360), ["reply"], (345, 378), "middle", False),
    ((650, 336), (705, 336), ["4 XADD"], (677, 328), "middle", False),
    ((792, 412), (792, 500), ["7 read"], (800, 460), "start", False),
]

# Channel note under the two threads.
NOTES = [
    ((345, 426), "crossbeam channel", "middle", 11),
]

# Crash windows: letter, position, and the legend's line.
CRASHES = [
    ("A", (205, 150), "Crash before the enqueue commits: the event never existed, as the business row."),
    ("B", (345, 340), "Relay crash between publish and mark: the batch is claimed and published again;"
                      " IDMP or the markers absorb it."),
    ("C", (550, 199), "Server crash loses the relay's non-durable commits: markers stay until the commit is"
                      " on disk; IDMP's window covers the flush bound."),
    ("D", (677, 356), "Redis unreachable: nothing is marked, no event is charged; events wait in the table."),
    ("E", (860, 262), "Redis failover: unreplicated entries can be lost; outbox.redis_wait_replicas marks"
                      " only what n replicas have."),
    ("F", (860, 500), "Consumer crash: its inbox row and its effect commit together; redelivered entries"
                      " are skipped."),
]


def text(x, y, s, size=12, anchor="start", weight="normal", color="#1a1a1a", family=FONT):
    if s.startswith("`"):
        s, family = s[1:], MONO
        size -= 1
    return (f'<text x="{x}" y="{y}" font-family="{family}" font-size="{size}" '
            f'font-weight="{weight}" fill="{color}" text-anchor="{anchor}">{escape(s)}</text>')


def box(x, y, w, h, title, lines, fill):
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" fill="{fill}" '
           f'stroke="#44546a" stroke-width="1.2"/>',
           text(x + 10, y + 18, title, 13, weight="bold")]
    for i, line in enumerate(lines):
        out.append(text(x + 10, y + 38 + 17 * i, line, 12))
    return out


def arrow(a, b, dashed):
    dash = ' stroke-dasharray="5,4"' if dashed else ""
    return [f'<line x1="{a[0]}" y1="{a[1]}" x2="{b[0]}" y2="{b[1]}" stroke="#2f3b52" '
            f'stroke-width="1.6" marker-end="url(#head)"{dash}/>']


def crash(letter, pos):
    x, y = pos
    return [f'<circle cx="{x}" cy="{y}" r="10" fill="#c62828"/>',
            text(x, y + 4, letter, 12, "middle", "bold", "#ffffff")]


def draw():
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}">',
           '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" '
           'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
           'fill="#2f3b52"/></marker></defs>',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
           text(20, 24, "outbox: an event's path, the relay's threads, and the crash windows", 15,
                weight="bold")]
    # The worker first: the threads are drawn inside it.
    for name in ["worker", "app", "table", "retention", "main", "redis_thread", "redis",
                 "consumer"]:
        out += box(*BOXES[name])
    for a, b, labels, where, anchor, dashed in ARROWS:
        out += arrow(a, b, dashed)
        for i, label in enumerate(labels):
            out.append(text(where[0], where[1] + 15 * i, label, 12, anchor, "bold", "#2f3b52"))
    for (x, y), s, anchor, size in NOTES:
        out.append(text(x, y, s, size, anchor, color="#555555"))
    for letter, pos, _ in CRASHES:
        out += crash(letter, pos)
    y = 520
    out.append(text(20, y - 22, "Crash windows, and why each is safe", 13, weight="bold"))
    for letter, _, line in CRASHES:
        out += crash(letter, (30, y - 4))
        out += wrap(48, y, line, 640 - 48, 11)
        y += 30 if len(line) * 6 > 640 - 48 else 20
    out.append("</svg>")
    return "\n".join(out) + "\n"


def wrap(x, y, s, width, size):
    """The legend's line, broken once if it would cross into the consumer's box."""
    limit = int(width / (size * 0.56))
    if len(s) <= limit:
        return [text(x, y, s, size)]
    cut = s.rfind(" ", 0, limit)
    return [text(x, y, s[:cut], size), text(x, y + 14, s[cut + 1:], size)]


def main():
    root = Path(__file__).resolve().parent.parent
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "docs" / "architecture.svg"
    target.write_text(draw(), encoding="utf-8")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
