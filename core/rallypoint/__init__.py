"""rallypoint: a fault-tolerant, elastic launcher for PyTorch distributed training.

Plugin authors need one import: ``from rallypoint import hookimpl``; the types the hooks
name live in ``rallypoint.extensions`` and ``rallypoint.events``.
"""

from rallypoint.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
