"""One wire lane's connections to one stub: control, data to it, data from it, and a sender thread.

The real rank writes its frames on a thread of their own (``FrameSender``), in FIFO order, so
a ring's sends overlap its receives, as gloo's and NCCL's do; an op waits for its sends only
at its end (gloo's ``waitSend``). Every wait is bounded: a stub that stops answering is a
``WireStall`` naming the node and the wire timeout, not a hang.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

from .wire_env import ENV_TIMEOUT

__all__ = ["WireStall", "FrameSender", "StubPeer", "byte_view"]


class WireStall(ConnectionError):
    """A stub or the path to it made no progress within the wire timeout."""


def _send_frames(sock: socket.socket, header: bytes, payload) -> None:
    sock.sendall(header)
    if payload is not None and len(payload):
        sock.sendall(payload)


class FrameSender:
    """Writes frames to one data connection in FIFO order, so the ring's sends overlap its receives."""

    def __init__(self, sock: socket.socket, name: str, node: str = ""):
        self.sock = sock
        self.node = node
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.done = 0
        self.queued = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, header: bytes, payload) -> int:
        """Queue a frame; returns its ticket (wait for it with ``wait``)."""
        self.queued += 1
        self.q.put((header, payload))
        return self.queued

    def wait(self, ticket: int | None = None, deadline: float | None = None) -> None:
        """Block until frame ``ticket`` (default: every queued frame) is written, at most until ``deadline`` (monotonic)."""
        target = self.queued if ticket is None else ticket
        with self.cond:
            while self.done < target and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WireStall(f"nbox wire: sending to the stub on {self.node} stalled: {self.done} of {target} "
                                    f"frames written within the wire timeout ({ENV_TIMEOUT})")
                self.cond.wait(left)
        if self.error is not None:
            if isinstance(self.error, TimeoutError):
                raise WireStall(f"nbox wire: sending to the stub on {self.node} stalled: no room for a frame within "
                                f"the wire timeout ({ENV_TIMEOUT})")
            raise ConnectionError(f"nbox wire: sending to the stub on {self.node} failed: {self.error}")

    def _run(self) -> None:
        while True:
            header, payload = self.q.get()
            if header is None:
                return
            try:
                _send_frames(self.sock, header, payload)
            except OSError as exc:
                with self.cond:
                    self.error = exc
                    self.cond.notify_all()
                return
            with self.cond:
                self.done += 1
                self.cond.notify_all()

    def close(self) -> None:
        """Stop the thread after what is queued."""
        self.q.put((None, None))


class StubPeer:
    """The connections to one stub process: control, data to it, data from it."""

    def __init__(self, node: str, ctl: socket.socket, out: socket.socket, inp: socket.socket):
        self.node = node
        self.ctl = ctl
        self.out = out
        self.inp = inp
        self.sender = FrameSender(out, f"nbox-wire-send-{node}", node)
        self.arena_size = 0


def byte_view(t) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype; no numpy needed)."""
    import ctypes

    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")

