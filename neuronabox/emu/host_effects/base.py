"""The host-effect interface: what a mechanism of the real host may do to an emulated op's timing.

An effect is built once per run from the run's context (``build``: None when it is off), gives
each new communicator's timeline what it needs there (``for_timeline``: itself, a per-communicator
state, or None) and is then asked at fixed moments of an op's life. Every hook has a default that
does nothing, so an effect overrides only the two or three it needs; the timeline calls only the
overridden ones (``hooks``), and ``schedule`` is the hot path: keep the hooks cheap.

The moments, in the order the timeline asks (``timeline.Timeline.schedule``):

1. ``arrival``: when the op is recorded, how late the group's slowest rank arrives after the real
   rank (it delays the start, not the transfer);
2. ``settle``: before the op is queued, the host's progress is accounted up to now;
3. ``on_start``: the op has its start (after its predecessor, contention applied); an effect may
   move the start or change the duration;
4. ``lost``: how far an op still running has fallen behind an idle host (a second op issued
   beside it shares the link over the time it really takes);
5. ``admit``: an effect that makes the op's end tentative takes it over (at most one does);
6. ``on_queued``: the op is queued with its end, outside the timeline's lock;
7. completion (``emu/work.py``): ``done`` says whether the effect still holds the op. An op whose
   end was admitted is settled again when a waiter wakes at that end (``Timeline.settle``: done,
   or a later tentative end); an op that ``on_queued`` put in ``OpRecord.holds`` completes only
   once each of them lets it go (``wait``, ``when_done``).

Effects share what they decide through the op's record (``OpRecord.stall``, ``.spin``, ``.extra``):
the spin stall's spin is what the footprint spends beside the op. ``cpu_spent`` is CPU an effect
spent itself on the process's cores, which is not the training's compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

if TYPE_CHECKING:
    from ...collectives import Op
    from ...model.base import Group
    from ...topology import Topology
    from ..timeline import OpRecord, Recorder

__all__ = ["HostEffect", "RunContext", "hooks"]


@dataclass(frozen=True)
class RunContext:
    """What an effect may be built from: the run's topology, calibration profile and mode."""

    topology: Topology
    real_rank: int
    recorder: Recorder
    profile: dict | None  # the model's calibration profile (``model.profile``), if it has one
    wire: bool  # wire mode: a thread moves real bytes to stub peers (wire.py)
    hybrid: bool  # several real ranks run real collectives among themselves (hybrid.py)
    compute_cpu: Callable[[], float]  # the process's CPU seconds less what the effects spent themselves
    replay: Any = None  # replay.Replay: ranks of other roles that follow their own recorded program
    arrival: Callable | None = None  # a caller's own straggler hook (api.init(straggler=...)), in place of the skew

    @property
    def library(self) -> str:
        """The collective library the topology emulates (``gloo``, ``nccl``)."""
        return self.topology.emulation.library

    @property
    def modeled_cpu(self) -> bool:
        """A CPU library whose ops only the model times: gloo, neither wire nor hybrid (they spend the real CPU)."""
        return not self.wire and not self.hybrid and self.library == "gloo"


class HostEffect:
    """One mechanism of the host that shapes emulated ops. Hooks not overridden are never called."""

    name: ClassVar[str] = "host effect"

    @classmethod
    def build(cls, run: RunContext) -> "HostEffect | None":
        """This effect for ``run``, or None when it is off there."""
        raise NotImplementedError

    def for_timeline(self) -> "HostEffect | None":
        """What a new communicator's timeline attaches: this effect itself unless it keeps per-communicator state."""
        return self

    def arrival(self, op: Op, nbytes: int, group: Group) -> float:
        """Seconds after the real rank's call at which the group's slowest rank arrives."""
        return 0.0

    def settle(self, now: float) -> float:
        """Account the host's progress up to ``now``; the last end of the ops still pending here."""
        return float("-inf")

    def on_start(self, r: OpRecord, gap: float) -> None:
        """``r`` has its start; it was issued ``gap`` seconds after its predecessor's end (negative: beside it)."""

    def lost(self, r: OpRecord) -> float:
        """Seconds the running op ``r`` has fallen behind an idle host so far."""
        return 0.0

    def admit(self, r: OpRecord, prev_end: float, work: float | None = None) -> float:
        """Take over ``r``'s end (queued behind ``prev_end``, ``work`` s of progress); returns its tentative end."""
        raise NotImplementedError

    def on_queued(self, r: OpRecord, beside: float | None) -> None:
        """``r`` is queued with its end; ``beside``: it runs beside the previous op from then on."""

    def done(self, r: OpRecord) -> bool:
        """Whether this effect no longer holds ``r`` back (as of what it knows now)."""
        return True

    def wait(self, r: OpRecord) -> None:
        """Block until this effect lets ``r`` go (effects that put themselves in ``r.holds``)."""

    def when_done(self, r: OpRecord, callback: Callable[[float], None]) -> None:
        """Run ``callback(time)`` once this effect lets ``r`` go (now, if it has)."""
        callback(time.perf_counter())

    def cpu_spent(self) -> float:
        """CPU seconds this effect spent itself on the process's cores (not the training's compute)."""
        return 0.0

    def stop(self) -> None:
        """End what the effect runs (a thread); ops it still holds count as let go."""

    def describe(self) -> str:
        """One line for the run's record: what the effect does in this run."""
        return self.name


def hooks(effects: Iterable[HostEffect], name: str) -> tuple:
    """The bound ``name`` hook of each effect that overrides it, in the effects' order."""
    base = getattr(HostEffect, name)
    return tuple(getattr(e, name) for e in effects if getattr(type(e), name) is not base)
