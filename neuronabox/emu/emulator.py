"""The real rank's view of the emulated cluster: topology, model, recorder, waker, one timeline per communicator.

One ``Emulator`` is current per process. ``api.init`` sets it; a process started by
``nbox run`` may instead find it through the environment (``NBOX_TOPOLOGY``, ``NBOX_MODEL``,
``NBOX_REAL_RANK``), so that the backend works even when the user script alone calls
``init_process_group``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

from .. import recording
from ..collectives import Op
from ..model.base import Collective, CommModel, Group
from ..topology import Topology, load_topology
from . import host_effects, start_gate
from .environ import ENV_MODEL, ENV_REAL_RANK, ENV_REAL_RANKS, ENV_TOPOLOGY
from .group_table import TABLE
from .host_effects.base import HostEffect, RunContext, hooks
from .host_effects.compute_skew import StragglerHook
from .replay import ENV_ROLE_PARTIAL, ENV_ROLE_PROFILE, Replay
from .role_record import RoleRecorder
from .roles import read_profile
from .straggler import role_factors
from .timeline import Recorder, Timeline, Waker

__all__ = [
    "Emulator", "current", "set_current", "sees_contention", "ENV_TOPOLOGY", "ENV_MODEL", "ENV_REAL_RANK", "ENV_REAL_RANKS",
]



class Emulator:
    """Everything one real rank needs to emulate the others.

    ``contention`` (default: whether the model sees contention) makes an op that starts while
    other communicators' ops are in flight take the model's concurrent duration.
    ``real_ranks`` (default: ``NBOX_REAL_RANKS``, else just ``real_rank``): every rank of the run
    that is a real process; groups with two or more of them run hybrid collectives (hybrid.py).
    ``straggler``: the caller's own hook for how late a group's slowest rank arrives, in place of
    the compute skew the topology implies (``host_effects/compute_skew.py``).
    """

    def __init__(
        self,
        topology: Topology,
        real_rank: int = 0,
        model: CommModel | str | None = None,
        straggler: StragglerHook | None = None,
        contention: bool | None = None,
        real_ranks: "tuple[int, ...] | list[int] | None" = None,
    ):
        if not 0 <= real_rank < topology.world_size:
            raise ValueError(f"real rank {real_rank} is outside the world of {topology.world_size} ranks")
        self.topology = topology
        self.real_rank = real_rank
        self.world_size = topology.world_size
        if model is None or isinstance(model, str):
            from ..model.registry import create_model  # the registry imports every built-in lazily

            model = create_model(topology, model)
        self.model: CommModel = model
        self.recorder = Recorder()
        start_gate.install(self.recorder)
        self.waker = Waker()
        self.timelines: list[Timeline] = []
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.contention = contention if contention is not None else sees_contention(self.model)
        # Wire mode hook: `nbox run --cluster N --mode wire` sets NBOX_WIRE; collectives then move
        # real bytes to stub peers (wire.py). None in model mode, the default.
        self.wire = None
        if os.environ.get("NBOX_WIRE"):
            from .wire import WireClient

            self.wire = WireClient.from_env(self)
        # Hybrid hook: with several real ranks, groups holding two or more of them run for real among them.
        if real_ranks is None:
            real_ranks = (real_rank,)
            if os.environ.get(ENV_REAL_RANKS):
                from .hybrid import parse_real_ranks

                real_ranks = parse_real_ranks(os.environ[ENV_REAL_RANKS], self.world_size, real_rank)
        self.real_ranks: tuple[int, ...] = tuple(sorted(set(real_ranks)))
        self.nccl_env: list[str] = []  # the NCCL_* limits taken from the environment (model/nccl_env.py)
        self.hybrid = None
        if len(self.real_ranks) > 1:
            from .hybrid import HybridContext

            if real_rank not in self.real_ranks:
                raise ValueError(f"real rank {real_rank} is not among the real ranks {self.real_ranks}")
            self.hybrid = HybridContext.from_env(self, self.real_ranks)
        # A CPU library whose ops only the model times (no wire, no hybrid real ops): gloo's two
        # worker threads run two ops of a communicator at once.
        self._modeled_cpu = (self.wire is None and self.hybrid is None and topology.emulation.library == "gloo")
        # Roles (roles.py): a profiling run records this rank's program; a replay run lets the
        # ranks of other roles follow theirs.
        self.role_recorder = RoleRecorder.from_env(real_rank)
        if self.role_recorder is not None:
            self.recorder.iteration_listeners.append(self.role_recorder.mark)
        self.replay: Replay | None = None
        if os.environ.get(ENV_ROLE_PROFILE):
            partial = os.environ.get(ENV_ROLE_PARTIAL) == "1"  # nbox profile: the roles recorded so far
            profile_meta = read_profile(Path(os.environ[ENV_ROLE_PROFILE]), partial=partial)
            self.replay = Replay(profile_meta, real_rank, TABLE, self.model, self.world_size,
                                 role_factors(topology, profile_meta.roles if profile_meta.world_size == self.world_size
                                              else None))
            self.recorder.iteration_listeners.append(self.replay.real_mark)
        # Host effects (host_effects/): what the real host does to the ops' timing, from the
        # topology and the model's calibration profile.
        self.effects: list[HostEffect] = host_effects.build(RunContext(
            topology, real_rank, self.recorder, getattr(self.model, "profile", None), wire=self.wire is not None,
            hybrid=self.hybrid is not None, compute_cpu=self._compute_cpu, replay=self.replay, arrival=straggler))
        self._spenders = hooks(self.effects, "cpu_spent")

    def roles_start(self) -> None:
        """The world group exists: role gaps count from now."""
        now = time.perf_counter()
        if self.role_recorder is not None:
            self.role_recorder.start()
        if self.replay is not None:
            self.replay.start(now)

    def new_timeline(self, group: Group, kind: str = "comm") -> Timeline:
        """A fresh communicator timeline: two process groups over the same ranks are still two NCCL communicators."""
        with self._lock:
            parts = [p for e in self.effects if (p := e.for_timeline()) is not None]
            tl = Timeline(f"{kind}{next(self._names)}", group, self.model, self.recorder, parts)
            if self.contention:
                tl.contention = self._contended
            if self._modeled_cpu:
                tl.slots = self.topology.emulation.gloo_threads
            self.timelines.append(tl)
        return tl

    def effect(self, kind: type) -> HostEffect | None:
        """The run's host effect of class ``kind`` (e.g. ``host_effects.footprint.Footprint``), if it is on."""
        return next((e for e in self.effects if isinstance(e, kind)), None)

    def _compute_cpu(self) -> float:
        # The host's compute is the process's CPU less what the effects spent for the ops (the footprint's thread).
        return time.process_time() - sum(spent() for spent in self._spenders)

    def _contended(self, timeline: Timeline, op: Op, nbytes: int, root: int, start: float):
        # Ops of other communicators in flight at ``start`` share links with this one. The model
        # simulates them as starting together (they started earlier, so this overstates the
        # sharing a little) and only the new op's duration changes: the others were promised.
        others = [r for tl in self.timelines if tl is not timeline for r in (tl.in_flight(start),) if r is not None]
        if not others:
            return None
        batch = [Collective(r.op, r.nbytes, r.group, r.root) for r in others]
        batch.append(Collective(op, nbytes, timeline.group, root))
        est = self.model.estimate_concurrent(batch)[-1]
        return float(est.duration), est.algorithm


def sees_contention(model: CommModel) -> bool:
    """Whether ``model`` models concurrent collectives (overrides ``estimate_concurrent``), under any what-if wrapper."""
    inner = model
    while hasattr(inner, "inner"):
        inner = inner.inner
    return type(inner).estimate_concurrent is not CommModel.estimate_concurrent


_current: Emulator | None = None
# Observers (the metrics exporter, the progress file) read the run through neuronabox.recording,
# without importing this module: the global as it is, never one built from the environment.
recording.publish(lambda: _current)


def set_current(emulator: Emulator | None) -> None:
    """Make ``emulator`` the one the backend uses (``None`` forgets it)."""
    global _current
    _current = emulator


def current() -> Emulator:
    """The current emulator, built from ``NBOX_TOPOLOGY`` if none was set; an error names what to do otherwise."""
    global _current
    if _current is None:
        path = os.environ.get(ENV_TOPOLOGY)
        if not path:
            raise RuntimeError(
                "the nbox backend has no emulated cluster: run the script under `nbox run TOPOLOGY -- ...`, "
                "call neuronabox.emu.api.init(topology) first, or set NBOX_TOPOLOGY"
            )
        rank = int(os.environ.get(ENV_REAL_RANK, os.environ.get("RANK", "0")))
        from ..model.nccl_env import from_environment

        model = os.environ.get(ENV_MODEL) or None
        # Read as NCCL reads them, when the script's first communicator comes up: its own settings count.
        topology, taken = from_environment(load_topology(Path(path)), os.environ, model)
        _current = Emulator(topology, rank, model)
        _current.nccl_env = taken
    return _current
