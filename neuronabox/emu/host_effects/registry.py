"""The host effects a run can have, in the order the timeline asks them; ``build`` makes a run's list.

Adding a mechanism: one module holding a ``base.HostEffect`` subclass, one line in ``EFFECTS``.
The order matters where effects share an op's record: an effect that sets ``OpRecord.spin`` at
the op's start (spin stalls) comes before one that spends it when the op is queued (footprint);
the hooks themselves run at fixed moments whatever the order (base.py).
"""

from __future__ import annotations

from .base import HostEffect, RunContext
from .compute_skew import CallerArrival, ComputeSkew
from .footprint import Footprint
from .host_coupling import HostCoupling
from .spin_stall import SpinStall

__all__ = ["EFFECTS", "build"]

EFFECTS: tuple[type[HostEffect], ...] = (
    CallerArrival,  # a caller's own straggler hook (api.init), in place of the skew
    ComputeSkew,  # slower ranks and peer noise: the group's slowest rank arrives late
    SpinStall,  # gloo's I/O-thread spin stalls, drawn per op from the profile
    HostCoupling,  # a CPU library's op crawls while the host computes
    Footprint,  # the CPU gloo would spend, spent for real on a thread
)


def build(run: RunContext) -> list[HostEffect]:
    """The effects that are on in ``run``, in ``EFFECTS`` order."""
    return [e for cls in EFFECTS if (e := cls.build(run)) is not None]
