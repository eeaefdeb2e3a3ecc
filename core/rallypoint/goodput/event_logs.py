"""Reading the agents' event logs (``rallypoint run --event-log``): files or directories of
them, a line that is not an event (cut short when its agent was killed) skipped and counted."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rallypoint.errors import UsageError
from rallypoint.goodput.account import Account
from rallypoint.goodput.accountant import account
from rallypoint.goodput.fields import is_event


def read(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], int]:
    """The events of the logs at ``paths`` (files, or directories of ``*.jsonl``), and how
    many lines were not events (a line cut short when an agent was killed, say).

    Raises:
        UsageError: a path that does not exist, or holds no event at all, in one sentence.
    """
    records: list[dict[str, Any]] = []
    skipped = 0
    for path in _files(paths):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise UsageError(f"cannot read {path}: {error.strerror or error}") from None
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                skipped += bool(line.strip())
                continue
            if isinstance(record, dict) and is_event(record):
                records.append(record)
            else:
                skipped += 1
    if not records:
        raise UsageError(
            f"{', '.join(map(str, paths))}: no rallypoint event in it "
            "(write one with rallypoint run --event-log FILE)"
        )
    return records, skipped


def _files(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise UsageError(f"{path} holds no event log (*.jsonl)")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such event log")
    return files


def load(paths: Sequence[str | Path]) -> Account:
    """The account of the logs at ``paths``, the lines skipped in it (see ``read``)."""
    records, skipped = read(paths)
    result = account(records)
    result.skipped_lines = skipped
    return result
