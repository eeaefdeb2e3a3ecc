"""Generate the event tables of docs/user-guide.md and docs/checkpointing.md from the
events' declarations, ``rallypoint.events.EVENTS``, so that they cannot drift from the code.

Usage:
    python docs/gen_event_tables.py           rewrite the tables
    python docs/gen_event_tables.py --check   exit 1 if a table is out of date

Each table lies between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` in its page; the
text around it is written by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rallypoint import events

DOCS = Path(__file__).resolve().parent
#: Where the user guide says more of an event (its own anchors, or another page).
SEE = {
    events.WORKER_FAILED: "[When a worker fails](#when-a-worker-fails)",
    events.HANG_DETECTED: "[Hangs](#hangs)",
    events.CHECKPOINT_SAVED: "[Checkpointing](checkpointing.md#metrics)",
    events.PEER_REFUSED: "[Security](security.md)",
    events.PROGRESS: "[Hangs](#hangs)",
    events.STRAGGLER: "[Stragglers](#stragglers)",
}
CHECKPOINT_EVENTS = (events.CHECKPOINT_SAVED, events.CHECKPOINT_LOADED, events.CHECKPOINT_PERSISTED)


def fields(spec: events.EventSpec) -> str:
    return ", ".join(
        f"`{name}` ({meaning})" if meaning else f"`{name}`" for name, meaning in spec.fields.items()
    )


def user_guide_table() -> list[str]:
    rows = ["| event | when | its fields | lifecycle hook |", "|---|---|---|---|"]
    for spec in events.EVENTS:
        when = spec.when + (f" ({SEE[spec.name]})" if spec.name in SEE else "")
        hook = f"`{spec.hook}`" if spec.hook else "none"
        rows.append(f"| `{spec.name}` | {when} | {fields(spec)} | {hook} |")
    return rows


def checkpoint_table() -> list[str]:
    rows = ["| event | when | fields |", "|---|---|---|"]
    for spec in events.EVENTS:
        if spec.name in CHECKPOINT_EVENTS:
            rows.append(f"| `{spec.name}` | {spec.when} | {fields(spec)} |")
    return rows


TABLES = {
    DOCS / "user-guide.md": {"event-table": user_guide_table},
    DOCS / "checkpointing.md": {"checkpoint-events": checkpoint_table},
}


def render(page: Path) -> str:
    """``page`` with its generated tables as they are today."""
    text = page.read_text(encoding="utf-8")
    for block, table in TABLES[page].items():
        begin, end = f"<!-- begin {block} -->", f"<!-- end {block} -->"
        head, found, rest = text.partition(begin)
        if not found or end not in rest:
            raise SystemExit(f"{page.name}: no block {begin} ... {end}")
        text = "\n".join([head + begin, "", *table(), "", end + rest.partition(end)[2]])
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is out of date")
    args = parser.parse_args()
    stale = []
    for page in TABLES:
        text = render(page)
        if text != page.read_text(encoding="utf-8"):
            stale.append(page.name)
            if not args.check:
                page.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python docs/gen_event_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
