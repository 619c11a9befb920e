"""The user-space delay path for TCP, for kernels without sch_netem.

A transparent relay: in each node namespace an iptables ``nat OUTPUT`` rule REDIRECTs the
node's outgoing TCP connections to cluster addresses onto the relay's listener there; the
relay reads the original destination with ``SO_ORIGINAL_DST``, connects to it from the same
namespace with ``SO_MARK`` set (the rule skips marked packets, so the relay's own connection
is not redirected again) and copies the stream both ways, releasing every chunk one-way
delay (plus jitter) after it arrived, in order. Rate stays with the kernel's tbf/htb on the
veths, which the relay's upstream packets cross like any others.

A relay serves many namespaces: it opens a listener inside each (a socket stays in the
namespace it was made in), so 64 nodes cost one Python process, not 64. On a cluster the agent
runs one relay per CPU that homes nodes (``relay_pool.py``) and splits each connection by
direction (``Peers``): the relay of the node that opened it copies what that node sends, the
destination node's relay copies the way back, so the two directions move on two cores at once.

Turned on itself. A connection whose original destination is the relay port (a client dialling
``10.77.0.2:15001`` directly) is closed at once: relayed on, it would reach a relay again and
again (10,000 connections and 20,000 descriptors in 3 s, then "Too many open files"). A node
has at most ``MAX_CONNECTIONS_PER_NODE`` connections open through the relay; more are closed
as they arrive, so no node can exhaust the descriptors the others need.

Timing: asyncio's epoll wait rounds timeouts up to whole milliseconds, which would add up to
1 ms to a 1 ms delay. Release times are therefore kept in one heap and a ``timerfd``
(nanosecond resolution, CLOCK_MONOTONIC like ``loop.time()``) wakes the loop exactly when the
earliest chunk is due. No thread spins or polls.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import random
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["Relay", "Delays", "DelayTable", "Peers", "MARK", "DEFAULT_PORT", "redirect_rule", "original_dst"]

MARK = 0x4E42  # "NB": the relay's own packets carry it and are not redirected again
DEFAULT_PORT = 15001
SO_ORIGINAL_DST = 80
SO_MARK = 36
HIGH_WATER = 8 << 20  # bytes held in one direction's delay line before reading pauses
LOW_WATER = 2 << 20
READ_SIZE = 256 << 10
MAX_CONNECTIONS_PER_NODE = 1024  # each costs the relays four descriptors (two sockets, each held by two relays)


@dataclass(frozen=True)
class Delays:
    """One-way delays (s) of a connection: forward (client to server), reverse, and their jitter."""

    fwd: float = 0.0
    rev: float = 0.0
    jitter_fwd: float = 0.0
    jitter_rev: float = 0.0


_NO_DELAY = Delays()


class DelayTable:
    """Per namespace key: destination address -> Delays; looked up per chunk or packet."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, Delays]] = {}

    def set(self, key: str, table: dict[str, Delays]) -> None:
        """Replace the per-destination delays of the namespace ``key`` (open connections follow at once)."""
        self.table[key] = dict(table)

    def lookup(self, key: str, dst: str) -> Delays:
        """The delays from namespace ``key`` to address ``dst`` now."""
        return self.table.get(key, {}).get(dst, _NO_DELAY)


class Peers:
    """Which relay copies the bytes each node sends, and how a connection's return half gets there."""

    def __init__(self, me: int, homes: dict[str, int], hand_over: Callable[[int, list[int], dict], None]):
        self.me = me
        self.homes = homes  # destination address -> index of the relay on that node's CPU
        self.hand_over = hand_over  # (relay index, [client fd, upstream fd], {"key", "dst"})

    def home(self, dst: str) -> int | None:
        """The relay that should copy what ``dst`` sends back, when it is another one."""
        h = self.homes.get(dst)
        return None if h is None or h == self.me else h


def redirect_rule(port: int, subnet: str, mark: int = MARK) -> list[str]:
    """The iptables arguments that send a namespace's own TCP connections into the cluster to the relay."""
    return ["-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", subnet, "-m", "mark", "!", "--mark", hex(mark),
            "-j", "REDIRECT", "--to-ports", str(port)]


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where a REDIRECTed connection was going (SO_ORIGINAL_DST)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


# ---- precise timer ---------------------------------------------------------------------------
class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


_libc = ctypes.CDLL(None, use_errno=True)
CLOCK_MONOTONIC, TFD_NONBLOCK, TFD_CLOEXEC, TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1
PR_SET_TIMERSLACK = 29
# Measured on this project's VMs: a timer that sleeps T wakes about 1.4% of T late (the
# timer device and the clock disagree), so a wait is armed early by a share of what is left,
# and a wake-up that comes early just re-arms for the (now short) remainder.
EARLY_SHARE = 0.03
EARLY_FIXED = 30e-6
# Anything due within this long counts as due now: a timer for it would wake the loop later.
DUE_SLACK = 20e-6


class TimerQueue:
    """Callbacks at absolute monotonic times, woken by one timerfd in the asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._armed = float("inf")
        self.errors = 0
        # Default timer slack lets the kernel fire a timer up to 50 µs late; ask for none.
        _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        loop.add_reader(self.fd, self._fire)

    def close(self) -> None:
        """Stop and release the timerfd."""
        self.loop.remove_reader(self.fd)
        os.close(self.fd)

    def due(self, when: float) -> bool:
        """True when ``when`` has come (within DUE_SLACK): act now, no timer."""
        return when <= self.loop.time() + DUE_SLACK

    def at(self, when: float, cb: Callable[[], None]) -> None:
        """Call ``cb`` at monotonic time ``when``."""
        heapq.heappush(self._heap, (when, next(self._seq), cb))
        if when < self._armed:
            self._arm(when)

    def _arm(self, when: float) -> None:
        self._armed = when
        spec = _itimerspec()
        if when != float("inf"):
            left = when - self.loop.time()
            if left > EARLY_FIXED:
                when -= EARLY_SHARE * left + EARLY_FIXED
            sec = int(when)
            nsec = int((when - sec) * 1e9)
            if sec == 0 and nsec == 0:
                nsec = 1
            spec.it_value = _timespec(sec, nsec)
        _libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None)

    def _fire(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        now = self.loop.time()
        heap = self._heap
        try:
            while heap and heap[0][0] <= now + DUE_SLACK:
                _, _, cb = heapq.heappop(heap)
                try:
                    cb()
                except Exception as exc:  # noqa: BLE001 - one connection's failure must not stop the others
                    # A callback that raised used to skip the re-arm below: the timerfd then never
                    # fired again and every connection and packet of the cluster froze for good.
                    self.errors += 1
                    self.loop.call_exception_handler({"message": "nbox delay timer: a release failed", "exception": exc})
        finally:
            self._arm(heap[0][0] if heap else float("inf"))


# ---- one direction of a connection ----------------------------------------------------------
class _Pipe:
    """Bytes from one side to the other, each chunk released ``delay`` (+ jitter) after it arrived."""

    def __init__(self, relay: "Relay", delays: Callable[[], tuple[float, float]]):
        self.relay = relay
        # Looked up per chunk, so a change made while a connection runs applies to it at once
        # (long-lived connections, such as a training job's, are the ones that matter).
        self.delays = delays
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: deque[tuple[float, bytes | None]] = deque()
        self.queued = 0
        self.last = 0.0
        self.scheduled = False
        self.paused_src = False
        self.dst_blocked = False
        self.closed = False
        self.eof_queued = False
        self.finished = False
        self.on_finish: Callable[[], None] = lambda: None

    def feed(self, data: bytes | None) -> None:
        """Queue a chunk (None is end of stream)."""
        if self.eof_queued:
            return
        if data is None:
            self.eof_queued = True
        now = self.relay.loop.time()
        delay, jitter = self.delays()
        t = now + delay
        if jitter:
            t += random.uniform(-jitter, jitter)
        # A stream cannot reorder: a chunk never leaves before the one ahead of it.
        t = max(t, self.last, now)
        self.last = t
        self.queue.append((t, data))
        if data:
            self.queued += len(data)
            self.relay.bytes += len(data)
            if self.queued > HIGH_WATER and self.src is not None and not self.paused_src:
                self.paused_src = True
                self.src.pause_reading()
        self._schedule()

    def _schedule(self) -> None:
        if self.scheduled or not self.queue or self.dst is None or self.dst_blocked:
            return
        self.scheduled = True
        if self.relay.timers.due(self.queue[0][0]):
            # Due already (no delay left to hold): out now, not after a trip through the timer,
            # which cost every chunk a wake-up of the loop (tens of µs on the path's own latency).
            self._release()
        else:
            self.relay.timers.at(self.queue[0][0], self._release)

    def _release(self) -> None:
        self.scheduled = False
        if self.dst is None or self.closed:
            return
        now = self.relay.loop.time() + DUE_SLACK
        out: list[bytes] = []
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            if data is None:
                if out:
                    try:
                        self.dst.writelines(out)
                    except (OSError, RuntimeError):
                        pass  # _eof below finds the transport closing, or aborts it
                    out = []
                self._eof()
                return
            out.append(data)
            self.queued -= len(data)
        if out:
            try:
                self.dst.writelines(out)
            except (OSError, RuntimeError):
                # The far side is gone (or half-closed) under us: drop this direction.
                self.dst.abort()
                self.finish()
                return
        if self.paused_src and self.queued < LOW_WATER and self.src is not None:
            self.paused_src = False
            self.src.resume_reading()
        self._schedule()

    def _eof(self) -> None:
        if not self.dst.is_closing():
            try:
                if self.dst.can_write_eof():
                    self.dst.write_eof()
                else:
                    self.dst.close()
            except OSError:
                # The far side reset while its EOF waited out the delay (shutdown: ENOTCONN),
                # and the loop has not seen the reset yet: nothing more can reach it.
                self.dst.abort()
        self.finish()

    def finish(self) -> None:
        """This direction carries nothing more."""
        if not self.finished:
            self.finished = True
            self.queue.clear()
            self.on_finish()

    def attach_dst(self, dst: asyncio.Transport) -> None:
        """The far side is connected: start releasing."""
        self.dst = dst
        self._schedule()

    def blocked(self, yes: bool) -> None:
        """The far side's send buffer is full (or drained again)."""
        self.dst_blocked = yes
        if not yes:
            self._schedule()


class _Side(asyncio.Protocol):
    """One socket of a relayed connection; reads go into ``inbound``, writes come from ``outbound``.

    Either may be None where the connection is split between two relays: this relay then only
    writes to the socket (its reads belong to the other relay, which holds the same socket) or
    only reads from it.
    """

    def __init__(self, conn: "_Conn", inbound: _Pipe | None, outbound: _Pipe | None):
        self.conn = conn
        self.inbound = inbound
        self.outbound = outbound
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.inbound is None:
            transport.pause_reading()  # before the loop first polls it: the other relay reads here
        else:
            self.inbound.src = transport
        if self.outbound is not None:
            self.outbound.attach_dst(transport)

    def data_received(self, data: bytes) -> None:
        self.inbound.feed(data)

    def eof_received(self) -> bool:
        self.inbound.feed(None)
        return True  # keep the write half open: the other direction may still be flowing

    def pause_writing(self) -> None:
        if self.outbound is not None:
            self.outbound.blocked(True)

    def resume_writing(self) -> None:
        if self.outbound is not None:
            self.outbound.blocked(False)

    def connection_lost(self, exc) -> None:
        self.conn.lost(self)


class _Conn:
    """A relayed connection: client side, server side and its delay lines (``up``, ``down`` or both)."""

    def __init__(self, relay: "Relay", key: str, dst: str, up: bool = True, down: bool = True, counted: bool = False):
        self.relay = relay
        self.key = key
        self.counted = counted  # in relay.open[key] until its client side is lost

        def fwd() -> tuple[float, float]:
            d = relay.lookup(key, dst)
            return d.fwd, d.jitter_fwd

        def rev() -> tuple[float, float]:
            d = relay.lookup(key, dst)
            return d.rev, d.jitter_rev

        self.up = _Pipe(relay, fwd) if up else None
        self.down = _Pipe(relay, rev) if down else None
        self.client = _Side(self, self.up, self.down)
        self.server = _Side(self, self.down, self.up)
        for p in self.pipes():
            p.on_finish = self._maybe_done

    def pipes(self) -> list[_Pipe]:
        """The delay lines this relay runs for the connection."""
        return [p for p in (self.up, self.down) if p is not None]

    def lost(self, side: _Side) -> None:
        """One socket is gone: drain what it sent, send nothing more to it."""
        # What the lost side sent is still owed to the other side: its delay line drains and
        # then ends with EOF. Nothing more can reach the lost side.
        if side is self.client and self.counted:
            self.counted = False
            self.relay.open[self.key] -= 1
        if side.inbound is not None:
            side.inbound.feed(None)
        if side.outbound is not None:
            side.outbound.closed = True
            side.outbound.finish()

    def _maybe_done(self) -> None:
        if all(p.finished for p in self.pipes()):
            self.close()

    def close(self) -> None:
        """Close both sockets once what is buffered has been written (and a pending EOF sent)."""
        for s in (self.client, self.server):
            if s.transport is not None:
                self._close_flushed(s.transport)

    def _close_flushed(self, t: asyncio.Transport) -> None:
        # asyncio's close() with bytes still buffered drops a pending write_eof's shutdown and
        # only closes the descriptor: where the other relay holds a copy of the socket (a split
        # connection) no FIN ever leaves, and the peer waits for good. So wait for the buffer to
        # drain (asyncio then shuts down itself), and close after.
        if t.is_closing():
            return
        if t.get_write_buffer_size():
            self.relay.loop.call_later(0.001, self._close_flushed, t)
        else:
            t.close()


class Relay:
    """The transparent delaying TCP relay; one per cluster, listening in many namespaces."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, port: int = DEFAULT_PORT, mark: int = MARK,
                 peers: Peers | None = None):
        self.loop = loop or asyncio.get_event_loop()
        self.port = port
        self.mark = mark
        self.peers = peers
        self.timers = TimerQueue(self.loop)
        self.delays = DelayTable()
        self.servers: dict[str, asyncio.AbstractServer] = {}
        self.namespaces: dict[str, object] = {}
        self.connections = 0
        self.bytes = 0
        self.errors = 0
        self.refused = 0  # connections closed at once: turned on the relay itself, or over a node's cap
        self.open: dict[str, int] = {}  # per namespace key: connections accepted and not yet lost

    def set_delays(self, key: str, table: dict[str, Delays]) -> None:
        """Replace the per-destination delays of the namespace ``key`` (open connections follow at once)."""
        self.delays.set(key, table)

    def lookup(self, key: str, dst: str) -> Delays:
        """The delays from namespace ``key`` to address ``dst`` now."""
        return self.delays.lookup(key, dst)

    async def listen(self, key: str, ns=None, host: str = "0.0.0.0") -> int:
        """Listen inside namespace ``ns`` (a ``namespace.Namespace``; None: this one); returns the port."""
        make = (lambda: ns.socket(socket.AF_INET, socket.SOCK_STREAM)) if ns is not None else (
            lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sock = make()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        self.namespaces[key] = ns
        self.servers[key] = await self.loop.create_server(lambda: self._accepted(key), sock=sock)
        return sock.getsockname()[1]

    def _accepted(self, key: str) -> asyncio.Protocol:
        relay = self

        class Accept(asyncio.Protocol):
            """Hands a fresh connection to the relay, which gives it its own protocol."""

            def connection_made(self, transport) -> None:
                relay._start(key, transport)

        return Accept()

    def _start(self, key: str, transport: asyncio.Transport) -> None:
        sock = transport.get_extra_info("socket")
        try:
            dst = original_dst(sock)
        except OSError:
            # Not a redirected connection (someone dialled the relay port directly).
            transport.abort()
            return
        if dst[1] == self.port or self.open.get(key, 0) >= MAX_CONNECTIONS_PER_NODE:
            # To a relay port: relayed on, it would come back to a relay, for ever. Over the
            # cap: the node has its share of descriptors.
            self.refused += 1
            transport.abort()
            return
        self.open[key] = self.open.get(key, 0) + 1
        # The relay releases bytes when their delay is up; Nagle on its client side would hold
        # small releases back for the client's delayed ACK (tens to hundreds of ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The way back is copied by the relay on the destination node's CPU, where there is one.
        home = self.peers.home(dst[0]) if self.peers is not None else None
        conn = _Conn(self, key, dst[0], down=home is None, counted=True)
        # Hand the accepted transport over to the connection's client side. Until the upstream
        # connection is made the client's bytes wait in the up line; its reads start now.
        transport.set_protocol(conn.client)
        conn.client.connection_made(transport)
        self.connections += 1
        self.loop.create_task(self._connect(key, dst, conn, home))

    async def _connect(self, key: str, dst: tuple[str, int], conn: _Conn, home: int | None) -> None:
        ns = self.namespaces.get(key)
        try:
            up = ns.socket(socket.AF_INET, socket.SOCK_STREAM) if ns is not None else socket.socket()
            up.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up.setblocking(False)
            await self.loop.sock_connect(up, dst)
            if home is not None:
                # SCM_RIGHTS duplicates both sockets into the other relay, which reads the
                # upstream one and writes the client one; each side closes only its own copies.
                client = conn.client.transport.get_extra_info("socket")
                self.peers.hand_over(home, [client.fileno(), up.fileno()], {"key": key, "dst": dst[0]})
            await self.loop.create_connection(lambda: conn.server, sock=up)
        except OSError:
            self.errors += 1
            t = conn.client.transport
            if t is not None:
                t.abort()

    async def adopt(self, fds: list[int], key: str, dst: str) -> None:
        """Run the way back of a connection another relay accepted: read its upstream socket, write its client."""
        conn = _Conn(self, key, dst, up=False)
        client, up = (socket.socket(fileno=fd) for fd in fds)
        try:
            for s in (client, up):
                s.setblocking(False)
            await self.loop.connect_accepted_socket(lambda: conn.client, sock=client)
            await self.loop.connect_accepted_socket(lambda: conn.server, sock=up)
        except OSError:
            self.errors += 1
            client.close()
            up.close()

    def close(self) -> None:
        """Stop listening."""
        for s in self.servers.values():
            s.close()
        self.timers.close()
