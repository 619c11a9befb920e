"""Wire mode: the real rank's collective bytes cross its shaped links to stub peers.

The real rank executes its own part of each collective's ring schedule over TCP; the stub
peers (``neuronabox.cluster.stub``, one process per node, started with the cluster) stand in
for the emulated neighbours in their namespaces. This module holds the real rank's client;
it imports torch only inside the client's methods.

The protocol (two planes, the frames, the hello) is described in ``neuronabox.wireproto``.

Timing: the stub's send times are the model's per-step schedule (``Estimate.steps()``, the
steps whose destination is the real rank) placed after the op's start as the emulated ranks
see it (its issue, or the end of the lane's op before it, then its spin stall; not when the
wire thread got to it and set it up) plus the emulated ranks' straggler delay, scaled so the
schedule spans the modeled duration (what-if injections included); a schedule without such
steps is spread evenly.
The real rank's own sends leave as soon as the ring's data dependencies allow, and its op
completes when it has received its last frame and written its own last one (gloo's
``waitSend``: a send is complete once the socket took its bytes, not when they arrived; the
receives already wait on the stub, whose frames wait on ours where the ring ties them). An
acknowledgement of our last frame cost 0.2-0.5 ms per op at 10 Gbit/s that the real ranks do
not spend.

Stalls: no wait of the real rank is unbounded. Every receive and send of an
op must come within ``NBOX_WIRE_TIMEOUT`` seconds (default 60) after the op's modeled end
(its start plus the model's duration, so a slow link or a big op gets the time the model
gives it); otherwise the op fails with an error that names the op, the frame and the stub,
and the training script sees it as the collective's exception instead of hanging.

Data semantics (mirror): every emulated rank holds the real rank's input, so the stub sends
the real rank's own input chunks. A reduce-scatter partial from the previous rank at ring
step k stands for k+1 identical contributions, which the real rank folds in with that
multiplicity (SUM: ``own + (k+1)·recv``); all-gather phases receive a chunk and apply the
n-fold reduction to it. So SUM gives x·n, AVG x, MAX/MIN x, PRODUCT x**n — the model mode's
results, reduced from bytes that really crossed the link.

Supported on CPU tensors: all_reduce, all_gather (into one tensor or a list), reduce_scatter,
broadcast, barrier. Others (all_to_all, gather, scatter, reduce, send/recv, CUDA tensors,
PREMUL_SUM/bitwise reductions, mixed dtypes) run in model mode, with one warning per op.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import time
import uuid
import warnings
from typing import Callable

from ..wireproto import (FRAME, HELLO, KIND_FROM_STUB, KIND_TO_STUB, MAGIC, SLICE, STUB_PORT, recv_exact, recv_msg,
                         send_msg)

__all__ = [
    "STUB_PORT", "HELLO", "FRAME", "send_msg", "recv_msg", "recv_exact", "WireClient", "WireStall", "ENV_WIRE",
    "ENV_CLUSTER", "ENV_TIMEOUT", "stall_timeout", "StubLocator", "use_stubs",
]

# node -> {"control": Unix socket path, "port": data port, "address": the node's address} of that
# node's stub, started if it is not. The cluster side provides it (neuronabox.cluster.stub.stub_locator),
# registered by the process's start-up (neuronabox.launcher.child) with ``use_stubs``: the
# emulator is given where the stubs are rather than importing the cluster.
StubLocator = Callable[[str], dict]
_locator_factory: "Callable[[str], StubLocator] | None" = None


def use_stubs(factory: "Callable[[str], StubLocator]") -> None:
    """Register how a cluster's stubs are found: ``factory(cluster)`` returns a ``StubLocator``."""
    global _locator_factory
    _locator_factory = factory


def _stub_locator(cluster: str) -> StubLocator:
    if _locator_factory is None:
        raise RuntimeError("nbox wire: NBOX_WIRE is set but this process was not started by nbox run "
                           "(no stub locator registered)")
    return _locator_factory(cluster)


ENV_WIRE = "NBOX_WIRE"
ENV_CLUSTER = "NBOX_CLUSTER"
ENV_TIMEOUT = "NBOX_WIRE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0  # s past an op's modeled end before a silent stub counts as stalled


class WireStall(ConnectionError):
    """A stub or the path to it made no progress within the wire timeout."""


def stall_timeout() -> float:
    """Seconds past an op's modeled end before the wire gives up (``NBOX_WIRE_TIMEOUT``, default 60)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from ..errors import InputError

        raise InputError(f"{ENV_TIMEOUT}: expected a positive number of seconds, got {raw!r}")
    return value


def _send_frames(sock: socket.socket, header: bytes, payload) -> None:
    sock.sendall(header)
    if payload is not None and len(payload):
        sock.sendall(payload)


# ---- the real rank's side ---------------------------------------------------------------------
class _Sender:
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


class _Peer:
    """The connections to one stub process: control, data to it, data from it."""

    def __init__(self, node: str, ctl: socket.socket, out: socket.socket, inp: socket.socket):
        self.node = node
        self.ctl = ctl
        self.out = out
        self.inp = inp
        self.sender = _Sender(out, f"nbox-wire-send-{node}", node)
        self.arena_size = 0


def _mv(t) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype; no numpy needed)."""
    import ctypes

    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _Job:
    """One collective for the wire thread: what to run and how to finish its work."""

    __slots__ = ("run", "work", "rec", "tl", "seq", "t0")

    def __init__(self, run, work, rec, tl):
        self.run = run
        self.work = work
        self.rec = rec
        self.tl = tl
        self.seq = 0


def _make_work_class():
    import torch
    import torch.distributed as dist

    class WireWork(dist.Work):
        """A collective whose bytes cross the wire: complete when the wire thread says so."""

        def __init__(self, rec, result):
            super().__init__()
            self.rec = rec
            self._result = result
            self._done = threading.Event()
            # What the backend's coalescing group (_GroupWork) reads from the works it joins.
            self._rec, self._event, self._device = rec, None, None
            self._future = self._chained = None
            self._error: BaseException | None = None
            self._lock = threading.Lock()

        def _finish(self, error: BaseException | None = None) -> None:
            with self._lock:
                self._error = error
                self._done.set()
                fut = self._future
            if fut is not None:
                fut.set_result(None)  # the chained future returns the result or raises the error

        def wait(self, timeout=None) -> bool:
            """Block until the real transfer is over."""
            from .timeline import clock

            t = clock()
            limit = timeout.total_seconds() if timeout else None
            if not self._done.wait(limit or None):
                raise RuntimeError(f"nbox wire: {self.rec.op.value} timed out after {limit:.3f}s")
            self.rec.wait += clock() - t
            if self._error is not None:
                raise RuntimeError(f"nbox wire: {self.rec.op.value} failed: {self._error}")
            return True

        def synchronize(self) -> None:
            """Like ``wait``."""
            self.wait()

        def block_current_stream(self) -> None:
            """CPU only: wait."""
            self.wait()

        def is_completed(self) -> bool:
            """Whether the transfer is over."""
            return self._done.is_set()

        def is_success(self) -> bool:
            """Whether it completed without error."""
            return self._done.is_set() and self._error is None

        def exception(self):
            """The error, if it failed."""
            return self._error

        def result(self):
            """The output tensors."""
            return self._result

        def source_rank(self) -> int:
            """Not a recv."""
            return -1

        def get_future(self) -> torch.futures.Future:
            """A future completed by the wire thread with the output tensors."""
            with self._lock:
                if self._chained is None:
                    # DDP's reducer crashes (torch 2.13) on a future failed with set_exception from
                    # Python; an error raised in a then-callback reaches it as a clean exception.
                    self._future = torch.futures.Future()
                    self._chained = self._future.then(self._outcome)
                    if self._done.is_set():
                        self._future.set_result(None)
                return self._chained

        def _outcome(self, _base):
            if self._error is not None:
                raise RuntimeError(f"nbox wire: {self.rec.op.value} failed: {self._error}") from self._error
            return self._result

    return WireWork


class WireClient:
    """The real rank's end of wire mode: a wire thread per lane, each lane its own session with the stubs.

    Gloo runs a process group's ops on two worker threads, so a second op moves its bytes while
    the first still does (and fills the link time the first leaves idle). Wire mode does the
    same: ``lanes`` threads take ops from one queue in order, each with its own session
    (connections, sequence numbers, arena) to the stubs, which serve any number of sessions.
    The first lane is the client the backend calls; the others only run ops.
    """

    def __init__(self, emulator, cluster: str, lanes: int = 1, _front: "WireClient | None" = None,
                 locate: "StubLocator | None" = None):
        self.emu = emulator
        self.cluster = cluster
        if locate is None:
            locate = _front._locate if _front is not None else _stub_locator(cluster)
        self._locate = locate
        self.session = uuid.uuid4().int & ((1 << 63) - 1)
        self.peers: dict[str, _Peer] = {}
        self.q: queue.SimpleQueue = _front.q if _front is not None else queue.SimpleQueue()
        # The first failed op's error, for every lane: the streams are out of step after it.
        self._failed: list[BaseException] = _front._failed if _front is not None else []
        self.warned: set[str] = set()
        self.seq = 0
        self.arena = None
        self.arena_fd = -1
        self.arena_size = 0
        self._tmp = None
        self._steps: dict = {}
        self.stall = stall_timeout()
        self._deadline = float("inf")  # monotonic: the current op's modeled end plus the stall timeout
        self._op = ""
        self._Work = _make_work_class()
        self.lanes: list[WireClient] = [self]
        if _front is None:
            self.lanes += [WireClient(emulator, cluster, _front=self, locate=locate) for _ in range(max(1, lanes) - 1)]
        self._thread = threading.Thread(target=self._loop, name=f"nbox-wire{'' if _front is None else len(_front.lanes)}",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        if _front is None:
            # The wire threads run torch ops; left running into interpreter shutdown they can meet
            # torch's static destructors and abort the process ("terminate called without an active exception").
            atexit.register(self.close)

    @property
    def broken(self) -> BaseException | None:
        """The first failed op's error (any lane's), or None."""
        return self._failed[0] if self._failed else None

    @classmethod
    def from_env(cls, emulator) -> "WireClient | None":
        """A client when ``NBOX_WIRE`` asks for wire mode (``nbox run --cluster N --mode wire``), else None."""
        if not os.environ.get(ENV_WIRE):
            return None
        cluster = os.environ.get(ENV_CLUSTER)
        if not cluster:
            raise RuntimeError("nbox wire: NBOX_WIRE is set but NBOX_CLUSTER names no cluster")
        lib = emulator.topology.emulation
        return cls(emulator, cluster, lanes=lib.gloo_threads if lib.library == "gloo" else 1)

    # ---- fallbacks ---------------------------------------------------------------------------
    def fallback(self, what: str) -> None:
        """Warn once that ``what`` runs in model mode."""
        if what not in self.warned:
            self.warned.add(what)
            warnings.warn(f"nbox wire: {what} has no wire schedule here; it runs in model mode", RuntimeWarning,
                          stacklevel=4)

    # ---- ring geometry -----------------------------------------------------------------------
    def _ring(self, pg):
        """(ring order of group ranks, my position, prev global rank, next global rank)."""
        rank_node = self.emu.topology.rank_node
        glob = pg.global_ranks
        order = sorted(range(len(glob)), key=lambda i: (rank_node[glob[i]], glob[i]))  # alpha-beta's ring order
        me = order.index(pg.rank())
        n = len(order)
        return order, me, glob[order[(me - 1) % n]], glob[order[(me + 1) % n]]

    def _node(self, rank: int) -> str:
        return self.emu.topology.node_of(rank).name

    def _peer(self, node: str) -> _Peer:
        p = self.peers.get(node)
        if p is not None:
            return p
        info = self._locate(node)
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ctl.settimeout(self.stall)
        try:
            ctl.connect(info["control"])
            send_msg(ctl, {"t": "hello", "session": self.session, "rank": self.emu.real_rank, "clock": time.perf_counter()})
            reply, _ = recv_msg(ctl)
        except TimeoutError:
            raise WireStall(f"nbox wire: the stub on {node} did not answer within {self.stall:g} s "
                            f"({ENV_TIMEOUT}); see its log in the cluster's state directory") from None
        if not reply or reply.get("t") != "ok":
            raise ConnectionError(f"nbox wire: stub on {node} refused the session: {reply}")
        addr = info["address"]
        socks = []
        for kind in (KIND_TO_STUB, KIND_FROM_STUB):
            s = socket.create_connection((addr, info["port"]), timeout=self.stall)
            # Sends are bounded by the stall timeout (a frame is at most SLICE bytes); receives
            # set their own timeout from the op's deadline.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(HELLO.pack(MAGIC, self.session, kind))
            socks.append(s)
        p = _Peer(node, ctl, socks[0], socks[1])
        self.peers[node] = p
        return p

    def _ensure_arena(self, size: int) -> None:
        import mmap

        if size <= self.arena_size:
            return
        size = max(1 << 20, 1 << (size - 1).bit_length())
        fd = os.memfd_create("nbox-wire-arena", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        old, oldfd = self.arena, self.arena_fd
        self.arena, self.arena_fd, self.arena_size = mm, fd, size
        for p in self.peers.values():
            self._share_arena(p)
        if old is not None:
            # The stubs hold their own mappings; ours of the old arena can go.
            try:
                old.close()
            except BufferError:
                pass
            os.close(oldfd)

    def _share_arena(self, p: _Peer) -> None:
        if self.arena is not None and p.arena_size != self.arena_size:
            send_msg(p.ctl, {"t": "arena", "size": self.arena_size}, [self.arena_fd])
            p.arena_size = self.arena_size

    def _publish(self, flat_bytes) -> None:
        """Copy the real rank's input bytes into the arena (the stubs' mirror data)."""
        import torch

        n = flat_bytes.numel()
        if n == 0:
            return
        self._ensure_arena(n)
        torch.frombuffer(self.arena, dtype=torch.uint8, count=n).copy_(flat_bytes)

    def _scratch(self, nbytes: int):
        import torch

        if self._tmp is None or self._tmp.numel() < nbytes:
            self._tmp = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return self._tmp

    # ---- the stubs' schedule from the model ------------------------------------------------
    def _times(self, tl, op, nbytes: int, root: int, prev: int, me_global: int, count: int, rec) -> list[float]:
        """Offsets (s from the op's start) at which the previous rank's ``count`` transfers to us may leave."""
        key = (tl.group, op, nbytes, root, prev, me_global, count)
        base = self._steps.get(key)
        if base is None:
            try:
                est = tl.model.estimate(op, nbytes, tl.group, root)
                starts = sorted(s.start for s in est.steps() if s.src == prev and s.dst == me_global)
                span = max((s.end for s in est.steps()), default=0.0)
            except Exception:  # noqa: BLE001 - a model without a schedule: spread evenly below
                starts, span = [], 0.0
            if len(starts) != count:
                # This model's algorithm is not the ring the wire runs: keep its duration, ring's shape.
                span = 1.0
                starts = [k / max(count, 1) for k in range(count)]
            base = (starts, span)
            if len(self._steps) < 4096:
                self._steps[key] = base
        starts, span = base
        scale = rec.duration / span if span > 0 else 0.0
        return [s * scale for s in starts]

    # ---- issuing (the backend's hooks call these on the caller's thread) ----------------------
    def _cpu_dense(self, tensors) -> bool:
        return bool(tensors) and all(t.device.type == "cpu" and not t.is_sparse for t in tensors)

    def _reducible(self, redop, dtype) -> bool:
        import torch
        import torch.distributed as dist

        kind = redop.op if hasattr(redop, "op") else redop
        R = dist.ReduceOp.RedOpType
        if dtype == torch.bool or dtype.is_complex:
            return False
        return kind in (R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT)

    def _submit(self, pg, op, nbytes: int, root: int, result, run) -> object:
        rec = pg.timeline.schedule(op, nbytes, root)
        rec.algorithm = f"wire/{rec.algorithm}"
        work = self._Work(rec, result)
        self.q.put(_Job(run, work, rec, pg.timeline))
        return work

    def allreduce(self, pg, tensors, redop):
        """All-reduce on the wire (ring), or None to fall back to model mode."""
        from ..collectives import Op

        if pg.size() == 1 or not self._cpu_dense(tensors) or len({t.dtype for t in tensors}) != 1:
            return None
        if not self._reducible(redop, tensors[0].dtype):
            self.fallback(f"all_reduce with {getattr(redop, 'op', redop)}")
            return None
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._submit(pg, Op.ALL_REDUCE, nbytes, 0, tensors,
                            lambda lane, job: lane._run_allreduce(job, pg, tensors, redop))

    def reduce_scatter(self, pg, output, inputs, redop, result=None):
        """Reduce-scatter into ``output`` from ``inputs`` (one tensor of n chunks, or a list of n)."""
        from ..collectives import Op

        ins = inputs if isinstance(inputs, (list, tuple)) else [inputs]
        if pg.size() == 1 or not self._cpu_dense([output, *ins]) or len({t.dtype for t in [output, *ins]}) != 1:
            return None
        if not self._reducible(redop, output.dtype):
            self.fallback(f"reduce_scatter with {getattr(redop, 'op', redop)}")
            return None
        nbytes = sum(t.numel() * t.element_size() for t in ins)
        if nbytes != output.numel() * output.element_size() * pg.size():
            return None
        return self._submit(pg, Op.REDUCE_SCATTER, nbytes, 0, [output] if result is None else result,
                            lambda lane, job: lane._run_reduce_scatter(job, pg, output, ins, redop))

    def all_gather(self, pg, outputs, inp, result=None):
        """All-gather ``inp`` into ``outputs`` (one tensor of n chunks, or a list of n)."""
        from ..collectives import Op

        outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        if pg.size() == 1 or not self._cpu_dense([*outs, inp]):
            return None
        nbytes = sum(t.numel() * t.element_size() for t in outs)
        if nbytes != inp.numel() * inp.element_size() * pg.size():
            return None
        return self._submit(pg, Op.ALL_GATHER, nbytes, 0, [outputs] if result is None else result,
                            lambda lane, job: lane._run_all_gather(job, pg, outs, inp))

    def broadcast(self, pg, tensors, root: int):
        """Broadcast along the ring's chain from ``root`` (a group rank)."""
        from ..collectives import Op

        if pg.size() == 1 or not self._cpu_dense(tensors):
            return None
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._submit(pg, Op.BROADCAST, nbytes, root, tensors,
                            lambda lane, job: lane._run_broadcast(job, pg, tensors, root))

    def barrier(self, pg):
        """A ring barrier of empty frames."""
        from ..collectives import Op

        if pg.size() == 1:
            return None
        return self._submit(pg, Op.BARRIER, 0, 0, [], lambda lane, job: lane._run_barrier(job, pg))

    # ---- the wire thread ------------------------------------------------------------------
    def _loop(self) -> None:
        from .host_effects.spin_stall import wait_spinning
        from .timeline import clock

        import torch

        torch.set_grad_enabled(False)  # thread-local: the wire's arithmetic records no autograd graph
        free = 0.0  # when this lane's last op ended
        while True:
            job = self.q.get()
            if job is None:  # close(): no more work
                return
            picked = clock()
            self.seq += 1
            job.seq = self.seq
            rec = job.rec
            if rec.stall > 0:
                # Gloo's spin stall (spin_stall.py): the real rank's gloo would wait, spinning.
                wait_spinning(rec.stall, rec.spin)
            start = clock()
            # The emulated ranks' frames may leave from when the op could begin (issued, lane free,
            # stall over), not from when this thread got to it: its wake-up and the op's set-up
            # (the arena copy, the schedule) cost 0.1-0.3 ms that the emulated ranks do not wait.
            ready = rec.ready if rec.ready is not None else picked
            job.t0 = start - max(0.0, picked - max(ready, free))
            modeled = rec.duration + rec.extra
            self._deadline = time.monotonic() + (modeled if 0 <= modeled < 1e9 else 0.0) + self.stall
            self._op = f"{rec.op.value} #{job.seq} ({rec.nbytes} B)"
            err = None
            try:
                if self.broken is not None:
                    # The streams of a failed op are out of step: a later op could only read the
                    # wrong frames or wait for ones that never come.
                    raise ConnectionError(f"nbox wire: an earlier op failed: {self.broken}")
                job.run(self, job)
            except BaseException as exc:  # noqa: BLE001 - reported through the work
                err = exc
                self._failed.append(exc)
            end = free = clock()
            rec.start, rec.end, rec.completed = start, end, end
            with job.tl._lock:
                job.tl.last_end = max(job.tl.last_end, end)
            job.work._finish(err)

    def _left(self) -> float:
        """Seconds until the current op counts as stalled (never 0: a socket timeout of 0 means non-blocking)."""
        return max(1e-3, self._deadline - time.monotonic())

    def _stalled(self, p: _Peer, what: str) -> WireStall:
        return WireStall(f"nbox wire: {self._op} stalled: {what} from the stub on {p.node} within {self.stall:g} s of the "
                         f"op's modeled end ({ENV_TIMEOUT}); the stub or the path to it stopped (stub log: "
                         f"stub-{p.node}.log in the cluster's state directory)")

    def _announce(self, job, p: _Peer, sends: list[list]) -> None:
        p.ctl.settimeout(self._left())
        try:
            self._share_arena(p)
            send_msg(p.ctl, {"t": "op", "seq": job.seq, "op": job.rec.op.value, "sends": sends})
        except TimeoutError:
            raise self._stalled(p, "no room on the control socket") from None

    def _sent(self, p: _Peer) -> None:
        """Wait until every frame queued for the stub ``p`` has been written (an op's end, as gloo's ``waitSend``)."""
        p.sender.wait(deadline=self._deadline)

    def _recv_frame(self, p: _Peer, seq: int, step: int, dest: memoryview) -> None:
        p.inp.settimeout(self._left())
        try:
            head = recv_exact(p.inp, FRAME.size)
            if head is not None:
                s, k, n = FRAME.unpack(head)
                if (s, k) == (seq, step) and n == len(dest) and n:
                    recv_exact(p.inp, n, dest)
        except TimeoutError:
            raise self._stalled(p, f"no frame ({seq}, {step})") from None
        if head is None:
            raise ConnectionError(f"nbox wire: the stub on {p.node} closed the connection")
        if (s, k) != (seq, step) or n != len(dest):
            raise ConnectionError(
                f"nbox wire: expected frame ({seq}, {step}, {len(dest)} B) from {p.node}, got ({s}, {k}, {n} B)")

    def _neighbours(self, pg):
        order, me, prev, nxt = self._ring(pg)
        pp, pn = self._peer(self._node(prev)), self._peer(self._node(nxt))
        return order, me, prev, nxt, pp, pn

    def _t0(self, job) -> float:
        # The emulated ranks reach the op with us, or later by the straggler delay.
        return job.t0 + job.rec.extra

    def _pipeline(self, job, pg, chunks: list, arena_off, first: int, nsteps: int, receive) -> None:
        """A ring of ``nsteps`` steps over ``chunks`` (1-D tensors by chunk index), pipelined in slices.

        Step k receives chunk ``recv(k)`` from the previous rank and forwards it, once
        ``receive`` has stored it, as step k+1 to the next rank (in a ring the chunk received at
        step k is the one sent at step k+1); step 0 sends chunk ``first``. Slices (``SLICE``
        bytes) let step k+1 start before step k has fully arrived, as NCCL's ring does.
        """
        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        esize = chunks[first].element_size()
        J = max(1, -(-max(c.numel() for c in chunks) * esize // SLICE))

        def parts(c: int) -> list[tuple[int, int]]:
            m = chunks[c].numel()
            return [(m * j // J, m * (j + 1) // J) for j in range(J)]

        def recv_idx(k: int) -> int:
            return order[(me - 1 - k) % n] if first == order[me] else order[(me - 2 - k) % n]

        offs = self._times(job.tl, job.rec.op, job.rec.nbytes, 0, prev, pg.global_ranks[pg.rank()], nsteps, job.rec)
        two = pp is pn
        t0 = self._t0(job)
        sends = []
        for k in range(nsteps):
            c = recv_idx(k)
            for j, (lo, hi) in enumerate(parts(c)):
                # A 2-rank ring: the stub is also our next rank, whose slice j of step k is what
                # it got from us at step k-1.
                sends.append([t0 + offs[k], k * J + j, arena_off(c) + lo * esize, (hi - lo) * esize,
                              (k - 1) * J + j if two and k else -1])
        self._announce(job, pp, sends)
        seq, sender = job.seq, pn.sender
        tickets: dict[tuple[int, int], int] = {}
        for j, (lo, hi) in enumerate(parts(first)):
            tickets[(first, j)] = sender.put(FRAME.pack(seq, j, (hi - lo) * esize), _mv(chunks[first][lo:hi]))
        for k in range(nsteps):
            c = recv_idx(k)
            for j, (lo, hi) in enumerate(parts(c)):
                dst = chunks[c][lo:hi]
                sender.wait(tickets.get((c, j), 0), self._deadline)  # an earlier send of this slice must have left
                receive(k, dst, lambda buf: self._recv_frame(pp, seq, k * J + j, buf))
                if k + 1 < nsteps:
                    tickets[(c, j)] = sender.put(FRAME.pack(seq, (k + 1) * J + j, (hi - lo) * esize), _mv(dst))
        self._sent(pn)

    def _ring_reduce(self, job, pg, chunks: list, redop, allgather: bool, arena_off) -> None:
        """Ring reduce-scatter (then all-gather) over ``chunks``, reducing the received bytes for real."""
        import torch
        import torch.distributed as dist

        R = dist.ReduceOp.RedOpType
        kind = redop.op if hasattr(redop, "op") else redop
        n = pg.size()
        tmp_all = self._scratch(max(c.numel() for c in chunks) * chunks[0].element_size())

        def receive(k: int, dst, frame) -> None:
            tmp = tmp_all[: dst.numel() * dst.element_size()].view(dst.dtype)
            frame(_mv(tmp))
            if k < n - 1:  # reduce-scatter: the previous rank's partial stands for k+1 inputs equal to ours
                m = k + 1
                if kind in (R.SUM, R.AVG):
                    dst.add_(tmp, alpha=m)
                elif kind == R.MAX:
                    torch.maximum(dst, tmp, out=dst)
                elif kind == R.MIN:
                    torch.minimum(dst, tmp, out=dst)
                else:  # PRODUCT
                    dst.mul_(tmp.pow(m))
                if k == n - 2 and kind == R.AVG:
                    dst.div_(n)
            elif kind == R.SUM:  # all-gather: a finished chunk, the n-fold reduction of its input
                torch.mul(tmp, n, out=dst)
            elif kind == R.PRODUCT:
                torch.pow(tmp, n, out=dst)
            else:  # AVG, MAX, MIN of n equal values
                dst.copy_(tmp)

        order, me = self._ring(pg)[:2]
        first = order[(me - 1) % n]
        self._pipeline(job, pg, chunks, arena_off, first, (n - 1) * (2 if allgather else 1), receive)

    def _run_allreduce(self, job, pg, tensors, redop) -> None:
        import torch

        single = len(tensors) == 1 and tensors[0].is_contiguous()
        acc = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
        n, e, es = pg.size(), acc.numel(), acc.element_size()
        self._publish(acc.view(torch.uint8) if e else acc)
        bounds = [e * i // n for i in range(n + 1)]
        chunks = [acc[bounds[c] : bounds[c + 1]] for c in range(n)]
        self._ring_reduce(job, pg, chunks, redop, True, lambda c: bounds[c] * es)
        if not single:
            pos = 0
            for t in tensors:
                t.copy_(acc[pos : pos + t.numel()].view(t.shape))
                pos += t.numel()

    def _run_reduce_scatter(self, job, pg, output, ins, redop) -> None:
        import torch

        acc = torch.cat([t.reshape(-1) for t in ins]) if len(ins) > 1 else ins[0].reshape(-1).clone()
        n, m, es = pg.size(), output.numel(), acc.element_size()
        self._publish(acc.view(torch.uint8))
        chunks = [acc[c * m : (c + 1) * m] for c in range(n)]
        self._ring_reduce(job, pg, chunks, redop, False, lambda c: c * m * es)
        output.copy_(chunks[pg.rank()].view(output.shape))

    def _run_all_gather(self, job, pg, outs, inp) -> None:
        import torch

        n = pg.size()
        if len(outs) == 1:
            if not outs[0].is_contiguous():
                raise RuntimeError("nbox wire: all_gather into a non-contiguous tensor")
            flat, m = outs[0].view(-1), inp.numel()
            chunks = [flat[i * m : (i + 1) * m] for i in range(n)]
        else:
            if not all(o.is_contiguous() for o in outs):
                raise RuntimeError("nbox wire: all_gather into non-contiguous tensors")
            chunks = [o.view(-1) for o in outs]
        src = inp.reshape(-1).contiguous()
        self._publish(src.view(torch.uint8))
        mine = chunks[pg.rank()]
        if mine.data_ptr() != src.data_ptr():
            mine.copy_(src)
        # Every peer's chunk is its input, which mirror semantics says equals ours: arena offset 0.
        self._pipeline(job, pg, chunks, lambda c: 0, pg.rank(), n - 1, lambda k, dst, frame: frame(_mv(dst)))

    def _run_broadcast(self, job, pg, tensors, root: int) -> None:
        import torch

        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        buf = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
        raw = buf.view(torch.uint8) if buf.numel() else torch.empty(0, dtype=torch.uint8)
        size = raw.numel()
        slices = [(i, min(i + SLICE, size)) for i in range(0, size, SLICE)] or [(0, 0)]
        hop = (me - order.index(root)) % n  # our place in the chain from the root
        mv = _mv(raw)
        if hop > 0:
            # The previous rank forwards the root's data, which mirror semantics says is ours.
            self._publish(raw)
            offs = self._times(job.tl, job.rec.op, job.rec.nbytes, root, prev, pg.global_ranks[pg.rank()], 1, job.rec)
            t = self._t0(job) + offs[0]
            self._announce(job, pp, [[t, j, lo, hi - lo, -1] for j, (lo, hi) in enumerate(slices)])
        for j, (lo, hi) in enumerate(slices):
            if hop > 0:
                self._recv_frame(pp, job.seq, j, mv[lo:hi])
            if hop < n - 1:
                pn.sender.put(FRAME.pack(job.seq, j, hi - lo), mv[lo:hi])
        if hop < n - 1:
            self._sent(pn)
        if not single:
            pos = 0
            for t in tensors:
                t.copy_(buf[pos : pos + t.numel()].view(t.shape))
                pos += t.numel()

    def _run_barrier(self, job, pg) -> None:
        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        steps = 2 * (n - 1)
        offs = self._times(job.tl, job.rec.op, 0, 0, prev, pg.global_ranks[pg.rank()], steps, job.rec)
        two = pp is pn
        t0 = self._t0(job)
        self._announce(job, pp, [[t0 + offs[k], k, 0, 0, k - 1 if two and k else -1] for k in range(steps)])
        empty = memoryview(b"")
        for k in range(steps):
            pn.sender.put(FRAME.pack(job.seq, k, 0), None)
            self._recv_frame(pp, job.seq, k, empty)
        self._sent(pn)

    def close(self) -> None:
        """Stop the wire thread after the queued work and end the sessions (the stubs drop them)."""
        if self._closed:
            return
        self._closed = True
        for _ in self.lanes:
            self.q.put(None)
        for lane in self.lanes:
            lane._thread.join(timeout=10)
            for p in lane.peers.values():
                try:
                    send_msg(p.ctl, {"t": "bye"})
                except OSError:
                    pass
                p.sender.close()
