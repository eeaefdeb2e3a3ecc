"""``rallypoint.record``: report a worker's uncaught exception to the agent.

The equivalent of torch's ``torch.distributed.elastic.multiprocessing.errors.record``,
without importing torch: on an uncaught exception the traceback is written to the file
named by ``TORCHELASTIC_ERROR_FILE`` in torch's format, and the agent's failure summary
shows it as the root cause. Functions decorated with torch's own ``@record`` are reported
the same way.

    from rallypoint import record

    @record
    def main():
        ...
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from rallypoint.worker import variables

P = ParamSpec("P")
R = TypeVar("R")


def error_record(error: BaseException) -> dict[str, Any]:
    """``error`` and its traceback as torch's error file holds them."""
    return {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(error), error, error.__traceback__)
                ),
                "timestamp": str(int(time.time())),
            },
        }
    }


def write_error_file(error: BaseException, path: str | None = None) -> None:
    """Write ``error`` and its traceback to the error file, in torch's JSON format."""
    target = path or os.environ.get(variables.ERROR_FILE)
    if not target:
        return
    with open(target, "w", encoding="utf-8") as handle:
        json.dump(error_record(error), handle)


def record(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate a worker's entry point so its uncaught exception reaches the failure summary."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except Exception as error:  # as torch's @record: not SystemExit or KeyboardInterrupt
            write_error_file(error)
            raise

    return wrapper
