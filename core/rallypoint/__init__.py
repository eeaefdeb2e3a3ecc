"""rallypoint: a fault-tolerant, elastic launcher for PyTorch distributed training.

Plugin authors need one import: ``from rallypoint import hookimpl``; the types the hooks
name live in ``rallypoint.extensions`` and ``rallypoint.events``. Training scripts may
decorate their entry point with ``rallypoint.record`` to put their uncaught exception in
the agent's failure report. The agent sees a worker's progress without a call (its
optimizer steps, collectives, checkpoints); ``rallypoint.progress(step=N)`` tells it the
step (``heartbeat``, its earlier name, is the same function).
"""

from rallypoint.hookspecs import hookimpl
from rallypoint.worker.progress import heartbeat, progress
from rallypoint.worker.record import record

__version__ = "0.1.0"

__all__ = ["__version__", "heartbeat", "hookimpl", "progress", "record"]
