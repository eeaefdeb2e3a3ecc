"""A TCP proxy between one agent and the store, that a test can cut and restore: the store
unreachable from that agent only, as in a network partition.

``cut()`` resets every open connection and holds the new ones: they are accepted but
nothing is forwarded (a blackhole: the client's requests time out rather than being
refused, as across a partition). ``restore()`` forwards again, held connections included,
as a partition that heals lets the client's retransmitted handshake through.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from types import TracebackType

#: SO_LINGER with a zero timeout: close() sends RST, so the peer sees its connection reset.
_RESET = struct.pack("ii", 1, 0)


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` on one thread (a selector loop)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}  # both directions of each pair
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    # --- the test's controls --------------------------------------------------------------

    def cut(self) -> None:
        """Reset every open connection; hold new ones until ``restore``."""
        with self._lock:
            self._cut = True
        self._wake()

    def restore(self) -> None:
        """Forward again, held connections included."""
        with self._lock:
            self._cut = False
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join(10)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the loop -------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")

    def _loop(self) -> None:
        cut = False
        try:
            while True:
                with self._lock:
                    stop, now_cut = self._stop, self._cut
                if stop:
                    return
                if now_cut and not cut:
                    self._reset_all()
                elif cut and not now_cut:
                    held, self._held = self._held, []
                    for client in held:
                        self._forward(client)
                cut = now_cut
                for key, _ in self._selector.select(timeout=1.0):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_read:
                        with contextlib.suppress(OSError):
                            self._wake_read.recv(4096)
                    elif sock is self._listener:
                        self._accept(cut)
                    elif sock in self._peers:
                        self._pump(sock)
        finally:
            self._reset_all()
            for client in self._held:
                client.close()
            self._selector.close()
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self, cut: bool) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if cut:
            self._held.append(client)  # its bytes wait in the kernel until restore()
        else:
            self._forward(client)

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        for sock in (client, upstream):
            sock.setblocking(True)
            sock.settimeout(5)
        self._peers[client], self._peers[upstream] = upstream, client
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(upstream, selectors.EVENT_READ)

    def _pump(self, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for one in (sock, peer):
            if one is None:
                continue
            self._peers.pop(one, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(one)
            _reset(one)

    def _reset_all(self) -> None:
        for sock in list(self._peers):
            self._drop(sock)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    sock.close()
