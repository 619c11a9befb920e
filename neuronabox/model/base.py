"""The delay-plugin interface: a model turns (collective, bytes, group) into a duration and a schedule.

A model is built once per topology and asked many times, so it caches whatever it derives
per group (``Group`` hashes once). ``estimate`` is the hot path: it computes the duration
only; the per-step schedule (who sends how many bytes to whom, when) is built on demand by
``Estimate.steps()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Sequence

from ..collectives import Op
from ..topology import Topology
from ..topology.graph import ClusterGraph

__all__ = ["Step", "Group", "Collective", "Estimate", "CommModel", "rank_sequence", "range_by_node", "RANGE_FROM"]

# A group of at least this many ranks that is a run of consecutive ranks (the world, a node
# block) is held as a ``range``: 10 M ranks are 360 MB as a tuple of ints. Smaller groups stay
# tuples, as they always were.
RANGE_FROM = 65_536


def rank_sequence(ranks: Iterable[int]) -> "tuple[int, ...] | range":
    """Ranks as a tuple, or as a ``range`` when they are ``RANGE_FROM`` or more consecutive ascending ranks."""
    if isinstance(ranks, range) and ranks.step == 1 and len(ranks) >= RANGE_FROM:
        return ranks
    t = tuple(ranks)
    if len(t) >= RANGE_FROM and t[-1] - t[0] == len(t) - 1 and all(b - a == 1 for a, b in zip(t, t[1:])):
        return range(t[0], t[-1] + 1)
    return t


@dataclass(frozen=True, slots=True)
class Step:
    """One transfer of a collective's schedule; times in seconds from the collective's start."""

    start: float
    end: float
    src: int  # global rank
    dst: int  # global rank
    nbytes: float
    phase: str


def range_by_node(ranks: range, topology: Topology) -> dict[int, range]:
    """A run of consecutive ranks cut at node boundaries: node index -> its ranks of the run (one entry a node)."""
    out: dict[int, range] = {}
    for nd in range(topology.rank_node[ranks[0]], topology.rank_node[ranks[-1]] + 1):
        node = topology.nodes[nd]
        out[nd] = range(max(ranks.start, node.first_rank), min(ranks.stop, node.first_rank + node.ranks))
    return out


class Group:
    """An ordered tuple of global ranks (a communicator; a large run of consecutive ranks is a ``range``); its hash is computed once."""

    __slots__ = ("ranks", "_hash")

    def __init__(self, ranks: Iterable[int]):
        self.ranks: tuple[int, ...] | range = rank_sequence(ranks)
        if not self.ranks:
            raise ValueError("a group needs at least one rank")
        self._hash = hash(self.ranks)

    @property
    def size(self) -> int:
        """How many ranks."""
        return len(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and self._hash == other._hash and self.ranks == other.ranks

    def __repr__(self) -> str:
        if len(self.ranks) > 8:
            return f"Group({tuple(self.ranks[:4])}...{tuple(self.ranks[-2:])}, n={len(self.ranks)})"
        return f"Group({self.ranks})"

    @classmethod
    def of(cls, group: "Group | Sequence[int] | range") -> "Group":
        """Coerce a sequence of ranks into a ``Group`` (a ``Group`` is returned as is)."""
        return group if isinstance(group, Group) else cls(group)


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective call: ``root`` is a group-local index (broadcast, reduce, gather, scatter; the sender of send_recv)."""

    op: Op
    nbytes: int
    group: Group
    root: int = 0


class Estimate:
    """A model's answer: the duration, the algorithm and protocol chosen, and (lazily) the schedule."""

    __slots__ = ("duration", "algorithm", "protocol", "_steps", "_builder")

    def __init__(
        self,
        duration: float,
        algorithm: str,
        protocol: str = "",
        builder: Callable[[], list[Step]] | None = None,
    ):
        self.duration = duration
        self.algorithm = algorithm
        self.protocol = protocol
        self._builder = builder
        self._steps: list[Step] | None = None

    def steps(self) -> list[Step]:
        """The per-step breakdown, built on first use."""
        if self._steps is None:
            self._steps = self._builder() if self._builder is not None else []
        return self._steps

    def shifted(self, extra: float, label: str = "") -> "Estimate":
        """The same estimate with ``extra`` seconds added at the end (what-if injection)."""
        out = Estimate(self.duration + extra, self.algorithm + label, self.protocol, self._builder)
        out._steps = self._steps
        return out

    def __repr__(self) -> str:
        proto = f"/{self.protocol}" if self.protocol else ""
        return f"Estimate({self.duration * 1e6:.3f}us, {self.algorithm}{proto})"


class CommModel(ABC):
    """A delay model. Subclasses set ``name``, ``algorithms`` and implement ``estimate``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    algorithms: ClassVar[tuple[str, ...]] = ()
    protocols: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_choice(cls, kind: str, value: str) -> str:
        """``value`` of ``kind`` (algorithm or protocol) as the model takes it; ValueError says what it offers."""
        allowed = cls.algorithms if kind == "algorithm" else cls.protocols
        if value == "auto" or not allowed or value in allowed:
            return value
        article = "an" if kind[0] in "aeiou" else "a"
        raise ValueError(f"{value!r} is not {article} {kind} of model {cls.name!r} (choose from auto, {', '.join(allowed)})")

    def __init__(
        self,
        topology: Topology,
        graph: ClusterGraph | None = None,
        *,
        algorithm: str | None = None,
        protocol: str | None = None,
    ):
        self.topology = topology
        self.graph = graph if graph is not None else ClusterGraph(topology)
        self.algorithm = algorithm if algorithm is not None else topology.emulation.algorithm
        self.protocol = protocol if protocol is not None else topology.emulation.protocol

    @abstractmethod
    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """Duration and breakdown of one collective of ``nbytes`` (nccl-tests size) over ``group``."""

    def estimate_concurrent(self, collectives: Sequence[Collective]) -> list[Estimate]:
        """Estimates for collectives that start together; models that see contention override this."""
        return [self.estimate(c.op, c.nbytes, c.group, c.root) for c in collectives]

    def link_time(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> float | None:
        """Seconds of ``op`` that occupy the link (its bytes at the rate concurrent ops reach together); None when unknown.

        A library that runs two ops of a communicator at once (gloo) lets the second op's bytes
        fill the link time the first leaves idle (its protocol's stalls); the timeline needs this
        share to overlap them. Models without a measurement answer None (only latency overlaps).
        """
        return None

    def world(self) -> Group:
        """The group of every rank."""
        return Group(range(self.topology.world_size))
