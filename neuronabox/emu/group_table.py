"""Every process group the script creates, in creation order: how ranks of different roles name one communicator.

torch requires every rank to call ``new_group`` for every group, in the same order, member
or not (DeviceMesh does so for each of its dimensions). So the *j*-th group that holds a
rank is the same communicator on every rank that runs the same program, and a role profile
can name a communicator by that ordinal alone (roles.py); the replay finds, for any rank,
the live group it stands for (``nth``). Index 0 is the world group.
"""

from __future__ import annotations

from typing import Sequence

from ..model.base import rank_sequence

__all__ = ["GroupTable", "TABLE"]


class GroupTable:
    """The groups created so far (global ranks), and which one is being created now."""

    def __init__(self):
        self.groups: list[tuple[int, ...] | range] = []  # a large run of consecutive ranks is a range
        self.creating: int | None = None  # the index of the group whose process group is being built
        self._of: dict[int, list[int]] = {}

    def add(self, ranks: Sequence[int]) -> int:
        """Record a new group; returns its index."""
        self.groups.append(rank_sequence(ranks))
        self._of.clear()
        return len(self.groups) - 1

    def start_world(self, world_size: int) -> None:
        """The world group is created first (``init_process_group``); a new world starts a new table."""
        self.groups = [rank_sequence(range(world_size))]
        self._of.clear()
        self.creating = 0

    def containing(self, rank: int) -> list[int]:
        """The indexes of the groups holding ``rank``, in creation order."""
        hit = self._of.get(rank)
        if hit is None:
            hit = self._of[rank] = [i for i, g in enumerate(self.groups) if rank in g]
        return hit

    def ordinal(self, index: int, rank: int) -> int:
        """Where group ``index`` stands among the groups holding ``rank``."""
        return self.containing(rank).index(index)

    def nth(self, rank: int, ordinal: int) -> int | None:
        """The index of the ``ordinal``-th group holding ``rank`` (None when it has fewer)."""
        mine = self.containing(rank)
        return mine[ordinal] if 0 <= ordinal < len(mine) else None


TABLE = GroupTable()
