"""A cold worker's first code: ``python -u SCRIPT`` with this folder first on ``PYTHONPATH``
(``rallypoint.worker.progress_sources.cold_start_environment``), so that ``site`` imports
this module before the script runs.

It puts ``PYTHONPATH`` back as it was, leaves ``sys.path``, installs the progress sources,
then imports the next ``sitecustomize`` on ``sys.path`` if there is one (the distribution's,
the user's), as ``site`` would have: the script sees the environment, ``sys.path`` and
customisation it would have under torchrun. A failure to install is one line on stderr,
never the worker's end.
"""

from __future__ import annotations

import os
import sys

#: rallypoint.worker.variables.SAVED_PYTHONPATH; a literal, put back before rallypoint is
#: imported (tests/test_progress_sources.py checks that they agree).
SAVED_PYTHONPATH = "RALLYPOINT_PYTHONPATH"


def _restore() -> None:
    saved = os.environ.pop(SAVED_PYTHONPATH, None)
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    sys.path_importer_cache.pop(here, None)


def _install() -> None:
    try:
        from rallypoint.worker import progress_sources

        progress_sources.install()
    except Exception as error:
        print(f"rallypoint: no progress reports from this worker: {error!r}", file=sys.stderr)


def _next_sitecustomize() -> None:
    """The next ``sitecustomize`` takes this one's place in ``sys.modules``; its errors
    reach ``site``, which prints them as it would have. Where there is none, this one
    stays there (the import that runs it expects a module under its name)."""
    this = sys.modules.pop(__name__)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401  # the next one
    except ImportError as error:
        if error.name != __name__:
            raise
        sys.modules[__name__] = this


if __name__ == "sitecustomize":  # run by site; imported otherwise, it does nothing
    _restore()
    _install()
    _next_sitecustomize()
