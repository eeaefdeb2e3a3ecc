"""rallypoint-example-checkpoint-backend: the ``example-checkpoint-backend`` checkpoint backend.

Chosen with ``rallypoint run --checkpoint-dir examplefs:///a/directory``.
"""

from __future__ import annotations

from rallypoint.sdk import CheckpointBackend, CheckpointStorage, hookimpl


def open_storage(url: str) -> CheckpointStorage:
    # Imported here, in the workers, only when a run uses this backend.
    from rallypoint_example_checkpoint_backend.storage import ExampleCheckpointBackendStorage

    return ExampleCheckpointBackendStorage(url)


@hookimpl
def register_checkpoint_backends() -> list[CheckpointBackend]:
    return [
        CheckpointBackend(
            "example-checkpoint-backend",
            "checkpoints in a directory, under examplefs:// URLs",
            schemes=("examplefs",),
            open=open_storage,
        )
    ]
