"""Wire mode: the real rank's collective bytes cross its shaped links to stub peers.

The real rank executes its own part of each collective's ring schedule over TCP; the stub
peers (``neuronabox.cluster.stub``, one process per node, started with the cluster) stand in
for the emulated neighbours in their namespaces. This module holds the real rank's client;
it imports torch only inside the client's methods.

The protocol (two planes, the frames, the hello) is described in ``neuronabox.wireproto``.
This module holds the client and its lanes (sessions, arena, the stubs' schedule, the wire
thread); beside it ``wire_env.py`` (switches, timeout, where the stubs are), ``wire_peer.py``
(the connections to one stub and their sender thread), ``wire_rings.py`` (the ring algorithms)
and ``wire_work.py`` (the ``Work`` an op returns).

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

from ..wireproto import FRAME, HELLO, KIND_FROM_STUB, KIND_TO_STUB, MAGIC, recv_exact, recv_msg, send_msg
from .wire_env import ENV_CLUSTER, ENV_TIMEOUT, ENV_WIRE, StubLocator, stall_timeout, stub_locator
from .wire_peer import StubPeer, WireStall
from .wire_rings import RingRuns
from .wire_work import make_work_class

__all__ = ["WireClient"]


class _Job:
    """One collective for the wire thread: what to run and how to finish its work."""

    __slots__ = ("run", "work", "rec", "tl", "seq", "t0")

    def __init__(self, run, work, rec, tl):
        self.run = run
        self.work = work
        self.rec = rec
        self.tl = tl
        self.seq = 0


class WireClient(RingRuns):
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
            locate = _front._locate if _front is not None else stub_locator(cluster)
        self._locate = locate
        self.session = uuid.uuid4().int & ((1 << 63) - 1)
        self.peers: dict[str, StubPeer] = {}
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
        self._Work = make_work_class()
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

    def _peer(self, node: str) -> StubPeer:
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
        p = StubPeer(node, ctl, socks[0], socks[1])
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

    def _share_arena(self, p: StubPeer) -> None:
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

    def _stalled(self, p: StubPeer, what: str) -> WireStall:
        return WireStall(f"nbox wire: {self._op} stalled: {what} from the stub on {p.node} within {self.stall:g} s of the "
                         f"op's modeled end ({ENV_TIMEOUT}); the stub or the path to it stopped (stub log: "
                         f"stub-{p.node}.log in the cluster's state directory)")

    def _announce(self, job, p: StubPeer, sends: list[list]) -> None:
        p.ctl.settimeout(self._left())
        try:
            self._share_arena(p)
            send_msg(p.ctl, {"t": "op", "seq": job.seq, "op": job.rec.op.value, "sends": sends})
        except TimeoutError:
            raise self._stalled(p, "no room on the control socket") from None

    def _sent(self, p: StubPeer) -> None:
        """Wait until every frame queued for the stub ``p`` has been written (an op's end, as gloo's ``waitSend``)."""
        p.sender.wait(deadline=self._deadline)

    def _recv_frame(self, p: StubPeer, seq: int, step: int, dest: memoryview) -> None:
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
