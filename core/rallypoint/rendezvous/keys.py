"""Where a run keeps what in the coordination store (the layout is in ``protocol``)."""

from __future__ import annotations


class Keys:
    """Where a run keeps what, under ``<prefix>/<run id>/`` (generation 0), or
    ``<prefix>/<run id>~<generation>/`` once the run id was started afresh after every
    agent of it had gone (``~`` is in no run id, so no other job's keys look alike)."""

    def __init__(self, prefix: str, run_id: str, generation: int = 0) -> None:
        self.prefix = prefix
        self.run_id = run_id  # written into every node and round record
        base = f"{prefix.rstrip('/')}/{run_id}"
        self.generation = generation
        self.root = f"{base}/" if generation == 0 else f"{base}~{generation}/"
        #: The run's current generation (absent: 0), outside every generation's keys.
        self.generation_key = f"{base}~generation"
        #: Sealed with the job token by the run's first node (``rendezvous.signing``).
        self.token_key = f"{base}~token"
        self._born = f"{base}~born/"
        #: Written by the agent that hosts a c10d or static store (``tcpstore.HostMark``).
        self.host_key = f"{base}~host"
        #: Every key of the run, all generations, starts with one of these.
        self.prefixes = (f"{base}/", f"{base}~")

    def at(self, generation: int) -> Keys:
        """The same run's keys in ``generation``."""
        return Keys(self.prefix, self.run_id, generation)

    def born(self, generation: int) -> str:
        """Written once, by the node that started ``generation`` (``generations``)."""
        return f"{self._born}{generation}"

    def state(self) -> str:
        return self.root + "state"

    def failed(self) -> str:
        return self.root + "failed"

    def of_round(self, round_: int, *parts: object) -> str:
        return self.root + "/".join(str(p) for p in (round_, *parts))

    def heartbeat(self, node_id: str) -> str:
        return self.root + f"hb/{node_id}"

    def leaving(self, round_: int, node_id: str) -> str:
        """A member of ``round_`` told to stop, which the next round does not wait for."""
        return self.of_round(round_, "leaving", node_id)

    def ready_count(self) -> str:
        """How many nodes said they were getting ready beside a running round."""
        return self.root + "ready"

    def ready(self, number: int) -> str:
        """What the ``number``-th node getting ready does (``rendezvous.readiness``)."""
        return self.root + f"ready/{number}"
