"""Master ports that no other job on the host can take.

A free port found by binding port 0 and closing the socket can be taken by another job
before rank 0 binds it (pytorch #126510). Instead the agent keeps the port *bound* (with
``SO_REUSEADDR``, not listening) for as long as the workers use it: the kernel never hands
a bound port to another ``bind(0)``, while rank 0's TCPStore, which also sets
``SO_REUSEADDR``, can still bind and listen on it.
"""

from __future__ import annotations

import socket


class PortReservation:
    """A port held for this agent's workers until ``release()``."""

    def __init__(self, port: int = 0, host: str = "") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError:
            self._socket.close()
            raise
        self.port: int = self._socket.getsockname()[1]

    def release(self) -> None:
        self._socket.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
