"""Recording one role's program in a profiling run (``nbox profile``): its calls and the compute between them.

The profiling run is an ordinary ``nbox run`` of the role's representative rank with the
``ideal`` model, so every emulated collective ends when it is called and nothing the other
ranks do shows in the gaps. A gap is the wall time between two calls less the time the rank
was blocked in ``Work.wait`` between them: compute, never waits (roles.py has the format).
CPU only: on CUDA the gaps would have to come from device events (not done yet).
"""

from __future__ import annotations

import json
import os
import threading

from ..collectives import Op
from .group_table import TABLE
from .roles import FORMAT, PAYLOAD_BYTES
from .timeline import OpRecord, clock

__all__ = ["RoleRecorder", "ENV_ROLE_RECORD", "ENV_ROLE_NAME"]

ENV_ROLE_RECORD = "NBOX_ROLE_RECORD"  # where the profiling run writes this role's program
ENV_ROLE_NAME = "NBOX_ROLE_NAME"


class RoleRecorder:
    """Appends one event per call of the real rank (roles.py); written at exit."""

    def __init__(self, path: str, role: str, rank: int):
        self.path = path
        self.role = role
        self.rank = rank
        self.events: list[list] = []
        self.iterations = 0
        # What torch says about the job's layout, for roles inferred from it (profiling.py).
        self.mesh: list[list] | None = None  # [[dim name, size], ...], outermost first
        self.stages: list[dict] = []  # pipelining stages this rank holds: index, count, their group's ranks
        self._last: float | None = None  # the origin is the world group's creation
        self._lock = threading.Lock()

    def start(self) -> None:
        """The world group exists: gaps count from now."""
        self._last = clock()

    def _gap(self, now: float) -> float:
        last = self._last if self._last is not None else now
        self._last = now
        return max(0.0, now - last)

    def op(self, ordinal: int, op: Op, nbytes: int, peer: int, send: bool, rec: OpRecord, tensors=()) -> None:
        """The rank called a collective (peer -1, or the root) or a point-to-point op with group position ``peer``."""
        now = clock()
        event = ["op", 0.0, ordinal, op.value, int(nbytes), int(peer), int(send)]
        if send and 0 < nbytes <= PAYLOAD_BYTES and len(tensors) == 1 and tensors[0].device.type == "cpu":
            # A receiver of another role may act on the values: pipelining's warm-up vote decides
            # whether it reads shapes from an object list.
            t = tensors[0]
            event.append([str(t.dtype).removeprefix("torch."), t.detach().reshape(-1).tolist()])
        with self._lock:
            rec.event = len(self.events)
            event[1] = self._gap(now)
            self.events.append(event)

    def wait_begins(self, rec: OpRecord) -> None:
        """The rank waits on ``rec``; the time until ``wait_ends`` is not compute."""
        if rec.event < 0:
            return
        with self._lock:
            self.events.append(["wait", self._gap(clock()), rec.event])

    def wait_ends(self) -> None:
        """The wait returned: compute counts again from now."""
        self._last = clock()

    def sync(self) -> None:
        """The optimizer is about to step: whatever the rank issued is done by now."""
        with self._lock:
            self.events.append(["sync", self._gap(clock())])

    def mark(self, _index: int) -> None:
        """An iteration ended."""
        with self._lock:
            self.iterations += 1
            self.events.append(["mark", self._gap(clock())])

    def note_mesh(self, shape, names) -> None:
        """The script built a DeviceMesh; the largest one is the job's layout."""
        if names is None or len(names) != len(shape):
            return
        size = 1
        for s in shape:
            size *= int(s)
        mine = 1
        for _, s in self.mesh or ():
            mine *= s
        if self.mesh is None or size > mine:
            self.mesh = [[str(n), int(s)] for n, s in zip(names, shape)]

    def note_stage(self, index: int, count: int, ranks: list[int]) -> None:
        """The script built a pipeline stage."""
        self.stages.append({"index": int(index), "count": int(count), "ranks": [int(r) for r in ranks]})

    def write(self) -> None:
        """Write the program (the launcher renames it once the run has ended well)."""
        mine = TABLE.containing(self.rank)
        data = {
            "format": FORMAT,
            "role": self.role,
            "rank": self.rank,
            "groups": [len(TABLE.groups[i]) for i in mine],
            "iterations": self.iterations,
            "mesh": self.mesh,
            "stages": self.stages,
            "events": self.events,
        }
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, self.path)

    @classmethod
    def from_env(cls, rank: int) -> "RoleRecorder | None":
        """The recorder a profiling run asks for (``NBOX_ROLE_RECORD``), else None."""
        path = os.environ.get(ENV_ROLE_RECORD)
        if not path:
            return None
        import atexit

        rec = cls(path, os.environ.get(ENV_ROLE_NAME, f"r{rank}"), rank)
        atexit.register(rec.write)
        return rec
