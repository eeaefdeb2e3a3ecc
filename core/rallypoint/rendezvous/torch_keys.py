"""torch's ``--rdzv-conf`` keys, taken as a torchrun user writes them.

torchrun 2.13's rendezvous backends read the keys of ``TORCH_KEYS``. A key a backend
declares under the same name is its own option (``join_timeout``, ``read_timeout``...);
one it takes under another name is renamed (``timeout`` is ``join_timeout``, the etcd
plugin's ``etcd_prefix`` is ``prefix``: ``RendezvousBackend.torch_keys``); torch's
keep-alive pair becomes ``heartbeat_timeout``; the rest are accepted, and reported once as
having no effect, with the reason. A key torch does not know stays an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rallypoint.errors import UsageError

#: Every key torch 2.13's rendezvous backends read, and what it does there.
TORCH_KEYS: Mapping[str, str] = {
    "join_timeout": "seconds for the rendezvous to complete",
    "last_call_timeout": "seconds to wait for more nodes once MIN have joined",
    "close_timeout": "seconds for a closed rendezvous to finish",
    "heartbeat_timeout": "seconds a keep-alive heartbeat may take",
    "keep_alive_interval": "seconds between a node's heartbeats",
    "keep_alive_max_attempt": "heartbeats missed before a node counts as dead",
    "timeout": "the rendezvous timeout of the etcd and static backends",
    "read_timeout": "seconds a store read may take",
    "is_host": "whether this node hosts the c10d store",
    "store_type": "tcp (a TCPStore) or file (a FileStore) for c10d",
    "rank": "the static backend's node rank",
    "etcd_prefix": "the etcd key prefix",
    "protocol": "http or https, to reach etcd",
    "cacert": "the CA certificate for etcd over https",
    "cert": "the client certificate for etcd over https",
    "key": "the client key for etcd over https",
    "ca_cert": "the CA certificate for etcd over https (etcd-v2)",
    "ssl_cert": "the client certificate for etcd over https (etcd-v2)",
    "ssl_cert_key": "the client key for etcd over https (etcd-v2)",
}

#: Renamed for every backend on rallypoint's protocol: torch's key -> rallypoint's option.
COMMON_ALIASES: Mapping[str, str] = {"timeout": "join_timeout"}

#: Why a torch key has no effect, when the backend has no option for it.
_NO_EFFECT: Mapping[str, str] = {
    "rank": "the node rank comes from --node-rank, as torchrun sets it",
    "is_host": "this backend's store is a server of its own",
    "read_timeout": "this backend bounds its requests with its own timeouts",
    "store_type": "this backend's store is a server of its own",
}

#: torch's defaults for the keep-alive pair: a node is dead after 3 missed beats of 5 s.
_KEEP_ALIVE = {"keep_alive_interval": 5.0, "keep_alive_max_attempt": 3.0}


def translate(
    text: str, declared: set[str], aliases: Mapping[str, str], backend: str
) -> tuple[str, tuple[str, ...]]:
    """``--rdzv-conf`` ``text`` in the keys a backend ``declared``; and one note per torch
    key that has no effect with it.

    ``aliases`` are the backend's own renamings of torch keys (its ``torch_keys``). Pairs
    that are not ``KEY=VALUE``, and keys that are neither declared nor torch's, are left
    as they are, for the options parser to refuse with its usual sentence.
    """
    renames = {**COMMON_ALIASES, **aliases}
    pairs: list[tuple[str, str]] = []
    notes: list[str] = []
    keep_alive: dict[str, str] = {}
    renamed: dict[str, str] = {}  # option -> the torch key it was given as
    for item in (part.strip() for part in text.split(",")):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key in declared or key not in TORCH_KEYS:
            pairs.append((key, item))
        elif key in _KEEP_ALIVE and "heartbeat_timeout" in declared:
            keep_alive[key] = raw
        elif renames.get(key) in declared:
            pairs.append((renames[key], f"{renames[key]}={raw}"))
            renamed[renames[key]] = key
        else:
            why = _NO_EFFECT.get(key, f"rallypoint's {backend} backend has no such setting")
            notes.append(
                f"--rdzv-conf {key}: torch's key for {TORCH_KEYS[key]}; it has no effect "
                f"with --rdzv-backend {backend} ({why})."
            )
    given = [key for key, _ in pairs]
    if keep_alive:
        if "heartbeat_timeout" in given:
            notes.append(
                f"--rdzv-conf {', '.join(sorted(keep_alive))}: torch's keep-alive settings; "
                "heartbeat_timeout, given too, decides when a node counts as dead."
            )
        else:
            seconds = _keep_alive_seconds(keep_alive)
            pairs.append(("heartbeat_timeout", f"heartbeat_timeout={seconds:g}"))
    for option, torch_key in renamed.items():
        if given.count(option) > 1:
            raise UsageError(f"--rdzv-conf: give {option} or {torch_key}, not both.")
    return ",".join(item for _, item in pairs if item), tuple(notes)


def _keep_alive_seconds(given: Mapping[str, str]) -> float:
    """torch's rule: a node is dead when it missed ``keep_alive_max_attempt`` beats of
    ``keep_alive_interval`` seconds each (5 and 3 unless given: 15 s, rallypoint's
    default ``heartbeat_timeout`` too)."""
    values = dict(_KEEP_ALIVE)
    for key, raw in given.items():
        try:
            values[key] = float(raw)
        except ValueError:
            raise UsageError(f"--rdzv-conf {key}={raw.strip()!r}: expected a number.") from None
        if not math.isfinite(values[key]):
            raise UsageError(f"--rdzv-conf {key}={raw.strip()!r}: expected a finite number.")
        if not values[key] > 0:
            raise UsageError(f"--rdzv-conf {key}={raw.strip()!r}: must be above 0.")
    return values["keep_alive_interval"] * values["keep_alive_max_attempt"]
