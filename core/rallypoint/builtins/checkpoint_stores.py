"""Built-in checkpoint store: local or shared file systems (``file://`` URLs and plain paths)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import CheckpointStore


@hookimpl
def register_checkpoint_stores() -> list[CheckpointStore]:
    return [
        CheckpointStore(
            "file", "a directory on a local or shared file system", schemes=("file", "")
        )
    ]
