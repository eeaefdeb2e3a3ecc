"""Built-in checkpoint backend: local or shared file systems (``file://`` URLs and plain paths)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import CheckpointBackend
from rallypoint.interfaces import CheckpointStorage


def open_file_storage(url: str) -> CheckpointStorage:
    from rallypoint.checkpoint.storage import FileStorage

    return FileStorage(url)


@hookimpl
def register_checkpoint_backends() -> list[CheckpointBackend]:
    return [
        CheckpointBackend(
            "file",
            "a directory on a local or shared file system",
            schemes=("file", ""),
            open=open_file_storage,
        )
    ]
