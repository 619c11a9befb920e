"""What-if knobs given on the command line, merged over the topology file's ``whatif`` section."""

from __future__ import annotations

from typing import Sequence

from ..collectives import Op
from ..errors import InputError, TopologyError
from ..units import UnitError, parse_duration
from .resolve import Topology

__all__ = ["apply_whatif_flags", "parse_inject", "parse_straggler"]


def parse_inject(spec: str) -> tuple[str, str]:
    """``all_reduce=+2ms`` -> (``all_reduce``, ``2ms``); the value must be a duration."""
    op, sep, value = spec.partition("=")
    if not sep:
        raise InputError(f"--inject: expected OP=+DURATION (e.g. all_reduce=+2ms), got {spec!r}")
    try:
        name = Op.parse(op).value
        value = value.strip().lstrip("+")
        parse_duration(value)
    except (ValueError, UnitError) as exc:
        raise InputError(f"--inject {spec!r}: {exc}") from None
    return name, value


def parse_straggler(spec: str) -> tuple[int, float]:
    """``3=1.5`` -> (3, 1.5): rank 3 computes 1.5 times slower."""
    rank, sep, factor = spec.partition("=")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, 0.0
    if not sep or r < 0 or f <= 0:
        raise InputError(f"--straggler: expected RANK=FACTOR with FACTOR > 0 (e.g. 3=1.5), got {spec!r}")
    return r, f


def apply_whatif_flags(
    topo: Topology,
    inject: Sequence[str] = (),
    latency_scale: float | None = None,
    bandwidth_scale: float | None = None,
    stragglers: Sequence[str] = (),
    world_size: int | None = None,
) -> Topology:
    """The topology with command-line what-if knobs merged over its ``whatif`` section."""
    changes: dict = {}
    if inject:
        merged = {k.value: f"{v}s" for k, v in topo.whatif.inject.items()}
        merged.update(dict(parse_inject(s) for s in inject))
        changes["inject"] = merged
    for flag, value in (("--latency-scale", latency_scale), ("--bandwidth-scale", bandwidth_scale)):
        if value is not None and value <= 0:
            raise InputError(f"{flag}: must be greater than zero, got {value}")
    if latency_scale is not None:
        changes["latency_scale"] = latency_scale
    if bandwidth_scale is not None:
        changes["bandwidth_scale"] = bandwidth_scale
    if stragglers:
        merged_s = dict(topo.whatif.stragglers)
        merged_s.update(dict(parse_straggler(s) for s in stragglers))
        changes["stragglers"] = merged_s
    if world_size is not None:
        changes["world_size"] = world_size
    if not changes:
        return topo
    try:
        return topo.with_changes(whatif=changes)
    except TopologyError as exc:
        raise InputError(f"{exc} (from the command-line what-if flags)") from None
