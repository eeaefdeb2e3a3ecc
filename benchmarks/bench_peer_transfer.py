"""What the job token's file MAC (HMAC-SHA256 over every byte,
rallypoint.agent.checkpoints.peers) costs a checkpoint transfer between agents: a ``get`` and
a ``put`` of a memory checkpoint's copy (one file, CRC-32) over loopback, from node memory
(/dev/shm) to node memory, with and without a token, alternated in one run. Both ends run on
this machine, so each side's hashing competes for the same cores.

    .venv/bin/python benchmarks/bench_peer_transfer.py [--size-mb 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from rallypoint.agent.checkpoints import peer_server, peer_wire, peers
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.checkpoint.tier import Held, Tier

TOKEN = b"a benchmark's job token, 32 bytes"
FILE = "rank-00000.slot"


def source(root: Path, size: int) -> Tier:
    """A tier holding a checkpoint of step 1: one file of ``size`` bytes."""
    data = os.urandom(1 << 20) * (size >> 20)
    entry = mf.FileEntry(len(data), crc32=f"{zlib.crc32(data):08x}")
    held = Held(
        mf.Manifest(1, 1, time.time(), "arena", {FILE: entry}),
        lambda _: contextlib.nullcontext(_Reader(data)),
    )
    tier = Tier(FileStorage(str(root / "source")), 1)
    tier.receive(held.manifest, held.open)
    return tier


class _Reader:
    """``data`` as a file to read, without a copy of it all."""

    def __init__(self, data: bytes) -> None:
        self.view, self.at = memoryview(data), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size < 0 else self.at + size
        chunk, self.at = bytes(self.view[self.at : end]), min(end, len(self.view))
        return chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rallypoint-bench-", dir="/dev/shm"))
    try:
        tier = source(root, options.size_mb << 20)
        times: dict[tuple[str, str], list[float]] = {}
        for token in (None, TOKEN):
            peer_wire.key_of(token)  # scrypt once per process, as an agent does at start
        for _ in range(options.repeat):
            for token in (None, TOKEN):
                label = "token" if token else "no token"
                inbox = Tier(FileStorage(str(root / "inbox")), 1)
                server = peer_server.PeerServer(
                    "127.0.0.1", lambda step, rank, sharded: tier.hold(step),
                    lambda rank, sharded, inbox=inbox: inbox, token,
                )  # fmt: skip
                try:
                    into = Tier(FileStorage(str(root / "fetched")), 1)
                    began = time.perf_counter()
                    peers.get(server.address, 1, into, token=token)
                    times.setdefault(("get", label), []).append(time.perf_counter() - began)
                    with tier.hold(1) as held:
                        began = time.perf_counter()
                        peers.put(server.address, held, token=token)
                        times.setdefault(("put", label), []).append(time.perf_counter() - began)
                finally:
                    server.close()
                shutil.rmtree(root / "inbox")
                shutil.rmtree(root / "fetched")
        size = options.size_mb << 20
        print(f"{options.size_mb} MiB over loopback, median of {options.repeat}:")
        for (op, label), seconds in sorted(times.items()):
            median = statistics.median(seconds)
            print(f"  {op} {label:>8}: {median:.3f} s ({size / median / 1e9:.2f} GB/s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
