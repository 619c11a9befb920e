"""Hybrid collectives: several real ranks run a collective among themselves, the emulated ranks enter through the model.

When ``NBOX_REAL_RANKS`` names k >= 2 real ranks, every nbox process group that holds at
least two of them gets a ``HybridGroup``: the real members run the op for real (gloo over
``NBOX_REAL_STORE`` for CPU tensors, NCCL for CUDA tensors) and every real member completes
it at the same modeled instant.

Data (mirror semantics extended): inside a group, the emulated members, taken in group
order, are dealt round-robin to the real members in group order (the e-th emulated member
mirrors real member e mod k) and hold a copy of their mirror's data. Real member i thus
stands for ``c_i`` members (itself included): c_i = 1 + (n-k)//k, plus one for the first
(n-k) % k real members. SUM all-reduce gives sum_i c_i x_i (= real sum x n/k when k divides
n), AVG that divided by n, all-gather's chunk j is the tensor of j's mirror, and so on.

Timing (CPU path, documented in docs/guide/real-ranks.md): op i of a hybrid communicator starts at
max(latest real arrival, op i-1's modeled end) and ends at start + the model's duration for
the whole group; a real rank completes it at max(that end, when its real transfer finished,
its completion of op i-1). Each real rank's arrival (call time, plus the straggler hook's
delay) is shared through a small all-gather issued beside the data op on the same gloo
group, so neither blocks the caller. Completion goes through the timeline's Waker
(futures) or a sleep in ``Work.wait()``; the gloo threads only run the bookkeeping callbacks.

What the real members run for each op is in ``hybrid_gloo.py`` (CPU tensors) and
``hybrid_cuda.py`` (CUDA tensors, NCCL).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import json
import os
import socket
import threading
import time
from collections import deque
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..collectives import Op
from ..errors import InputError
from .mirror import UnsupportedCollective, no_grad_call
from .environ import ENV_REAL_RANKS, ENV_REAL_STORE, ENV_REAL_STORE_PREFIX, ENV_REAL_TIMEOUT
from .hybrid_gloo import GlooRules
from .timeline import OpRecord, Timeline, clock, sleep_until, tune_thread_timer_slack
from .work import NboxWork

__all__ = [
    "ENV_REAL_RANKS", "ENV_REAL_STORE", "ENV_REAL_STORE_PREFIX", "ENV_REAL_TIMEOUT",
    "HybridContext", "HybridGroup", "HybridWork", "RealRankError", "parse_real_ranks", "mirror_map",
]

DEFAULT_TIMEOUT_S = 300.0
EXIT_GRACE_S = 10.0  # how long a real rank waits at exit for the others (a dead one never comes)

_OPS = list(Op)
_OPCODE = {op: i for i, op in enumerate(_OPS)}
# Meta row of one real rank: arrival (shared clock), call time (shared clock), op, bytes, root, sequence number.
_ARRIVAL, _READY, _OPC, _NBYTES, _ROOT, _SEQ = range(6)
_META = 6


class RealRankError(RuntimeError):
    """Another real rank died, never arrived or did something else: the hybrid op cannot complete."""


def parse_real_ranks(text: str | None, world_size: int, real_rank: int) -> tuple[int, ...]:
    """``NBOX_REAL_RANKS`` ("0,1,...") as a sorted tuple; absent or empty: just ``real_rank``."""
    if not text or not text.strip():
        return (real_rank,)
    try:
        ranks = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise InputError(f"{ENV_REAL_RANKS}: {text!r} is not a comma-separated list of ranks") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise InputError(f"{ENV_REAL_RANKS}: rank {bad[0]} is outside the world of {world_size} ranks")
    if real_rank not in ranks:
        raise InputError(f"{ENV_REAL_RANKS}: {text!r} does not contain this process's rank {real_rank}")
    return tuple(ranks) if ranks else (real_rank,)


def mirror_map(n: int, real_members: Sequence[int]) -> list[int]:
    """For each group-local index, the index (into ``real_members``) of the real member it mirrors."""
    k = len(real_members)
    index = {j: i for i, j in enumerate(real_members)}
    out, e = [], 0
    for j in range(n):
        if j in index:
            out.append(index[j])
        else:
            out.append(e % k)
            e += 1
    return out


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _wall_offset() -> float:
    """time.time() - clock(), from the tightest of a few paired readings."""
    best = None
    for _ in range(5):
        a = clock()
        w = time.time()
        b = clock()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) / 2)
    return best[1]


class HybridContext:
    """One per process: the store shared by the real ranks, and a factory of hybrid groups."""

    def __init__(self, emulator, real_ranks: Sequence[int], store_addr: str, prefix: str, timeout: float):
        self.emu = emulator
        self.real_ranks = tuple(real_ranks)
        self.real_set = frozenset(real_ranks)
        self.me = emulator.real_rank
        self.timeout = timeout
        self.prefix = prefix
        host, sep, port = store_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InputError(f"{ENV_REAL_STORE}: {store_addr!r} is not HOST:PORT")
        self._addr = (host.strip("[]"), int(port))
        self._store = None
        self._lock = threading.Lock()
        self._count: dict[tuple[int, ...], int] = {}
        self.boot_id = _boot_id()
        self.wall_offset = _wall_offset()
        self.groups: list[HybridGroup] = []
        self.failed = False
        self._closed = False
        # Registered after torch's import, so it runs before torch's own teardown (atexit is LIFO).
        atexit.register(self.close)

    @classmethod
    def from_env(cls, emulator, real_ranks: Sequence[int]) -> "HybridContext":
        """The context that ``NBOX_REAL_STORE`` (required), ``NBOX_REAL_STORE_PREFIX`` and ``NBOX_REAL_TIMEOUT`` set."""
        addr = os.environ.get(ENV_REAL_STORE)
        if not addr:
            raise InputError(f"{ENV_REAL_STORE}: not set, but {ENV_REAL_RANKS} names {len(real_ranks)} real ranks")
        raw = os.environ.get(ENV_REAL_TIMEOUT, "")
        try:
            timeout = float(raw) if raw.strip() else DEFAULT_TIMEOUT_S
        except ValueError:
            raise InputError(f"{ENV_REAL_TIMEOUT}: {raw!r} is not a number of seconds") from None
        if timeout <= 0:
            raise InputError(f"{ENV_REAL_TIMEOUT}: {raw!r} must be positive")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = os.environ.get(ENV_REAL_STORE_PREFIX) or f"nbox-hybrid/{restart}/"
        return cls(emulator, real_ranks, addr, prefix, timeout)

    @property
    def store(self):
        """The client connection to the real ranks' store (opened on first use)."""
        if self._store is None:
            td = datetime.timedelta(seconds=self.timeout)
            try:
                raw = dist.TCPStore(self._addr[0], self._addr[1], is_master=False, timeout=td, wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001 - any connection failure gets one clear message
                raise RealRankError(
                    f"nbox: real rank {self.me} cannot reach the real ranks' store {ENV_REAL_STORE}="
                    f"{self._addr[0]}:{self._addr[1]} within {self.timeout:g}s: {exc}"
                ) from exc
            self._store = dist.PrefixStore(self.prefix, raw)
        return self._store

    def group_for(self, global_ranks: Sequence[int], group_rank: int) -> "HybridGroup | None":
        """A hybrid group when ``global_ranks`` holds at least two real ranks, else None (the single-real path)."""
        ranks = tuple(global_ranks)
        members = [j for j, g in enumerate(ranks) if g in self.real_set]
        if len(members) < 2:
            return None
        if group_rank not in members:
            raise RuntimeError(f"nbox: this process (rank {self.me}) is not a real member of group {ranks[:8]}")
        # SPMD: every real member creates the groups over the same ranks in the same order,
        # so (ranks, how many such groups came before) names the same group everywhere.
        with self._lock:
            count = self._count.get(ranks, 0)
            self._count[ranks] = count + 1
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        group = HybridGroup(self, ranks, group_rank, members, f"g{digest}.{count}")
        self.groups.append(group)
        return group

    def close(self, grace: float = EXIT_GRACE_S) -> None:
        """Leave together: wait (briefly) for the other real ranks to finish, then drop every gloo group.

        A gloo group left to interpreter teardown while a peer is closing its side aborts the
        process ("terminate called without an active exception"): its pair threads meet the
        closed sockets after their owners are gone. Dropping the groups once every real rank has
        reached this point closes the pairs in order. A peer that died does not arrive: after
        ``grace`` seconds the survivor drops its groups anyway.
        """
        if self._closed:
            return
        self._closed = True
        if self.groups and self._store is not None and not self.failed:
            try:
                self._store.set(f"exit/{self.me}", "1")
                self._store.wait([f"exit/{r}" for r in self.real_ranks], datetime.timedelta(seconds=grace))
            except Exception:  # noqa: BLE001 - a dead peer or a gone store: leave anyway
                pass
        for g in self.groups:
            g.release()
        self.groups.clear()
        gc.collect()


class _Fifo:
    """The hybrid ops of one timeline not yet resolved (start/end unknown) or not yet completed."""

    def __init__(self):
        self.lock = threading.RLock()
        self.unresolved: deque[HybridOp] = deque()
        self.uncompleted: deque[HybridOp] = deque()
        self.last_completion = float("-inf")
        self.seq = 0


class HybridGroup:
    """The real side of one nbox group with k >= 2 real members: gloo groups, the mirror map, the data rules."""

    def __init__(self, ctx: HybridContext, ranks: tuple[int, ...], group_rank: int, members: list[int], key: str):
        self.ctx = ctx
        self.ranks = ranks
        self.n = len(ranks)
        self.members = members  # group-local indices of the real members, in group order
        self.k = len(members)
        self.me = members.index(group_rank)  # my index among the real members (= my rank in the gloo groups)
        self.mirror = mirror_map(self.n, members)
        self.counts = [self.mirror.count(i) for i in range(self.k)]
        self.key = key
        self.real_world = [ranks[j] for j in members]
        self._mirror_index: dict[torch.device, torch.Tensor] = {}
        self._fifos: dict[int, _Fifo] = {}
        self._p2p: dict[tuple[int, int], Timeline] = {}
        self._warned_self_root = False
        self.peers = self._join()
        self.shared_offset = self._clock_offset()
        self.member_set = frozenset(members)
        # One gloo group carries the data ops and the small meta all-gathers beside them (a second
        # group measured no faster, and costs threads); metas may finish out of order, advance() sorts that.
        self.data = self.meta = self._gloo("data", threads=2)
        self.gloo_rules = GlooRules(self)
        self._cuda_rules = None

    # --- setup ----------------------------------------------------------------------------------

    def _join(self) -> dict[int, dict]:
        """Announce this rank and wait for the other real members; a clear error names who never came."""
        ctx, store = self.ctx, self.ctx.store
        mine = {"rank": ctx.me, "pid": os.getpid(), "host": socket.gethostname(), "boot": ctx.boot_id}
        store.set(f"{self.key}/here/{ctx.me}", json.dumps(mine))
        keys = [f"{self.key}/here/{r}" for r in self.real_world]
        try:
            store.wait(keys, datetime.timedelta(seconds=ctx.timeout))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError by version
            missing = [r for r, key in zip(self.real_world, keys) if not store.check([key])]
            raise RealRankError(
                f"nbox: real rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing)) or '?'} did not join "
                f"the communicator over ranks {_short(self.ranks)} within {ctx.timeout:g}s ({ENV_REAL_TIMEOUT}); "
                f"real rank {ctx.me} gives up"
            ) from exc
        return {r: json.loads(store.get(k)) for r, k in zip(self.real_world, keys)}

    def _clock_offset(self) -> float:
        # One machine (one boot): CLOCK_MONOTONIC is shared, times travel as they are. Several
        # machines: times travel as wall-clock seconds, which assumes synced clocks (NTP/PTP).
        if len({p["boot"] for p in self.peers.values()}) == 1:
            return 0.0
        return self.ctx.wall_offset

    def _gloo(self, name: str, threads: int):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self.ctx.timeout)
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._threads = threads
        store = dist.PrefixStore(f"{self.key}/{name}/", self.ctx.store)
        try:
            return dist.ProcessGroupGloo(store, self.me, self.k, opts)
        except Exception as exc:  # noqa: BLE001
            raise RealRankError(f"nbox: real rank {self.ctx.me}: connecting to real ranks {self.real_world} "
                                f"failed: {exc}") from exc

    def fifo(self, timeline: Timeline) -> _Fifo:
        """The pending hybrid ops of ``timeline``."""
        f = self._fifos.get(id(timeline))
        if f is None:
            f = self._fifos[id(timeline)] = _Fifo()
        return f

    def mirror_index(self, device: torch.device) -> torch.Tensor:
        """``mirror`` as an index tensor on ``device``."""
        t = self._mirror_index.get(device)
        if t is None:
            t = self._mirror_index[device] = torch.tensor(self.mirror, dtype=torch.long, device=device)
        return t

    def describe_peers(self, grace: float = 1.0) -> str:
        """Which other real members are gone (same machine: by pid) — for error messages.

        A killed peer's sockets close while it is still exiting: look again for up to ``grace`` seconds.
        """
        others = [r for r in self.real_world if r != self.ctx.me]
        local = {r: self.peers[r]["pid"] for r in others
                 if self.peers.get(r, {}).get("boot") == self.ctx.boot_id
                 and self.peers[r].get("host") == socket.gethostname()}
        deadline = clock() + (grace if local else 0.0)
        while True:
            gone = [f"real rank {r} (pid {pid}) died" for r, pid in local.items() if not _alive(pid)]
            if gone or clock() >= deadline:
                break
            time.sleep(0.05)
        if gone:
            return "; ".join(gone)
        return f"real rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} did not answer"

    # --- the op engine --------------------------------------------------------------------------

    def start(self, timeline: Timeline, op: Op, nbytes: int, root: int, result,
              p2p: tuple[int, int] | None = None) -> "HybridOp":
        """Record a hybrid op on ``timeline`` (FIFO position fixed now) and issue its meta exchange.

        ``p2p``: (the peer's index among the real members, the meta tag of this data direction).
        """
        rec = timeline._record(op, nbytes, root, clock())
        rec.ready = rec.enqueue
        fifo = self.fifo(timeline)
        with fifo.lock:
            seq = fifo.seq
            fifo.seq += 1
        h = HybridOp(self, timeline, fifo, rec, result, seq)
        off = self.shared_offset
        mine = torch.tensor(
            [rec.ready + rec.extra + off, rec.ready + off, _OPCODE[op], nbytes, root, seq], dtype=torch.float64
        )
        with fifo.lock:
            fifo.unresolved.append(h)
            fifo.uncompleted.append(h)
        self.ctx.emu.recorder.add(rec)
        if p2p is None:
            out = torch.empty(self.k * _META, dtype=torch.float64)
            h.meta_out = out
            h.meta_work = self.meta._allgather_base(out, mine)  # watched in finish(), with the data
        else:  # gloo's send/recv works have no futures: they are waited on in Work.wait()
            peer_meta = torch.empty(_META, dtype=torch.float64)
            h.meta_out = peer_meta
            h.mine = mine
            peer, tag = p2p
            h.lazy = [self.meta.send([mine], peer, tag), self.meta.recv([peer_meta], peer, tag)]
        return h

    def rooted(self, timeline: Timeline, op: Op, nbytes: int, root: int, result) -> tuple["HybridOp", int | None]:
        """Start an op with a root and wait for the meta exchange: the real ranks must agree on the root first.

        Returns the op and the root all agree on, or None when every real rank named itself
        (``broadcast_object_list`` and DTensor's scatter are routed that way by ``launch.install``):
        each then keeps the single-real-rank rule (data stays local).
        """
        h = self.start(timeline, op, nbytes, root, result)
        h.watch_meta(h.meta_work)
        h.meta_work = None
        h.meta_event.wait(self.ctx.timeout + 30.0)
        if h.error is not None:
            raise h.error
        if h.meta_rows is None:
            raise RealRankError(f"nbox: {self.describe_peers()}: {op.value} on {timeline.name} got no answer "
                                f"within {self.ctx.timeout:g}s")
        roots = [int(r[_ROOT]) for r in h.meta_rows]
        if len(set(roots)) == 1:
            return h, roots[0]
        if roots == self.members:
            return h, None
        h.fail(RealRankError(f"nbox: real ranks {self.real_world} called {op.value} on {timeline.name} with "
                             f"different roots {roots} (group-local)"))
        raise h.error

    def finish(self, h: "HybridOp", works: Sequence, post: Callable[[], None] | None = None) -> "HybridWork":
        """Attach the data works (and what to do once they are done) to ``h``; returns its Work."""
        h.post = post
        if h.lazy is not None:
            h.lazy.extend(works)
            return HybridWork(h)
        futs = [w.get_future() for w in works]
        meta = h.meta_work is not None
        if meta:
            futs.insert(0, h.meta_work.get_future())
            h.meta_work = None
        if not futs:
            h.data_finished()
        elif len(futs) == 1 and meta:
            h.data_finished()
            futs[0].add_done_callback(h._on_meta)
        else:
            # One callback (one trip through the GIL on a gloo thread) for the meta and the data.
            h.with_meta = meta
            torch.futures.collect_all(futs).add_done_callback(h._on_all)
        return HybridWork(h)

    def release(self) -> None:
        """Drop this group's gloo group (its destructor joins the pair threads)."""
        self.data = self.meta = None
        self.gloo_rules = None

    def abort(self) -> None:
        """Stop this group's gloo group after a failure (its threads would otherwise abort on the broken pairs at exit)."""
        try:
            self.data.abort()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    def rules(self, device: torch.device):
        """How this group runs ops on ``device``: gloo for CPU tensors, NCCL for CUDA ones."""
        if device.type == "cpu":
            return self.gloo_rules
        if device.type == "cuda":
            if self._cuda_rules is None:
                from .hybrid_cuda import NcclRules  # untested: CI has no GPU

                self._cuda_rules = NcclRules(self)
            return self._cuda_rules
        raise UnsupportedCollective(f"nbox: hybrid collectives on {device.type} tensors are not supported")


def _alive(pid) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False  # gone from /proc
    except (ValueError, TypeError, IndexError):
        return True  # cannot tell: do not claim it died
    return state not in ("Z", "X")


def _short(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}] ({len(ranks)})"


class HybridOp:
    """One hybrid op: its record, meta and data works, and when it completes on this rank."""

    __slots__ = (
        "g", "tl", "fifo", "rec", "result", "seq", "meta_out", "meta_rows", "mine", "lazy", "post",
        "meta_done", "data_done", "resolved", "error", "completion", "scheduled", "meta_event",
        "future", "_base", "_armed", "_lock", "meta_work", "with_meta",
    )

    def __init__(self, g: HybridGroup, tl: Timeline, fifo: _Fifo, rec: OpRecord, result, seq: int):
        self.g, self.tl, self.fifo, self.rec, self.result, self.seq = g, tl, fifo, rec, result, seq
        self.meta_out = self.meta_rows = self.mine = self.lazy = self.post = None
        self.meta_done = False
        self.data_done: float | None = None
        self.resolved = False
        self.error: BaseException | None = None
        self.completion: float | None = None
        self.scheduled = threading.Event()
        self.meta_event = threading.Event()
        self.future: torch.futures.Future | None = None
        self._base: torch.futures.Future | None = None
        self._armed = False  # whether the base future has been handed to _arm (it completes once)
        self._lock = threading.Lock()
        self.meta_work = None
        self.with_meta = False

    # --- callbacks from gloo's threads (or inline when the work is already done) -----------------

    def watch_meta(self, work) -> None:
        """Take the meta exchange when ``work`` finishes."""
        work.get_future().add_done_callback(self._on_meta)

    def _on_meta(self, fut) -> None:
        try:
            fut.value()
            self._take_meta(self.meta_out.view(self.g.k, _META).tolist())
        except BaseException as exc:  # noqa: BLE001 - every failure must reach Work.wait()
            self.fail(exc)
        self.meta_event.set()
        self.advance()

    def _on_all(self, fut) -> None:
        """The meta (when ``with_meta``) and every data work are done."""
        try:
            for f in fut.value():
                f.value()
            if self.with_meta:
                self._take_meta(self.meta_out.view(self.g.k, _META).tolist())
        except BaseException as exc:  # noqa: BLE001 - every failure must reach Work.wait()
            self.fail(exc)
        self.meta_event.set()
        self.data_finished()

    def _take_meta(self, rows: list[list[float]]) -> None:
        mine = rows[self.g.me]
        for r, row in zip(self.g.real_world, rows):
            same = row[_OPC] == mine[_OPC] and row[_SEQ] == mine[_SEQ]
            if same and self.rec.op is not Op.ALL_TO_ALL and self.rec.op is not Op.SEND_RECV:
                same = row[_NBYTES] == mine[_NBYTES]
            if not same:
                raise RealRankError(
                    f"nbox: real ranks diverged on {self.tl.name}: real rank {self.g.ctx.me} called "
                    f"{_OPS[int(mine[_OPC])].value} #{int(mine[_SEQ])} of {int(mine[_NBYTES])} B, real rank {r} called "
                    f"{_OPS[int(row[_OPC])].value} #{int(row[_SEQ])} of {int(row[_NBYTES])} B"
                )
        self.meta_rows = rows
        self.meta_done = True

    def data_finished(self) -> None:
        """Every data work is done: run the post-processing (mirror copies), note the time, advance."""
        if self.post is not None and self.error is None:
            try:
                no_grad_call(self.post)
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc)
        self.data_done = clock()
        self.advance()

    def fail(self, exc: BaseException) -> None:
        """Remember the first failure, worded for the user."""
        if self.error is not None:
            return
        self.g.ctx.failed = True  # a broken peer will not meet us at exit
        if isinstance(exc, RealRankError):
            self.error = exc
            return
        rec = self.rec
        self.error = RealRankError(
            f"nbox: {rec.op.value} #{self.seq} on {rec.comm} (real ranks {self.g.real_world}) failed on real rank "
            f"{self.g.ctx.me}: {self.g.describe_peers()}: {type(exc).__name__}: {str(exc).strip()[:400]}"
        )
        self.error.__cause__ = exc

    # --- FIFO resolution ---------------------------------------------------------------------------

    def advance(self) -> None:
        """Resolve (start, end) and schedule completions of this timeline's ops, in FIFO order."""
        fifo = self.fifo
        fire: list[HybridOp] = []
        with fifo.lock:
            while fifo.unresolved and (fifo.unresolved[0].meta_done or fifo.unresolved[0].error is not None):
                fifo.unresolved.popleft()._resolve()
            while fifo.uncompleted:
                h = fifo.uncompleted[0]
                if h.error is None and not (h.resolved and h.data_done is not None):
                    break
                fifo.uncompleted.popleft()
                if h.error is None:
                    h.completion = max(h.rec.end, h.data_done, fifo.last_completion)
                    fifo.last_completion = h.completion
                else:
                    h.completion = clock()
                fire.append(h)
        for h in fire:
            h._schedule()

    def _resolve(self) -> None:
        # Called in FIFO order under the fifo lock: the timeline's last_end is op i-1's end.
        self.resolved = True
        if self.error is not None:
            return
        rec, tl, off = self.rec, self.tl, self.g.shared_offset
        arrival = max(row[_ARRIVAL] for row in self.meta_rows) - off
        nbytes = int(max(row[_NBYTES] for row in self.meta_rows))
        if nbytes != rec.nbytes:  # uneven all-to-all: the model sees the largest buffer
            rec.nbytes = nbytes
            rec.duration, rec.algorithm = tl.estimate(rec.op, nbytes, rec.root)
        tl.place(rec, arrival)

    def _schedule(self) -> None:
        # The future is armed exactly once: by whichever of _schedule and get_future comes second.
        with self._lock:
            self.scheduled.set()
            base = self._base if not self._armed else None
            self._armed = self._armed or base is not None
        if base is not None:
            self._arm(base)

    def _arm(self, base: torch.futures.Future) -> None:
        if self.error is not None:
            base.set_result(None)  # the child future (``get_future``) raises the error
            return
        rec = self.rec

        def complete(now: float) -> None:
            if rec.completed is None:
                rec.completed = now
            base.set_result(None)

        if clock() >= self.completion:
            complete(clock())
        else:
            self.g.ctx.emu.waker.at(self.completion, complete)

    def get_future(self) -> torch.futures.Future:
        """A future completed at this rank's completion instant (or with the failure)."""
        if self.lazy is not None:
            raise UnsupportedCollective("nbox: send/recv between two real ranks has no future (as with gloo): "
                                        "call wait() on the work")
        with self._lock:
            if self.future is not None:
                return self.future
            # DDP's reducer crashes (torch 2.13) on a future failed with set_exception from Python;
            # an error raised in a then-callback reaches it as a clean exception.
            self._base = base = torch.futures.Future()
            self.future = base.then(self._outcome)
            armed = self.scheduled.is_set() and not self._armed
            self._armed = self._armed or armed
        if armed:
            self._arm(base)
        return self.future

    def _outcome(self, _base):
        if self.error is not None:
            raise self.error
        return self.result

    # --- waiting in the caller ----------------------------------------------------------------------

    def run_lazy(self, timeout: float | None) -> None:
        """p2p: wait for the gloo send/recv works (no futures), then resolve like the callbacks would."""
        if self.lazy is None or self.data_done is not None:
            return
        # FIFO: earlier p2p ops of this direction resolve first.
        with self.fifo.lock:
            before = list(self.fifo.unresolved)
        for h in before:
            if h is self:
                break
            h.run_lazy(timeout)
        works, self.lazy = self.lazy, []
        try:
            for w in works:
                w.wait(datetime.timedelta(seconds=timeout)) if timeout else w.wait()
            row = self.meta_out.tolist()
            mine = self.mine.tolist()
            if row[_OPC] != mine[_OPC]:
                raise RealRankError(f"nbox: real ranks diverged on {self.tl.name}: op #{self.seq} is "
                                    f"{_OPS[int(mine[_OPC])].value} here and {_OPS[int(row[_OPC])].value} at the peer")
            self.meta_rows = [mine, row]
            self.meta_done = True
            if self.post is not None:
                no_grad_call(self.post)
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
        self.data_done = clock()
        self.advance()

    def wait(self, timeout: float | None) -> None:
        """Block until this rank's completion instant; raise the failure if there is one."""
        rec = self.rec
        now = clock()
        limit = self.g.ctx.timeout + 30.0  # gloo's own timeout (NBOX_REAL_TIMEOUT) fires first
        if timeout:
            limit = min(limit, timeout)
        if self.lazy is not None:
            self.run_lazy(limit)
        if not self.scheduled.wait(limit):
            rec.wait += clock() - now
            raise RealRankError(
                f"nbox: {rec.op.value} #{self.seq} on {rec.comm} did not complete within {limit:g}s on real rank "
                f"{self.g.ctx.me}: {self.g.describe_peers()}"
            )
        if self.error is not None:
            rec.wait += clock() - now
            self.g.abort()
            raise self.error
        if clock() < self.completion:
            tune_thread_timer_slack()
            sleep_until(self.completion)
        after = clock()
        rec.wait += after - now
        if rec.completed is None:
            rec.completed = after


class HybridWork(NboxWork):
    """The Work of a hybrid op: completes at this rank's completion instant, or raises the real ranks' failure."""

    def __init__(self, h: HybridOp):
        super().__init__(h.rec, h.result, h.g.ctx.emu)
        self._h = h

    @property
    def hybrid(self) -> HybridOp:
        """The hybrid op behind this work."""
        return self._h

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Sleep until the completion instant (raises if a real rank failed)."""
        if not self._done:
            self._h.wait(timeout.total_seconds() if timeout else None)
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether the completion instant has passed (or the op failed)."""
        h = self._h
        if h.lazy:
            if not all(w.is_completed() for w in h.lazy):
                return False
            h.run_lazy(None)
        if not h.scheduled.is_set():
            return False
        return h.error is not None or clock() >= h.completion

    def is_success(self) -> bool:
        """False once a real rank failed."""
        return self._h.error is None

    def exception(self):
        """The failure, if any."""
        return self._h.error

    def get_future(self) -> torch.futures.Future:
        """A future that completes at the completion instant with the outputs (or the failure)."""
        if self._future is None:
            self._future = self._h.get_future()
        return self._future
