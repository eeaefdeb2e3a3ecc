"""rallypoint-fsspec: the ``fsspec`` checkpoint backend.

``rallypoint run --checkpoint-dir s3://bucket/run42`` keeps checkpoints in S3; likewise
``gs://`` (Google Cloud Storage) and ``az://`` (Azure Blob Storage), and ``local://`` for
the local file system through fsspec. Each scheme is served only where the library that
implements it is installed, so a node without ``s3fs`` refuses an ``s3://`` URL when the
run starts instead of failing in its workers. Nothing but the standard library is imported
here: fsspec and its backends are imported in the workers, by ``open_storage``.
"""

from __future__ import annotations

from importlib.util import find_spec

from rallypoint.sdk import CheckpointBackend, CheckpointStorage, hookimpl

__version__ = "0.1.0"

#: Every scheme this store can serve, and the module that must be importable to serve it.
#: ``file`` is left to the built-in file store: two stores claiming a scheme are both
#: withdrawn. ``memory`` is left out: each process would have its own.
BACKENDS: dict[str, str] = {
    "local": "fsspec",
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}


def available_schemes() -> tuple[str, ...]:
    """The schemes whose backend is installed here (found without importing it)."""
    return tuple(scheme for scheme, module in BACKENDS.items() if find_spec(module) is not None)


def open_storage(url: str) -> CheckpointStorage:
    from rallypoint_fsspec.storage import FsspecStorage

    return FsspecStorage(url)


@hookimpl
def register_checkpoint_backends() -> list[CheckpointBackend]:
    return [
        CheckpointBackend(
            "fsspec",
            "object storage through fsspec (s3:// with s3fs, gs:// with gcsfs, az:// with adlfs)",
            schemes=available_schemes(),
            open=open_storage,
        )
    ]
