"""Whether the kernel's out-of-memory killer killed a worker.

An OOM-killed worker dies of SIGKILL like one killed by hand; the kernel says which. Two
sources, the first that can be read: the kernel log (``/dev/kmsg``), whose OOM records name
the pid killed (``Killed process 1234 (python)``, ``oom-kill:...,pid=1234``); else the
``oom_kill`` count of this process's memory cgroup (cgroup v2 ``memory.events``, v1
``memory.oom_control``), which the workers share with the agent: a count that rose since
the workers started means the SIGKILLs were the OOM killer's, though not which pid.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path

_KILLED = re.compile(r"(?:Killed process |oom-kill:.*\bpid=)(\d+)")
#: The kernel log's records are read from the oldest still kept; a bound on the reads.
_MAX_RECORDS = 100_000


def killed_pids(pids: Collection[int], kmsg: str = "/dev/kmsg") -> set[int] | None:
    """Those of ``pids`` the kernel log says the OOM killer killed; None when the log
    cannot be read (not Linux, no permission: ``kernel.dmesg_restrict``)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    wanted = {str(pid) for pid in pids}
    found: set[int] = set()
    try:
        for _ in range(_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)  # one record a read
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten while reading: go on
                continue
            if not record:
                break
            text = record.decode("utf-8", "replace")
            for match in _KILLED.finditer(text):
                if match.group(1) in wanted:
                    found.add(int(match.group(1)))
    except OSError:
        return None
    finally:
        os.close(fd)
    return found


def cgroup_kills() -> int | None:
    """The OOM kills counted in this process's memory cgroup; None when not found."""
    path = counter_file()
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def counter_file() -> Path | None:
    """The file with this process's memory cgroup's ``oom_kill`` count."""
    try:
        cgroups = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in mounts:
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup2":
            v2 = fields[1]
        elif len(fields) >= 4 and fields[2] == "cgroup" and "memory" in fields[3].split(","):
            v1 = fields[1]
    for line in cgroups:
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if v1 and "memory" in controllers.split(","):
            return Path(v1 + relative) / "memory.oom_control"
        if v2 and hierarchy == "0" and not controllers:
            candidate = Path(v2 + relative) / "memory.events"
            if candidate.exists():
                return candidate
    return None


def oom_killed(pids: Collection[int], kills_before: int | None) -> set[int]:
    """Those of ``pids`` (workers that died of SIGKILL) the OOM killer killed, given the
    cgroup's count when they started: as the kernel log says, where it can be read; else
    all of them when the cgroup counted a kill since."""
    if not pids:
        return set()
    found = killed_pids(pids)
    if found is not None:
        return found
    after = cgroup_kills()
    if kills_before is not None and after is not None and after > kills_before:
        return set(pids)
    return set()
