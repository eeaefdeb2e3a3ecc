"""This node's memory checkpoints (``--checkpoint-memory``), which the agent owns.

The agent makes a directory in shared memory (``/dev/shm``) when it starts and hands it
to its workers (``RALLYPOINT_MEMORY_TIER``): each worker's saves go to its arena under
``arena/`` (``rallypoint.checkpoint.arena``), so a save costs a copy in memory, and the
copy outlives a worker's crash and its restart. In the background, while the workers
train on, the agent, holding the copy against a rewrite while it reads it,

* sends each new memory checkpoint to the next node of the round (group rank + 1), whose
  agent keeps the newest under ``peer/`` (``rallypoint.agent.peers``): a node lost loses
  no checkpoint;
* copies every K-th one (``--checkpoint-persist-every``), and the newest when it stops (a
  signal, the job's end, a failure for good), to ``--checkpoint-dir``: the copies its own
  workers saved, never a peer's (that is the saving node's to copy).

Each round, every agent offers the others its server's address and the steps it holds
(``NodeRecord.offer``); the round record carries every offer, so every agent computes the
same step for the round to resume from (the newest any member holds), fetches it from a
member if it holds no copy, and tells its workers (``RALLYPOINT_CHECKPOINT_STEP``). The
directory goes when the agent ends; if the agent is killed, its keeper removes it.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint import events
from rallypoint.agent import peers
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint import slot
from rallypoint.checkpoint.checkpointer import PEER_FOLDER, open_storage
from rallypoint.checkpoint.copies import Copies
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.checkpoint.tier import MEMORY, PEER, Tier, size_text
from rallypoint.config import SHARED_MEMORY, LaunchConfig
from rallypoint.interfaces import Assignment, CheckpointError

logger = logging.getLogger("rallypoint.agent")

#: The newest copies the durable storage keeps, as a ``Checkpointer``'s default.
DURABLE_KEEP = 3


class Latest:
    """Does ``work(step)`` in a thread of its own for the newest step asked for: a step
    asked for while another is being worked on waits, and only the newest of those is
    done next (a copy that falls behind skips steps rather than queue them)."""

    def __init__(self, work: Callable[[int], object], name: str) -> None:
        self._work = work
        self._name = name
        self._wanted: int | None = None
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def ask(self, step: int) -> None:
        with self._lock:
            self._wanted = step if self._wanted is None else max(step, self._wanted)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                step, self._wanted = self._wanted, None
                if step is None:
                    self.thread = None
                    return
            self._work(step)

    def join(self, timeout: float) -> bool:
        """Wait for the work asked for so far, at most ``timeout`` s; whether it is done."""
        thread = self.thread
        if thread is not None:
            thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()


class NodeMemory:
    """The memory directory, its tiers (this node's copies, a peer's), the server that
    peers reach, and the threads that copy checkpoints out.

    ``host``: this node's address in the rendezvous, where the server listens (jobs of
    several nodes only). ``emit(name, **fields)`` announces each durable copy.
    """

    def __init__(self, config: LaunchConfig, host: str, emit: Callable[..., object]) -> None:
        self.config = config
        self.durable: Tier | None = None
        if config.checkpoint_dir:
            self.durable = Tier(open_storage(config.checkpoint_dir), DURABLE_KEEP)
        else:
            logger.info(
                "--checkpoint-memory without --checkpoint-dir: memory checkpoints are "
                "copied to no durable storage, and a job that loses every node starts over"
            )
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", config.rdzv_id)[:40]
        self.path = Path(tempfile.mkdtemp(prefix=f"rallypoint-{run}-", dir=SHARED_MEMORY))
        (self.path / slot.ARENA).mkdir()
        #: The node's own copies, in its workers' arenas; a peer's copy, in peer/.
        self.copies = Copies(self.path / slot.ARENA)
        self.peer = Tier(
            FileStorage(str(self.path / PEER_FOLDER)), 1, PEER, config.checkpoint_memory
        )
        self._emit = emit
        self._saves = 0
        self.persisted: int | None = None  # the newest step made durable
        self._persister = Latest(self._persist, "rallypoint-persist")
        self._sender = Latest(self._send, "rallypoint-peer-send")
        self._next: str | None = None  # the server of the node after this one in the round
        self.server: peers.PeerServer | None = None
        if config.max_nodes > 1:
            try:
                self.server = peers.PeerServer(host, [self.copies, self.peer], self.peer)
            except OSError as error:
                shutil.rmtree(self.path, ignore_errors=True)
                raise CheckpointError(
                    f"--checkpoint-memory: cannot serve memory checkpoints to the other nodes "
                    f"on {host} ({error.strerror or error})"
                ) from None

    # --- the round ------------------------------------------------------------------------

    def held(self) -> set[int]:
        """The steps of the complete copies this node holds: its own and a peer's."""
        return self.copies.complete_steps() | self.peer.complete_steps()

    def offer(self) -> dict[str, str]:
        """What this node tells the round: its server and the steps it holds."""
        offer = {"steps": " ".join(map(str, sorted(self.held())))}
        if self.server is not None:
            offer["server"] = self.server.address
        return offer

    def resume_step(self, assignment: Assignment) -> int | None:
        """The step every member of this round resumes from: the newest any of them holds
        in memory (the same on every node: each reads the same round record). If this
        node holds no copy of it, it is fetched from a member that does first; None when
        no member holds one (the workers load the newest durable checkpoint)."""
        info = assignment.info
        offers = assignment.offers or ({},) * info.group_world_size
        me = info.group_rank
        following = offers[(me + 1) % len(offers)] if len(offers) > 1 else {}
        self._next = following.get("server")
        held = {
            rank: {int(s) for s in offer.get("steps", "").split()}
            for rank, offer in enumerate(offers)
        }
        held[me] = self.held()
        step = max((s for steps in held.values() for s in steps), default=None)
        if step is None or step in held[me]:
            return step
        for rank, steps in held.items():
            server = offers[rank].get("server")
            if step not in steps or not server:
                continue
            began = time.perf_counter()
            try:
                size = peers.get(server, step, self.peer)
            except (OSError, ValueError, CheckpointError, mf.Damaged) as error:
                logger.warning("checkpoint of step %d not fetched from %s: %s", step, server, error)
                continue
            logger.info(
                "fetched checkpoint of step %d from node %s (%s in %.2f s)",
                step,
                info.members[rank] if rank < len(info.members) else server,
                size_text(size),
                time.perf_counter() - began,
            )
            return step
        logger.warning(
            "no member could send checkpoint of step %d: this node's workers load the newest "
            "copy they find",
            step,
        )
        return step

    # --- a worker saved -------------------------------------------------------------------

    def saved(self, data: dict[str, Any]) -> None:
        """A worker's ``checkpoint_saved`` event: a memory save is sent to the next node,
        and every K-th made durable."""
        if data.get("tier") != MEMORY:
            return
        step = int(data["step"])
        if self._next is not None:
            self._sender.ask(step)
        if self.durable is not None:
            self._saves += 1
            if self._saves % self.config.checkpoint_persist_every == 0:
                self._persister.ask(step)

    def _send(self, step: int) -> None:
        server = self._next
        if server is None:
            return
        try:
            with self.copies.hold(step) as held:
                peers.put(server, held)
        except (OSError, ValueError, CheckpointError, mf.Damaged) as error:
            logger.warning("checkpoint of step %d not sent to %s: %s", step, server, error)

    def _persist(self, step: int) -> None:
        assert self.durable is not None
        if self.persisted is not None and step <= self.persisted:
            return
        began = time.perf_counter()
        try:
            with self.copies.hold(step) as held:
                copied = self.durable.receive(held.manifest, held.open)
        except (CheckpointError, mf.Damaged, OSError) as error:
            kept = f"; it keeps step {self.persisted}" if self.persisted is not None else ""
            logger.warning(
                "checkpoint of step %d not copied to %s: %s; training goes on%s",
                step,
                self.config.checkpoint_dir,
                error.__cause__ or error,  # the storage's own error, not our wrapping
                kept,
            )
            return
        self.persisted = step
        self._emit(
            events.CHECKPOINT_PERSISTED,
            step=step,
            seconds=time.perf_counter() - began,
            bytes=copied,
            url=self.durable.url,
        )

    # --- stopping -------------------------------------------------------------------------

    def close(self, why: str) -> None:
        """The agent stops (``why``): make the newest memory checkpoint durable if it is
        not yet (bounded by ``--shutdown-timeout``), then remove the directory."""
        try:
            if self.server is not None:
                self.server.close()
            if self.durable is not None:
                self._persist_newest(why)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)

    def _persist_newest(self, why: str) -> None:
        # This node's own copies only: a peer's copy is the saving node's to make durable
        # (two agents writing one step into one directory would undo each other's files).
        newest = max(self.copies.complete_steps(), default=None)
        if newest is not None and (self.persisted is None or newest > self.persisted):
            logger.info(
                "%s: copying checkpoint of step %d to %s", why, newest, self.config.checkpoint_dir
            )
            self._persister.ask(newest)
        if not self._persister.join(self.config.shutdown_timeout):
            logger.warning(
                "the copy of checkpoint %s to %s did not finish within %g s (--shutdown-timeout)",
                newest,
                self.config.checkpoint_dir,
                self.config.shutdown_timeout,
            )
