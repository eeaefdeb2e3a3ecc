"""This node's memory checkpoints (``--checkpoint-memory``), which the agent owns.

The agent makes a directory in shared memory (``/dev/shm``) when it starts and hands it
to its workers (``RALLYPOINT_MEMORY_TIER_DIR``): each worker's saves go to its arena under
``arena/`` (``rallypoint.checkpoint.arena``), so a save costs a copy in memory, and the
copy outlives a worker's crash and its restart. In the background, while the workers
train on, the agent, holding the copy against a rewrite while it reads it,

* sends each new memory checkpoint to the next node of the round (group rank + 1), whose
  agent keeps the newest under ``peer/`` (``rallypoint.agent.checkpoints.peers``): a node lost loses
  no checkpoint;
* copies every K-th one (``--checkpoint-persist-every``), and the newest when it stops (a
  signal, the job's end, a failure for good), to ``--checkpoint-dir``: the copies its own
  workers saved, never a peer's (that is the saving node's to copy).

Each round, every agent offers the others its server's address and the copies it holds
(``NodeRecord.offer``); the round record carries every offer, so every agent computes the
same step for the round to resume from (``rallypoint.agent.checkpoints.resume``), fetches the copies
its workers need and it lacks from a member that holds them, and tells its workers
(``RALLYPOINT_CHECKPOINT_STEP``). Sharded saves (``save_sharded``) are copied rank by
rank: each rank's share to the peer and to ``--checkpoint-dir`` (``sharded/rank-R/``).
The directory goes when the agent ends; if the agent is killed, its keeper removes it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rallypoint import events
from rallypoint.agent.checkpoints import peer_server, peer_wire, peers, resume
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint import slot
from rallypoint.checkpoint.checkpointer import PEER_FOLDER, open_storage, ranks_tier, shared_ranks
from rallypoint.checkpoint.copies import Copies
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.checkpoint.tier import MEMORY, PEER, Held, Tier, size_text
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


#: Which copies a node holds: the whole states saved by rank 0 (``(0, False)``), and each
#: rank's shares of sharded states (``(rank, True)``).
Key = tuple[int, bool]
WHOLE: Key = (0, False)


class NodeMemory:
    """The memory directory, the node's copies in it (its workers' arenas, a peer's), the
    server that peers reach, and the threads that copy checkpoints out.

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
        self.peer = Tier(FileStorage(str(self.path / PEER_FOLDER)), 1, PEER, config.peer_memory)
        self._emit = emit
        self._lock = threading.Lock()
        self._saves: dict[Key, int] = {}
        self.persisted: dict[Key, int] = {}  # the newest step made durable, by copy
        self._persisters: dict[Key, Latest] = {}
        self._senders: dict[Key, Latest] = {}
        self._next: str | None = None  # the server of the node after this one in the round
        self._ending = False  # the round ended: its members may be leaving
        self.server: peer_server.PeerServer | None = None
        self._prefetch: threading.Thread | None = None  # the newest, before a join
        self._refusals = 0  # transfers refused: without the job's token, or unsafe
        self._refusals_lock = threading.Lock()  # the server's threads refuse
        self._prefetch_last = False  # whether it was started with nothing else to wait for
        if config.peer_memory:
            try:
                self.server = peer_server.PeerServer(
                    host, self._find, self._inbox, config.job_token, self._refused
                )
            except OSError as error:
                shutil.rmtree(self.path, ignore_errors=True)
                raise CheckpointError(
                    f"--checkpoint-memory: cannot serve memory checkpoints to the other nodes "
                    f"on {host} ({error.strerror or error})"
                ) from None

    @property
    def _token(self) -> bytes | None:
        return self.config.job_token

    def _refused(self, peer: str, why: str) -> None:
        """The server refused a transfer (no job token, a wrong one, an unsafe manifest):
        said once, each one counted."""
        with self._refusals_lock:
            first = not self._refusals
            self._refusals += 1
        if first:
            logger.warning(
                "refused a checkpoint transfer from %s: it gave %s (the next refusals are "
                "counted in the peer_refused events, not logged)",
                peer, why,
            )  # fmt: skip
        self._emit(events.PEER_REFUSED, peer=peer, reason=why)

    # --- where copies are -----------------------------------------------------------------

    def _inbox(self, rank: int, sharded: bool) -> Tier:
        """Where a peer's copy goes: ``peer/``, or a rank's shares under it."""
        return ranks_tier(self.peer, rank) if sharded else self.peer

    def _durable(self, key: Key) -> Tier:
        assert self.durable is not None
        rank, sharded = key
        return ranks_tier(self.durable, rank) if sharded else self.durable

    @contextlib.contextmanager
    def _find(self, step: int, rank: int, sharded: bool) -> Iterator[Held]:
        """The copy of ``step`` by ``rank`` this node holds, its own or a peer's, held
        while the block runs (``peer_wire.NEWEST``: its newest whole state); ``mf.Damaged``
        when it holds none."""
        if step == peer_wire.NEWEST and not sharded:
            step = max(self.held(), default=peer_wire.NEWEST)
        with contextlib.ExitStack() as stack:
            holds: tuple[Callable[[], contextlib.AbstractContextManager[Held]], ...] = (
                lambda: self.copies.hold(step, rank, sharded),
                lambda: self._inbox(rank, sharded).hold(step),
            )
            for hold in holds:
                try:
                    held = stack.enter_context(hold())
                except mf.Damaged:
                    continue
                yield held
                return
        raise mf.Damaged(f"no copy of step {step} by rank {rank} here")

    # --- the round ------------------------------------------------------------------------

    def held(self) -> set[int]:
        """The steps of the whole states this node holds: its own and a peer's."""
        return self.copies.complete_steps() | self.peer.complete_steps()

    def shares(self) -> resume.Shares:
        """The ranks' shares this node holds, its own and a peer's: by step, each rank's
        world size."""
        found = self.copies.shards()
        for rank in shared_ranks(self.peer):
            tier = ranks_tier(self.peer, rank)
            for step in tier.complete_steps():
                with contextlib.suppress(mf.Damaged):
                    world = tier.manifest(mf.directory(step)).world_size
                    found.setdefault(step, {}).setdefault(rank, world)
        return found

    def offer(self) -> dict[str, str]:
        """What this node tells the round: its server and the copies it holds."""
        offer = resume.encode(self.held(), self.shares())
        if self.server is not None:
            offer["server"] = self.server.address
        return offer

    def round_ends(self) -> None:
        """The round ended: a copy that does not reach the next node (which may be leaving,
        told to stop) is no news until the next round names the next node again."""
        self._ending = True

    def resume_step(self, assignment: Assignment) -> int | None:
        """The step every member of this round resumes from (``resume``: the same on every
        node, from the same round record). Copies this node's workers will need and it does
        not hold are fetched from a member that does first; None when no member holds a
        usable one (the workers load from durable storage)."""
        self._ending = False
        info = assignment.info
        offers = assignment.offers or ({},) * info.group_world_size
        me = info.group_rank
        following = offers[(me + 1) % len(offers)] if len(offers) > 1 else {}
        self._next = following.get("server")
        held = [resume.decode(offer) for offer in offers]
        held[me] = (self.held(), self.shares())
        first = assignment.rank_offset
        mine = range(first, first + assignment.local_world_sizes[me])
        decision = resume.decide(held, me, info.world_size, mine)
        for (rank, sharded), members in decision.fetch.items():
            assert decision.step is not None
            self._fetch(decision.step, rank, sharded, members, assignment)
        return decision.step

    def getting_ready(self, offers: Sequence[Mapping[str, str]], *, last: bool) -> str | None:
        """Before this node enters a running job (``offers``: its round's, by group rank):
        what it still does to hold the job's newest whole state, fetched in the background
        from a member; None once done (fetched, or no member had one to send). ``last``:
        nothing else keeps the node from joining, so a fetch done before, which the job
        has saved past since, is made again (once)."""
        fetch = self._prefetch
        if fetch is not None and not fetch.is_alive() and last and not self._prefetch_last:
            fetch = None  # done while the node was busy with something else: fetch anew
        if fetch is None:
            self._prefetch_last = last
            fetch = self._prefetch = threading.Thread(
                target=self._fetch_newest, args=(offers,), name="rallypoint-prefetch", daemon=True
            )
            fetch.start()
        if fetch.is_alive():
            return "fetching the newest memory checkpoint from a member"
        return None

    def _fetch_newest(self, offers: Sequence[Mapping[str, str]]) -> None:
        # Group rank 0 saves whole states: it holds the newest, its next member a copy.
        servers = [
            (member, offer["server"]) for member, offer in enumerate(offers) if offer.get("server")
        ]
        fetched = self._first_copy(
            servers, peer_wire.NEWEST, 0, False, "the newest checkpoint", logging.DEBUG
        )
        if fetched is not None:
            member, step, size, seconds = fetched
            logger.info(
                "fetched the job's newest checkpoint (step %d) from group rank %d before "
                "joining (%s in %.2f s)",
                step, member, size_text(size), seconds,
            )  # fmt: skip

    def _fetch(
        self, step: int, rank: int, sharded: bool, members: list[int], assignment: Assignment
    ) -> None:
        what = (
            f"rank {rank}'s share of checkpoint {step}" if sharded else f"checkpoint of step {step}"
        )
        offers = assignment.offers or ()
        servers = [
            (m, offers[m]["server"]) for m in members if m < len(offers) and offers[m].get("server")
        ]
        fetched = self._first_copy(servers, step, rank, sharded, what, logging.WARNING)
        if fetched is None:
            logger.warning(
                "no member could send %s: this node's workers load the newest copy they find", what
            )
            return
        member, _, size, seconds = fetched
        members_ids = assignment.info.members
        logger.info(
            "fetched %s from node %s (%s in %.2f s)",
            what,
            members_ids[member] if member < len(members_ids) else dict(servers)[member],
            size_text(size),
            seconds,
        )

    def _first_copy(
        self,
        servers: Sequence[tuple[int, str]],
        step: int,
        rank: int,
        sharded: bool,
        what: str,
        level: int,
    ) -> tuple[int, int, int, float] | None:
        """Fetch ``step`` (``rank``'s share with ``sharded``) into this node's inbox from the
        first of ``servers`` (group rank, address) that sends it: that member, the step,
        its bytes and the seconds it took; None when none did (each failure said at
        ``level``, naming ``what``)."""
        inbox = self._inbox(rank, sharded)
        for member, server in servers:
            began = time.perf_counter()
            try:
                fetched, size = peers.get(server, step, inbox, rank, sharded, self._token)
            except peer_wire.Refused as error:  # not a peer's mishap: always said, and counted
                logger.warning("%s not fetched from %s: %s", what, server, error)
                self._emit(events.PEER_REFUSED, peer=server, reason=error.reason)
                continue
            except (OSError, ValueError, CheckpointError, mf.Damaged) as error:
                logger.log(level, "%s not fetched from %s: %s", what, server, error)
                continue
            return member, fetched, size, time.perf_counter() - began
        return None

    # --- a worker saved -------------------------------------------------------------------

    def saved(self, data: dict[str, Any]) -> None:
        """A worker's ``checkpoint_saved`` event: a memory save is sent to the next node,
        and every K-th made durable (a whole state's, and each rank's share apart)."""
        if data.get("tier") != MEMORY:
            return
        step = int(data["step"])
        sharded = data.get("format") == "sharded"
        key = (int(data.get("rank") or 0), sharded) if sharded else WHOLE
        with self._lock:
            if self._next is not None:
                self._worker(self._senders, key, self._send, "peer-send").ask(step)
            if self.durable is not None:
                self._saves[key] = self._saves.get(key, 0) + 1
                if self._saves[key] % self.config.checkpoint_persist_every == 0:
                    self._worker(self._persisters, key, self._persist, "persist").ask(step)

    def _worker(
        self, workers: dict[Key, Latest], key: Key, work: Callable[[Key, int], None], name: str
    ) -> Latest:
        if key not in workers:
            workers[key] = Latest(
                lambda step: work(key, step), f"rallypoint-{name}-{key[0]}{'s' if key[1] else ''}"
            )
        return workers[key]

    def _send(self, key: Key, step: int) -> None:
        server = self._next
        if server is None:
            return
        rank, sharded = key
        try:
            with self.copies.hold(step, rank, sharded, or_newer=True) as held:
                peers.put(server, held, rank, sharded, self._token)
        except peer_wire.Refused as error:  # its answers prove no token: not the job's agent
            logger.warning("checkpoint of step %d not sent to %s: %s", step, server, error)
            self._emit(events.PEER_REFUSED, peer=server, reason=error.reason)
        except (OSError, ValueError, CheckpointError, mf.Damaged) as error:
            # While the round ends the peer may be leaving (told to stop): no news.
            level = logging.INFO if self._ending else logging.WARNING
            logger.log(level, "checkpoint of step %d not sent to %s: %s", step, server, error)

    def _persist(self, key: Key, step: int) -> None:
        done = self.persisted.get(key)
        if done is not None and step <= done:
            return
        rank, sharded = key
        durable = self._durable(key)
        began = time.perf_counter()
        try:
            # Written over already (saves come faster than this copy): a newer one goes.
            with self.copies.hold(step, rank, sharded, or_newer=True) as held:
                step = held.manifest.step
                copied = durable.receive(held.manifest, held.open)
        except (CheckpointError, mf.Damaged, OSError) as error:
            kept = f"; it keeps step {done}" if done is not None else ""
            logger.warning(
                "checkpoint of step %d not copied to %s: %s; training goes on%s",
                step,
                self.config.checkpoint_dir,
                error.__cause__ or error,  # the storage's own error, not our wrapping
                kept,
            )
            return
        self.persisted[key] = step
        extra = {"rank": rank} if sharded else {}
        self._emit(
            events.CHECKPOINT_PERSISTED,
            step=step,
            seconds=time.perf_counter() - began,
            bytes=copied,
            url=durable.url,
            **extra,
        )

    # --- stopping -------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, for the copies asked of the peer senders so far to
        be sent (a node that leaves sends its last save first); whether they were."""
        deadline = time.monotonic() + timeout
        with self._lock:
            senders = list(self._senders.values())
        return all(s.join(max(0.0, deadline - time.monotonic())) for s in senders)

    def close(self, why: str) -> None:
        """The agent stops (``why``): make the newest memory checkpoints durable if they
        are not yet (bounded by ``--shutdown-timeout``), then remove the directory."""
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
        newest: dict[Key, int] = {}
        for copy in slot.committed(self.copies.root):
            key = (copy.record.rank, True) if copy.record.sharded else WHOLE
            if copy.record.sharded or copy.record.rank == 0:
                newest[key] = max(newest.get(key, copy.step), copy.step)
        for key, step in sorted(newest.items()):
            done = self.persisted.get(key)
            if done is None or step > done:
                logger.info(
                    "%s: copying checkpoint of step %d%s to %s", why, step,
                    f" (rank {key[0]}'s share)" if key[1] else "", self.config.checkpoint_dir,
                )  # fmt: skip
                with self._lock:
                    self._worker(self._persisters, key, self._persist, "persist").ask(step)
        deadline = time.monotonic() + self.config.shutdown_timeout
        for persister in list(self._persisters.values()):
            if not persister.join(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "the copies of memory checkpoints to %s did not finish within %g s "
                    "(--shutdown-timeout)",
                    self.config.checkpoint_dir,
                    self.config.shutdown_timeout,
                )
                return
