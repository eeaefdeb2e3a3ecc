"""A checkpoint's files as a load reads them from a tier: on this machine (where they lie,
or a temporary copy), checked against the manifest first; and the two formats a replicated
checkpoint comes in there (``torch.save``'s file, a memory copy's slot file)."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import loading, slot
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.copies import FILE
from rallypoint.checkpoint.storage import FileStorage, Prefixed
from rallypoint.checkpoint.tier import Tier
from rallypoint.interfaces import CheckpointError

#: The file ``torch.save`` writes a replicated checkpoint into.
STATE_FILE = "state.pt"
#: The folder of a checkpoint that ``torch.distributed.checkpoint`` writes its files into.
SHARDS = "shards"


def sharded_tier(durable: Tier | None) -> Tier:
    """The tier sharded checkpoints are written to with DCP: ``--checkpoint-dir``."""
    if durable is None:
        raise CheckpointError(
            "sharded checkpoints need a shared file system path as --checkpoint-dir; "
            "they do not go to --checkpoint-memory"
        )
    return durable


def local_path(tier: Tier, name: str) -> str:
    """Where ``name`` of ``tier`` lies, for DCP, which reads and writes paths."""
    if not isinstance(tier.storage, FileStorage):
        raise CheckpointError(f"sharded checkpoints need a file system path, not {tier.url!r}")
    return str(tier.storage.path(name))


def load_torch(
    tier: Tier, name: str, manifest: mf.Manifest, options: dict[str, Any]
) -> tuple[Any, int]:
    """A checkpoint ``torch.save`` wrote (``save`` to durable storage)."""
    import torch

    entry = manifest.files.get(STATE_FILE)
    if entry is None:
        raise mf.Damaged(f"the manifest lists no {STATE_FILE}")
    data = tier.read(f"{name}/{STATE_FILE}")
    mf.verify(STATE_FILE, data, entry)
    state = torch.load(
        io.BytesIO(data), map_location=options["map_location"], weights_only=options["weights_only"]
    )
    return state, entry.size


def load_slot_file(
    tier: Tier, name: str, manifest: mf.Manifest, options: dict[str, Any]
) -> tuple[Any, int]:
    """A memory checkpoint an agent sent or made durable: a slot's bytes in one file,
    checked against its manifest, then loaded as a slot is (from a local file as it lies;
    from another storage, through a temporary file)."""
    verified = verified_file(tier, name, manifest, FILE.format(rank=0))
    with verified as (path, entry), open(path, "rb") as handle:
        record, _ = slot.read(handle)
        return loading.load_file(handle.fileno(), record, path, **options), entry.size


def open_shares(
    stack: contextlib.ExitStack, found: list[tuple[Tier, str, mf.Manifest]]
) -> tuple[Any, int]:
    """A ``SlotReader`` over shares in checkpoint folders (``(tier, name, manifest)``
    each), each file checked against its manifest first and kept open in ``stack``; and
    their size."""
    paths = []
    size = 0
    for tier, name, manifest in found:
        (file_name, _), *_ = manifest.files.items()  # a share's one file, rank-R.slot
        path, entry = stack.enter_context(verified_file(tier, name, manifest, file_name))
        paths.append(path)
        size += entry.size
    return slot_reader(paths), size


def slot_reader(paths: list[Path]) -> Any:
    """A ``SlotReader`` over ``paths`` (imported here: it imports torch)."""
    from rallypoint.checkpoint.slot_reader import SlotReader

    return SlotReader(paths)


@contextlib.contextmanager
def verified_file(
    tier: Tier, name: str, manifest: mf.Manifest, file_name: str
) -> Iterator[tuple[Path, mf.FileEntry]]:
    """The file ``file_name`` of checkpoint ``name`` on this machine (``local_file``),
    checked against its manifest entry, which comes with it."""
    entry = manifest.files.get(file_name)
    if entry is None:
        raise mf.Damaged(f"the manifest lists no {file_name}")
    with local_file(tier, f"{name}/{file_name}") as path:
        with open(path, "rb") as handle:
            mf.verify(file_name, _mapped(handle), entry)
        yield path, entry


@contextlib.contextmanager
def local_file(tier: Tier, name: str) -> Iterator[Path]:
    """The file ``name`` of ``tier`` on this machine: where it lies, or a temporary copy."""
    storage = tier.storage
    path = storage.path(name) if isinstance(storage, (FileStorage, Prefixed)) else None
    if path is not None:
        if not path.is_file():
            raise mf.Damaged(f"{name.rsplit('/', 1)[-1]} is missing")
        yield path
        return
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="rallypoint-load-") as copy:
        copy.write(tier.read(name))
        copy.flush()
        yield Path(copy.name)


def _mapped(handle: Any) -> Any:
    """A file's bytes, mapped (read only) to be checked: no copy of it is made."""
    size = os.fstat(handle.fileno()).st_size
    return mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) if size else b""
