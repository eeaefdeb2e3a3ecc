"""Reading an event's fields: the logs are read as they are, so a field that is not a
finite number counts as absent rather than failing the account."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def number(value: object) -> bool:
    """Whether ``value`` is a finite number (a bool is not one)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def get(data: Mapping[str, Any], key: str) -> float | None:
    """``data[key]`` when it is a finite number, else None."""
    value: Any = data.get(key)
    return float(value) if number(value) else None


def integer(value: Any) -> int:
    return int(value) if number(value) else 0


def real(value: Any) -> float:
    return float(value) if number(value) else math.nan


def is_event(record: Mapping[str, Any]) -> bool:
    """Whether an event log's ``record`` is a rallypoint event: a name, a node, a time."""
    return (
        isinstance(record.get("event"), str)
        and isinstance(record.get("node"), str)
        and number(record.get("wall_time"))
    )
