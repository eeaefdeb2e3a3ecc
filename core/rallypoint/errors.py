"""The exceptions rallypoint raises on purpose.

Each carries one sentence meant for a person: the CLI prints ``str(error)`` and exits
non-zero, never a traceback. ``UsageError`` marks a mistake in what the user asked for
(exit code 2, like argparse and click); everything else is a runtime failure (exit code 1).
"""

from __future__ import annotations

from collections.abc import Iterable


def one_line(error: BaseException | str) -> str:
    """An error as one line: ``Type: message``, a multi-line message joined with ``; ``."""
    if isinstance(error, str):
        return error
    detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


class RallypointError(Exception):
    """Base class: a failure with a message fit to show a user as it is."""

    exit_code = 1


class UsageError(RallypointError):
    """The user asked for something invalid: a bad flag value, name or file."""

    exit_code = 2


class UnknownNameError(UsageError):
    """A name given for an extension point that no installed plugin registers."""

    def __init__(self, kind: str, name: str, valid: Iterable[str], *, flag: str = "") -> None:
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        choices = ", ".join(self.valid) if self.valid else "(none installed)"
        prefix = f"{flag} {name!r}" if flag else repr(name)
        super().__init__(f"{prefix}: unknown {kind}. Choose one of: {choices}.")


class PluginConflictError(RallypointError):
    """Two plugins registered the same name for one extension point."""
