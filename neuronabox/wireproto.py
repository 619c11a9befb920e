"""The wire protocol between a real rank and the stub peers: constants and control framing.

Below both ends: the real rank's client (``neuronabox.emu.wire``) and the stubs
(``neuronabox.cluster.stub``) import it, and it imports nothing of either, so neither end
imports the other.

Protocol (version 1)
====================

Two planes, like NCCL's bootstrap and data channels:

*Control* — a Unix stream socket per stub, ``<state dir>/stub-<node>.sock``. It crosses no
network link, so it adds no bytes to the link counters and no latency: in the emulated
cluster every rank reaches a collective together, so telling a stub that a collective began
must take no modeled time. Messages are framed as ``!I`` length + UTF-8 JSON; a message may
carry file descriptors (SCM_RIGHTS):

- ``{"t": "hello", "session": S, "rank": R, "clock": T}`` -> reply ``{"t": "ok"}``. One
  session per real-rank process; ``clock`` is the sender's CLOCK_MONOTONIC, for a check.
- ``{"t": "arena", "size": N}`` + one fd: a memfd holding the real rank's mirror data. The
  stub maps it read-only; a bigger one replaces it (never while an op uses it).
- ``{"t": "op", "seq": Q, "op": NAME, "sends": [[t, frame, offset, length, dep], ...]}``:
  the frames this stub sends to the real rank for collective ``Q``. ``t`` is an absolute
  CLOCK_MONOTONIC time (stubs share the host's kernel clock with the real rank; network
  namespaces do not virtualise it): the earliest moment the model's timeline of the rest of
  the cluster lets that frame leave. ``dep`` >= 0 also holds the frame until the stub has
  received the real rank's frame ``(Q, dep)``: in a 2-rank ring the stub is both neighbours,
  and what it forwards at step k is what it got from us at step k-1. -1: no such wait. The
  payload is ``arena[offset:offset+length]``: mirror data, the bytes of the real rank's input.
- ``{"t": "bye"}``: the session ends (EOF does the same).

*Data* — TCP to the stub's node address, port ``STUB_PORT``, through the shaped links (and
the agent's delay relay when the kernel has no netem). The real rank opens two connections
per stub, each starting with the 13-byte hello ``!4sQB`` (``b"NBWH"``, session, kind):
kind 1 carries the real rank's frames to the stub, which reads and discards them; kind 2
carries the stub's frames to the real rank. A frame is the 16-byte header ``!IIQ`` (seq,
frame, payload length) and the payload. A collective is identified by its ``seq`` (one
counter per real-rank process; ops run in FIFO order on one wire thread), a transfer within
it by ``frame``: ring step k, slice j of J is frame ``k*J + j`` (chunks are cut into slices
of at most ``SLICE`` bytes, and each slice is forwarded as soon as it is reduced, the way
NCCL pipelines a ring); a broadcast's slice j is frame j; a barrier's step k is frame k,
with an empty payload. A stub drops what it receives, noting the last frame for ``dep``.
"""

from __future__ import annotations

import json
import socket
import struct

__all__ = [
    "STUB_PORT", "MAGIC", "HELLO", "FRAME", "KIND_TO_STUB", "KIND_FROM_STUB", "MAX_MSG", "SLICE",
    "send_msg", "recv_msg", "recv_exact",
]

STUB_PORT = 15100
MAGIC = b"NBWH"
HELLO = struct.Struct("!4sQB")  # magic, session, kind
FRAME = struct.Struct("!IIQ")  # seq, frame, payload bytes
KIND_TO_STUB, KIND_FROM_STUB = 1, 2
MAX_MSG = 64 << 20
SLICE = 262144  # ring chunks travel in slices of at most this size, so a ring pipelines

# ---- control framing (both sides) ------------------------------------------------------------
def send_msg(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    """Send one control message (length-prefixed JSON), with file descriptors if given."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    data = struct.pack("!I", len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int, buf: memoryview | None = None) -> memoryview | None:
    """Read exactly ``n`` bytes (into ``buf`` when given); None on a clean EOF before the first byte."""
    out = buf if buf is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(out[got:n])
        if not k:
            if got == 0:
                return None
            raise ConnectionError(f"nbox wire: connection closed after {got} of {n} bytes")
        got += k
    return out[:n]


def recv_msg(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """Receive one control message and the descriptors that came with it ((None, []) at EOF)."""
    # The descriptors ride on the first bytes of a message, so read its length with recv_fds.
    head, fds, _, _ = socket.recv_fds(sock, 4, 4)
    if not head:
        return None, []
    if len(head) < 4:
        rest = recv_exact(sock, 4 - len(head))
        if rest is None:
            raise ConnectionError("nbox wire: truncated control message")
        head += bytes(rest)
    (n,) = struct.unpack("!I", head)
    if n > MAX_MSG:
        raise ConnectionError(f"nbox wire: control message of {n} bytes")
    body = recv_exact(sock, n)
    if body is None:
        raise ConnectionError("nbox wire: truncated control message")
    return json.loads(bytes(body)), list(fds)
