"""Replay: emulated ranks of other roles follow their recorded programs against the real rank.

With a role profile (roles.py) the ranks of the real rank's replica that run another role are
**actors**: each walks its role's events on its own clock. It arrives at its k-th op at its
previous event plus the recorded compute gap; a wait moves its clock to the op's end. Every
other emulated rank runs as its proxy (``Roles.proxy``) does: clones of the real rank arrive
with it, as without roles. So a world of any size costs one actor per role.

An op instance is one op of one communicator, matched across ranks as NCCL matches them: the
k-th collective of a group on every member, the k-th send from a to b with b's k-th receive
from a. Its participants are the actors (the real rank among them) in its group; it starts
when the last one arrives and the previous op of that communicator (or directed channel)
has ended, and lasts what the delay model says. A send and its receive end together.

The real rank drives everything: each of its calls is an arrival, after which the actors
advance (``pump``) until each waits on an op whose end is not known yet: one that needs the
real rank at a later call. A real op may therefore be pending at its call (an ``irecv`` whose
sender first waits for the real rank's next ``isend``); it resolves at a later call, and
``wait`` on it can always resolve it then: the real rank makes no more calls while it waits,
so an op still unresolved there means the program and the profile disagree, and the missing
ranks are taken to arrive with the real rank (warned once). Actors stay within
``LOOKAHEAD`` iterations of the real rank.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

from ..collectives import Op
from ..model.base import CommModel, Group
from .group_table import GroupTable
from .roles import ProfileMeta, RoleProgram, roles_for_world
from .timeline import OpRecord

__all__ = ["Replay", "Instance", "Actor", "ENV_ROLE_PROFILE", "ENV_ROLE_PARTIAL", "LOOKAHEAD"]

ENV_ROLE_PROFILE = "NBOX_ROLE_PROFILE"
ENV_ROLE_PARTIAL = "NBOX_ROLE_PARTIAL"  # "1": the profile being recorded (roles.PARTIAL)
_OPS = {op.value: op for op in Op}
LOOKAHEAD = 2  # iterations an actor may run ahead of the real rank
# An actor's calls kept for the trace. Each keeps its op instance alive: at 50,000 a 200-iteration
# run held 40k more objects and the real rank paid full garbage collections of 0.2-0.3 s.
TRACE_CALLS = 5_000


class Instance:
    """One op of one communicator across its participants."""

    __slots__ = ("key", "op", "nbytes", "root", "group", "participants", "arrivals", "start", "end", "duration",
                 "records", "listeners", "forced", "payload")

    def __init__(self, key: tuple, op: Op, nbytes: int, root: int, group: tuple[int, ...], participants: frozenset):
        self.key = key
        self.op = op
        self.nbytes = nbytes
        self.root = root
        self.group = group
        self.participants = participants
        self.arrivals: dict[int, float] = {}
        self.start: float | None = None
        self.end: float | None = None
        self.duration: float | None = None
        self.records: list[OpRecord] = []
        self.listeners: list[Callable[[float], None]] = []
        self.forced = False
        self.payload: list | None = None  # a replayed sender's recorded values ([dtype, values])


class Actor:
    """An emulated rank walking its role's program."""

    def __init__(self, rank: int, program: RoleProgram, origin: float, factor: float = 1.0):
        self.rank = rank
        self.program = program
        self.factor = factor  # a straggler computes this many times slower than its role's profile
        self.events = program.events
        self.cursor = 0
        self.t = origin
        self.gap_applied = False
        self.counts: dict[tuple, int] = {}
        self.ops: dict[int, Instance] = {}
        self.unwaited: set[int] = set()
        self.marks: list[float] = []
        self.waited: list[float] = [0.0]  # seconds blocked per iteration
        self.bubble: list[float] = [0.0]  # of which before the op could start (waiting for other ranks)
        self.calls: list[tuple[str, float, Instance]] = []  # (op, arrival, instance) for the trace
        self.lost = False  # its program did not fit this run
        self.finished = False

    @property
    def done(self) -> bool:
        """Whether its program has no events left."""
        return self.cursor >= len(self.events) or self.lost

    def iteration_times(self) -> list[float]:
        """Seconds of each of its iterations (the first counts from the origin)."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class Replay:
    """The actors of the real rank's replica and the op instances they share with it."""

    def __init__(self, profile: ProfileMeta, real: int, table: GroupTable, model: CommModel,
                 world_size: int | None = None, stragglers: dict[int, float] | None = None):
        self.profile = profile
        self.roles = roles_for_world(profile, world_size or profile.world_size)
        self.real = real
        self.table = table
        self.model = model
        self.actors: dict[int, Actor] = {}
        actors = self.roles.actors(real)
        # A straggler (what-if) of another role runs its role's program slower: it gets an actor of
        # its own, so one slow rank of a replica holds back only the groups it is in. One of the
        # real rank's own role stays a slow clone of it (straggler.ComputeSkew), as without roles.
        mine = self.roles.role_of(real)
        self.factors = {r: f for r, f in (stragglers or {}).items()
                        if f != 1.0 and r != real and self.roles.role_of(r) != mine}
        for r in self.factors:
            actors.setdefault(r, self.roles.role_of(r))
        # While a profile is recorded, roles not yet recorded have no program: they stay clones.
        self._actor_ranks = {r: n for r, n in actors.items() if n in profile.programs}
        self.instances: dict[tuple, Instance] = {}
        self.next_seq: dict[tuple, int] = {}
        self.last_end: dict[tuple, float] = {}
        self.real_counts: dict[tuple, int] = {}
        self.real_calls = 0
        self.real_iterations = 0
        self._durations: dict[tuple, float] = {}
        self._chans: dict[tuple, tuple[frozenset, tuple[int, ...]]] = {}  # channel -> (participants, ranks)
        self._groups: dict[tuple[int, int], int | None] = {}  # (actor, ordinal) -> group index
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self.forced = 0

    # --- set-up ------------------------------------------------------------------------------------

    def start(self, origin: float) -> None:
        """The world group exists: the actors' clocks start here, as the recorded gaps do."""
        for rank, name in self._actor_ranks.items():
            self.actors[rank] = Actor(rank, self.profile.programs[name], origin, self.factors.get(rank, 1.0))
    def actors_ranks(self) -> list[int]:
        """The ranks that follow a recorded program."""
        return list(self._actor_ranks)

    def participants(self, ranks: tuple[int, ...]) -> frozenset:
        """The actors and the real rank among ``ranks``."""
        return frozenset(r for r in ranks if r == self.real or r in self._actor_ranks)

    def involves_actor(self, ranks: tuple[int, ...]) -> bool:
        """Whether a group of the real rank holds an actor (its ops replay; others stay clones)."""
        return any(r in self._actor_ranks for r in ranks)

    # --- the real rank ---------------------------------------------------------------------------------

    def real_op(self, index: int, op: Op, rec: OpRecord, peer: int = -1, send: bool = False) -> Instance:
        """The real rank called ``op`` on group ``index`` (``peer``: a p2p partner's global rank); its instance."""
        with self._lock:
            self.real_calls += 1
            ranks = self.table.groups[index]
            inst = self._arrive(self.real, index, ranks, op, rec.nbytes, rec.root, peer, send, rec.ready + rec.extra)
            inst.records.append(rec)
            if inst.end is not None:
                self._fill(rec, inst)
            self.pump()
            return inst

    def real_mark(self, index: int) -> None:
        """The real rank ended an iteration: actors may go one further."""
        with self._lock:
            self.real_iterations = index + 1
            self.pump()

    def settle(self, inst: Instance, force: bool) -> bool:
        """Resolve ``inst`` if possible (``force``: the real rank waits on it, so no later call can help)."""
        with self._lock:
            if inst.end is None:
                self.pump()
            if inst.end is None and force:
                self._force(inst)
            return inst.end is not None

    def when_resolved(self, inst: Instance, callback: Callable[[float], None]) -> None:
        """Call ``callback(end)`` once ``inst`` has its end (at once if it has)."""
        with self._lock:
            if inst.end is None:
                inst.listeners.append(callback)
                return
        callback(inst.end)

    # --- matching and timing -----------------------------------------------------------------------------

    def _arrive(self, who: int, index: int, ranks: tuple[int, ...], op: Op, nbytes: int, root: int, peer: int,
                send: bool, when: float) -> Instance:
        if op is Op.SEND_RECV:
            src, dst = (who, peer) if send else (peer, who)
            chan = ("p", index, src, dst)
            root = 0 if src < dst else 1  # the model's direction of a pair, as the backend's p2p timelines
        else:
            chan = ("c", index)
        hit = self._chans.get(chan)
        if hit is None:  # once per channel: a world of thousands is scanned once, not per op
            pair = (src, dst) if op is Op.SEND_RECV else ranks
            hit = self._chans[chan] = (self.participants(pair), tuple(sorted(pair)) if op is Op.SEND_RECV else ranks)
        parts, group = hit
        counts = self.real_counts if who == self.real else self.actors[who].counts
        seq = counts.get(chan, 0)
        counts[chan] = seq + 1
        key = chan + (seq,)
        inst = self.instances.get(key)
        if inst is None:
            inst = self.instances[key] = Instance(key, op, nbytes, root, group, parts)
        # Ranks of different roles move different volumes (an expert with more tokens): the op lasts
        # as long as its largest.
        inst.nbytes = max(inst.nbytes, nbytes)
        inst.arrivals[who] = when
        self._resolve(inst)
        return inst

    def _duration(self, inst: Instance) -> float:
        if inst.duration is None:
            k = (inst.op, inst.nbytes, inst.root, inst.key[:-1])  # the channel names the group: no O(world) hash
            d = self._durations.get(k)
            if d is None:
                try:
                    d = float(self.model.estimate(inst.op, inst.nbytes, Group(inst.group), inst.root).duration)
                except (NotImplementedError, ValueError, KeyError):
                    d = float(self.model.estimate(Op.ALL_REDUCE, 4, Group(inst.group)).duration)
                if len(self._durations) < 65536:
                    self._durations[k] = d
            inst.duration = d
        return inst.duration

    def _resolve(self, inst: Instance) -> None:
        while inst is not None and inst.end is None:
            chan, seq = inst.key[:-1], inst.key[-1]
            if self.next_seq.get(chan, 0) != seq:
                return  # an earlier op of this communicator is still open: FIFO
            missing = [p for p in inst.participants if p not in inst.arrivals]
            if any(not self._gone(p) for p in missing):
                return
            for p in missing:
                a = self.actors[p]
                self._warn(f"rank {p} (role {a.program.name}) reached the end of its recorded program "
                           f"({len(a.events)} events) before this run did: later ops no longer wait for it")
            arrivals = list(inst.arrivals.values())
            inst.start = max(arrivals + [self.last_end.get(chan, float("-inf"))])
            inst.end = inst.start + self._duration(inst)
            self.last_end[chan] = inst.end
            self.next_seq[chan] = seq + 1
            for rec in inst.records:
                self._fill(rec, inst)
            listeners, inst.listeners = inst.listeners, []
            for fn in listeners:
                fn(inst.end)
            if len(inst.arrivals) == len(inst.participants):
                del self.instances[inst.key]  # nobody arrives at it again: a long run keeps only open ops
            inst = self.instances.get(chan + (seq + 1,))

    def _gone(self, rank: int) -> bool:
        actor = self.actors.get(rank)
        return actor is not None and actor.done

    @staticmethod
    def _fill(rec: OpRecord, inst: Instance) -> None:
        rec.start = inst.start
        rec.end = inst.end
        rec.duration = inst.duration
        rec.extra = max(rec.extra, inst.start - rec.ready)

    def _force(self, inst: Instance) -> None:
        # The real rank waits on it and nothing else will happen: the ranks still missing are
        # taken to arrive with the real rank; so is every earlier open op of the communicator.
        self.forced += 1
        self._warn(f"op {inst.op.value} on ranks {list(inst.group)[:8]}: ranks "
                   f"{sorted(p for p in inst.participants if p not in inst.arrivals)} never reached it in their "
                   "recorded programs (does the profile match this run?); they are taken to arrive with the real rank")
        chan, seq = inst.key[:-1], inst.key[-1]
        for s in range(self.next_seq.get(chan, 0), seq + 1):
            other = self.instances.get(chan + (s,))
            if other is None or other.end is not None:
                continue
            base = other.arrivals.get(self.real, max(other.arrivals.values(), default=0.0))
            for p in other.participants:
                other.arrivals.setdefault(p, base)
            other.forced = True
        self.next_seq.setdefault(chan, 0)
        while self.next_seq[chan] <= seq:
            other = self.instances.get(chan + (self.next_seq[chan],))
            if other is None:  # the real rank never called it either: skip the slot
                self.next_seq[chan] += 1
                continue
            before = self.next_seq[chan]
            self._resolve(other)
            if self.next_seq[chan] == before:
                break

    def _warn(self, text: str) -> None:
        if text in self._warned or len(self._warned) > 4:
            return
        self._warned.add(text)
        sys.stderr.write(f"nbox: role replay: {text}\n")
        sys.stderr.flush()

    # --- the actors -----------------------------------------------------------------------------------------

    def pump(self) -> None:
        """Advance every actor until each waits on an op not yet resolved (or may not run further ahead)."""
        moved = True
        while moved:
            moved = False
            for actor in self.actors.values():
                if self._advance(actor):
                    moved = True

    def _advance(self, a: Actor) -> bool:
        moved = False
        events = a.events
        while a.cursor < len(events) and not a.lost:
            e = events[a.cursor]
            kind = e[0]
            if kind == "mark" and len(a.marks) >= self.real_iterations + LOOKAHEAD:
                return moved
            if not a.gap_applied:
                a.t += e[1] * a.factor
                a.gap_applied = True
            if kind == "op":
                if not self._actor_op(a, e):
                    return moved
            elif kind == "wait":
                inst = a.ops.get(e[2])
                if inst is not None:
                    if inst.end is None:
                        return moved
                    self._wait_for(a, inst)
                    a.unwaited.discard(e[2])
                    del a.ops[e[2]]
            elif kind == "sync":
                pending = sorted((a.ops[k] for k in a.unwaited), key=lambda i: i.end if i.end is not None else 0.0)
                if any(i.end is None for i in pending):
                    return moved
                for i in pending:
                    self._wait_for(a, i)
                for k in a.unwaited:
                    del a.ops[k]
                a.unwaited.clear()
            else:  # mark
                a.marks.append(a.t)
                a.waited.append(0.0)
                a.bubble.append(0.0)
            a.cursor += 1
            a.gap_applied = False
            moved = True
        if a.done and not a.finished:
            a.finished = True  # ops that still wait for it will not get it
            for inst in list(self.instances.values()):
                if inst.end is None and a.rank in inst.participants:
                    self._resolve(inst)
        return moved

    @staticmethod
    def _wait_for(a: Actor, inst: Instance) -> None:
        if inst.end > a.t:
            a.waited[-1] += inst.end - a.t
            a.bubble[-1] += max(0.0, min(inst.start, inst.end) - a.t)
            a.t = inst.end

    def _actor_op(self, a: Actor, e: tuple) -> bool:
        ordinal, opname, nbytes, peer, send = e[2:7]
        index = self._groups.get((a.rank, ordinal), -1)
        if index == -1:
            index = self._groups[(a.rank, ordinal)] = self.table.nth(a.rank, ordinal)
        if index is None:
            self._lose(a, f"its program uses group #{ordinal} of rank {a.rank}, which this run never created")
            return False
        ranks = self.table.groups[index]
        op = _OPS[opname]
        root = -1
        if op is Op.SEND_RECV:
            if not 0 <= peer < len(ranks):
                self._lose(a, f"its program sends to position {peer} of a group of {len(ranks)}")
                return False
            peer_rank = ranks[peer]
        else:
            peer_rank, root = -1, max(peer, 0)
        inst = self._arrive(a.rank, index, ranks, op, nbytes, root, peer_rank, bool(send), a.t)
        if len(e) > 7:
            inst.payload = e[7]
        a.ops[a.cursor] = inst
        a.unwaited.add(a.cursor)
        if len(a.calls) < TRACE_CALLS:
            a.calls.append((opname, a.t, inst))
        return True

    def _lose(self, a: Actor, why: str) -> None:
        a.lost = True
        self._warn(f"rank {a.rank} (role {a.program.name}): {why}; it runs as a clone from here")

    # --- reports -------------------------------------------------------------------------------------------

    def summary(self, t0: float = 0.0) -> dict:
        """Per role: the replayed rank, its iteration times, its waits and bubble per iteration, its calls (times since ``t0``)."""
        out = {}
        with self._lock:
            for rank, a in self.actors.items():
                n = len(a.marks)
                out[a.program.name] = {
                    "rank": rank,
                    "iterations": a.iteration_times(),
                    "marks": [m - t0 for m in a.marks],
                    "waited": a.waited[:n],
                    "bubble": a.bubble[:n],
                    "events_replayed": a.cursor,
                    "events": len(a.events),
                    "calls": [[op, t - t0, i.start - t0, i.end - t0] for op, t, i in a.calls
                              if i.end is not None and (n == 0 or t <= a.marks[-1])],
                }
            out["_forced"] = self.forced
        return out
