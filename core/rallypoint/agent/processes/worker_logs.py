"""Where each worker's output goes, attempt by attempt.

rallypoint's own layout is torchrun's default (``DefaultLogsSpecs``): per attempt and local
rank, ``stdout.log`` and ``stderr.log`` for the streams ``--redirects`` or ``--tee`` name,
``error.json`` for the error file, and the attempt's ``filtered_stdout.log`` and
``filtered_stderr.log`` for ``--duplicate-*-filters``. ``--logs-specs NAME`` hands the
choice to a torchrun ``LogsSpecs`` class of the ``torchrun.logs_specs`` entry-point group,
exactly as torchrun does; its class needs torch, which the agent imports only then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from rallypoint.config import LOGS_SPECS_GROUP
from rallypoint.errors import UsageError

STDOUT, STDERR = 1, 2


@dataclass(frozen=True)
class WorkerLogs:
    """One worker's output.

    Attributes:
        console: the streams shown on the console, prefixed: bit 1 stdout, bit 2 stderr.
        stdout, stderr: the file each stream is copied to, if any.
        error_file: the worker's ``TORCHELASTIC_ERROR_FILE``.
        teed: the streams both shown and copied to a file: those whose lines matching a
            ``--duplicate-*-filters`` string also go to the attempt's filtered file, as in
            torchrun.
    """

    console: int
    stdout: Path | None
    stderr: Path | None
    error_file: str
    teed: int = 0

    def file(self, stream: int) -> Path | None:
        return self.stdout if stream == STDOUT else self.stderr


@dataclass(frozen=True)
class AttemptLogs:
    """Every worker's output for one attempt, and the duplicated lines' files."""

    workers: tuple[WorkerLogs, ...]
    #: stream -> (the filtered file, the strings a line must contain one of)
    filtered: Mapping[int, tuple[Path, tuple[str, ...]]] = field(default_factory=dict)


def default_logs(
    attempt_dir: Path,
    nproc: int,
    redirects: Mapping[int, int],
    tee: Mapping[int, int],
    shown: frozenset[int] | None,
    filters: Mapping[int, tuple[str, ...]],
) -> AttemptLogs:
    """rallypoint's (and torchrun's default) layout under ``attempt_dir``: redirected
    streams leave the console, teed ones stay (tee wins where both name a stream)."""
    workers = []
    for local_rank in range(nproc):
        redirect = redirects.get(local_rank, redirects.get(-1, 0))
        copy = tee.get(local_rank, tee.get(-1, 0))
        visible = shown is None or local_rank in shown
        console = ((STDOUT | STDERR) & ~redirect | copy) if visible else 0
        files = redirect | copy
        directory = attempt_dir / str(local_rank)
        workers.append(
            WorkerLogs(
                console=console,
                stdout=directory / "stdout.log" if files & STDOUT else None,
                stderr=directory / "stderr.log" if files & STDERR else None,
                error_file=str(directory / "error.json"),
                teed=console & files,
            )
        )
    return AttemptLogs(tuple(workers), _filtered(attempt_dir, filters))


def _filtered(
    attempt_dir: Path, filters: Mapping[int, tuple[str, ...]], paths: Mapping[int, str] = {}
) -> dict[int, tuple[Path, tuple[str, ...]]]:
    names = {STDOUT: "filtered_stdout.log", STDERR: "filtered_stderr.log"}
    return {
        stream: (Path(paths.get(stream) or attempt_dir / names[stream]), needles)
        for stream, needles in filters.items()
        if needles
    }


class TorchLogsSpecs:
    """A torchrun ``LogsSpecs`` class chosen with ``--logs-specs``, made once per run with
    torchrun's arguments and asked for each attempt's destinations (``reify``)."""

    def __init__(
        self,
        name: str,
        log_dir: str | None,
        redirects: Mapping[int, int],
        tee: Mapping[int, int],
        shown: frozenset[int] | None,
    ) -> None:
        from torch.distributed.elastic.multiprocessing.api import Std

        (entry,) = metadata.entry_points(group=LOGS_SPECS_GROUP, name=name)
        cls = entry.load()

        def std(spec: Mapping[int, int]) -> Any:
            if set(spec) <= {-1}:
                return Std(spec.get(-1, 0))
            return {rank: Std(value) for rank, value in spec.items() if rank >= 0}

        try:
            self.specs = cls(
                log_dir=log_dir,
                redirects=std(redirects),
                tee=std(tee),
                local_ranks_filter=set(shown) if shown is not None else None,
            )
        except Exception as error:
            raise UsageError(
                f"--logs-specs {name!r}: {cls.__qualname__} could not be made: "
                f"{type(error).__name__}: {error}"
            ) from None
        self.name = name

    def attempt(
        self, environments: Sequence[dict[str, str]], filters: Mapping[int, tuple[str, ...]]
    ) -> AttemptLogs:
        """The destinations the class gives for these workers (their environments, which
        ``reify`` may change, as under torchrun)."""
        envs = dict(enumerate(environments))
        dest = self.specs.reify(envs)
        workers = []
        for local_rank, env in envs.items():
            error_file = dest.error_files.get(local_rank) or env["TORCHELASTIC_ERROR_FILE"]
            console = files = 0
            paths: dict[int, Path | None] = {}
            for stream, where, teed in (
                (STDOUT, dest.stdouts, dest.tee_stdouts),
                (STDERR, dest.stderrs, dest.tee_stderrs),
            ):
                path = where.get(local_rank, "")
                paths[stream] = None
                if not path:  # torchrun's "the console"
                    console |= stream
                elif path != os.devnull:
                    paths[stream] = Path(path)
                    files |= stream
                    if local_rank in teed:
                        console |= stream
            workers.append(
                WorkerLogs(console, paths[STDOUT], paths[STDERR], error_file, console & files)
            )
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        attempt_dir = Path(next((w.error_file for w in workers), ".")).parent.parent
        # torch before 2.9 has no duplicate filters: its LogsDest names no filtered files.
        given = {
            STDOUT: getattr(dest, "filtered_stdout", ""),
            STDERR: getattr(dest, "filtered_stderr", ""),
        }
        return AttemptLogs(tuple(workers), _filtered(attempt_dir, filters, given))
