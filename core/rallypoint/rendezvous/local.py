"""The single-node rendezvous: ``--standalone`` and any job of one node.

There is nobody to meet, so every round completes at once. Each round still gets a fresh
master port, held by a ``PortReservation`` until the next round: rank 0 of the new workers
hosts a new TCPStore there, so restarted workers never see an earlier attempt's keys.
"""

from __future__ import annotations

from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.rendezvous.handler import Assignment
from rallypoint.rendezvous.ports import PortReservation


class LocalRendezvous:
    """Rounds of one node."""

    def __init__(
        self,
        node: NodeSpec,
        nproc_per_node: int,
        assigner: RankAssigner,
        *,
        master_addr: str = "localhost",
        master_port: int | None = None,
    ) -> None:
        self.node = node
        self.nproc_per_node = nproc_per_node
        self.assigner = assigner
        self.master_addr = master_addr
        self.fixed_port = master_port
        self._round = -1
        self._port: PortReservation | None = None

    def next_round(self) -> Assignment:
        self._round += 1
        previous, self._port = self._port, None
        if self.fixed_port and previous is not None:
            previous.release()  # the same port again: let go of it first
            previous = None
        # A fixed --master-port is honoured as given (torchrun's static rendezvous); a free
        # one is taken while the previous round's is still held, so the two always differ.
        try:
            self._port = PortReservation(self.fixed_port or 0)
        except OSError as error:
            raise RallypointError(
                f"--master-port {self.fixed_port}: cannot use it on this host ({error.strerror}); "
                "choose another port or leave --master-port out to get a free one."
            ) from None
        finally:
            if previous is not None:
                previous.release()
        (group_rank,) = self.assigner.assign([self.node])
        info = RoundInfo(
            round=self._round,
            group_rank=group_rank,
            group_world_size=1,
            world_size=self.nproc_per_node,
            master_addr=self.master_addr,
            master_port=self._port.port,
            members=(self.node.node_id,),
        )
        return Assignment(info, (self.nproc_per_node,))

    def nodes_waiting(self) -> int:
        return 0

    def request_new_round(self) -> None:
        return None

    def exit_barrier(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        if self._port is not None:
            self._port.release()
            self._port = None
