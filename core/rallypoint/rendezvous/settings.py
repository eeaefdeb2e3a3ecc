"""The protocol's settings: its ``--rdzv-conf`` values and the job's size."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rallypoint.extensions import COMMON_RENDEZVOUS_OPTIONS, DEFAULT_PREFIX


@dataclass(frozen=True)
class Settings:
    """The protocol's ``--rdzv-conf`` values (``COMMON_RENDEZVOUS_OPTIONS``, whose defaults
    are the only ones) and the job's size."""

    min_nodes: int
    max_nodes: int
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    heartbeat_timeout: float
    retry_timeout: float
    ready_timeout: float
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_conf(cls, min_nodes: int, max_nodes: int, conf: Mapping[str, Any]) -> Settings:
        """From a backend's parsed options; a key the backend does not declare takes the
        protocol's default."""
        values = {
            option.name: float(conf.get(option.name, option.default))
            for option in COMMON_RENDEZVOUS_OPTIONS
            if option.type is float  # the timeouts; token_file is the agent's
        }
        return cls(min_nodes, max_nodes, **values, prefix=str(conf.get("prefix") or DEFAULT_PREFIX))

    @property
    def most_joins(self) -> int:
        """The most join numbers of a round the protocol reads: MAX, as many again (numbers
        voided by nodes that moved on, or counted twice by a retried add), and some slack.
        A count is a counter anyone who reaches the store can add to: capped, it sizes no
        read or list beyond this."""
        return 2 * self.max_nodes + 64

    @property
    def nnodes(self) -> str:
        """The job's size as ``--nnodes`` says it."""
        low, high = self.min_nodes, self.max_nodes
        return str(low) if low == high else f"{low}:{high}"
