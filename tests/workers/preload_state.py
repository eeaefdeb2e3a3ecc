"""A ``--preload`` module that leaves state in the preloaded interpreter which a fresh one
would not have: multiprocessing's resource tracker and fork server, running, and an object
bound to the process it was made in, which ``multiprocessing.util.register_after_fork``
asks to renew in a forked child (as a connection pool does)."""

import os
from multiprocessing import forkserver, resource_tracker, util


class Owner:
    """The pid it was made in, renewed after a fork."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def after_fork(self) -> None:
        self.pid = os.getpid()


resource_tracker.ensure_running()
forkserver.ensure_running()
owner = Owner()
util.register_after_fork(owner, Owner.after_fork)
