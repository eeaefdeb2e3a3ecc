"""rallypoint: a fault-tolerant, elastic launcher for PyTorch distributed training.

Plugin authors need one import: ``from rallypoint import hookimpl``; the types the hooks
name live in ``rallypoint.extensions`` and ``rallypoint.events``. Training scripts may
decorate their entry point with ``rallypoint.record`` to put their uncaught exception in
the agent's failure report, and call ``rallypoint.heartbeat()`` every step to feed the
agent's progress watchdog (``--watchdog-timeout``).
"""

from rallypoint.hookspecs import hookimpl
from rallypoint.worker.progress import heartbeat
from rallypoint.worker.record import record

__version__ = "0.1.0"

__all__ = ["__version__", "heartbeat", "hookimpl", "record"]
