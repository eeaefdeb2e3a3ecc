"""The exceptions rallypoint raises on purpose.

Each carries one sentence meant for a person: the CLI prints ``str(error)`` and exits
non-zero, never a traceback. ``UsageError`` marks a mistake in what the user asked for
(exit code 2, like argparse and click); everything else is a runtime failure (exit code 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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

    def __init__(
        self,
        kind: str,
        name: str,
        valid: Iterable[str],
        *,
        flag: str = "",
        broken: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        choices = ", ".join(self.valid) if self.valid else "(none installed)"
        prefix = f"{flag} {name!r}" if flag else repr(name)
        # A broken plugin registers nothing: the name may be one of its, which the user
        # would otherwise take for a typo of their own.
        hint = broken_hint(broken or {})
        super().__init__(f"{prefix}: unknown {kind}. Choose one of: {choices}.{hint}")


def broken_hint(broken: Mapping[str, str]) -> str:
    """`` Installed but broken, ...``: the plugins that registered nothing, and why."""
    if not broken:
        return ""
    listed = "; ".join(f"{name} ({why})" for name, why in sorted(broken.items()))
    return (
        f" Installed but broken, so none of their names can be chosen: {listed}; "
        "see rallypoint plugins."
    )


class PluginConflictError(RallypointError):
    """Two plugins registered the same name for one extension point."""
