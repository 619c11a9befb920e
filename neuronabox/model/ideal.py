"""The ``ideal`` model: an infinitely fast network, every collective takes no time.

The baseline of what-if studies ("what if communication were free?") and of the emulator's
own overhead: under it, any slowdown of the real rank comes from the emulator, not the model.
"""

from __future__ import annotations

from typing import Sequence

from ..collectives import Op
from .base import CommModel, Estimate, Group

__all__ = ["IdealModel"]


class IdealModel(CommModel):
    """Zero-time collectives."""

    name = "ideal"
    description = "an infinitely fast network: every collective takes 0 s"
    algorithms = ()

    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """Zero seconds, whatever the collective."""
        return Estimate(0.0, "ideal")
