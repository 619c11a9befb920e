"""The ``calibrated`` model: answers from a profile that ``nbox calibrate`` fitted on real links.

The profile holds, per op, size segments ``t = L(n)·alpha + F(n)·S/B`` fitted at the
calibrated group size (``neuronabox.fidelity.fit``). For another group size the
segment's alpha and B go into the same ring closed form with that n, so a 2-rank
calibration answers for 1024 ranks the way the alpha-beta model would, with measured
constants. An op that was not measured borrows all-reduce's segments (alpha and bus
bandwidth are per step and per link, not per op). Groups inside one node and ops with no
usable profile entry fall back to the alpha-beta model: the profile knows the network only.

Where the profile comes from, first found wins: ``profile=`` when built in code; the
topology's ``emulation.profile`` (a path relative to the topology file, made absolute when
the file is loaded; ``--profile FILE`` on ``nbox run``, ``bench``, ``whatif`` and ``validate``
overrides it through ``with_profile``); the ``NBOX_PROFILE`` environment variable, a
fallback for scripts written before the field existed. What-if ``latency_scale`` and
``bandwidth_scale`` scale alpha and B.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
from pathlib import Path
from typing import Sequence

from ..collectives import Op
from ..errors import InputError, TopologyError
from .base import CommModel, Estimate, Group
from .profile import load_profile, ring_terms, topology_hash

__all__ = ["CalibratedModel", "ENV_PROFILE", "with_profile"]

ENV_PROFILE = "NBOX_PROFILE"


class CalibratedModel(CommModel):
    """Piecewise alpha-beta fitted by ``nbox calibrate``, scaled to other group sizes by the ring closed forms."""

    name = "calibrated"
    description = "piecewise alpha-beta fitted by nbox calibrate (profile: emulation.profile or --profile)"
    algorithms = ()
    protocols = ()

    def __init__(self, topology, graph=None, *, algorithm=None, protocol=None,
                 profile: str | Path | dict | None = None):
        super().__init__(topology, graph, algorithm=algorithm, protocol=protocol)
        if isinstance(profile, dict):
            doc = profile
        elif profile is not None:
            doc = load_profile(profile)
        elif topology.emulation.profile is not None:
            try:
                doc = load_profile(topology.emulation.profile)
            except InputError as exc:
                raise TopologyError(topology.source, "emulation.profile", str(exc)) from None
        elif os.environ.get(ENV_PROFILE):
            doc = load_profile(os.environ[ENV_PROFILE])
        else:
            raise InputError(f"{topology.source}: emulation.profile: model calibrated needs a calibration profile: "
                             f"set emulation.profile or pass --profile FILE (nbox calibrate writes one; "
                             f"{ENV_PROFILE} is read last)")
        self.profile = doc
        self.fits = doc["fits"]
        # The node's own fabric (nbox calibrate --part intra-node), for groups inside one node.
        self.intra_fits = doc.get("intra_fits") or {}
        if not self.fits and not self.intra_fits:
            raise InputError(f"calibration profile {doc.get('topology', {}).get('file', '')!r} has no fitted op")
        self.matches = doc.get("topology", {}).get("hash") == topology_hash(topology)
        if not self.matches:
            # Calibrating a small cluster and asking about a different network is legitimate
            # (that is a what-if), but it should not pass unnoticed.
            where = doc.get("topology", {})
            print(f"nbox: note: calibration profile was measured on topology {where.get('name')!r} "
                  f"(network hash {where.get('hash')}); this topology's network differs", file=sys.stderr)
        self.latency_scale = topology.whatif.latency_scale
        self.bandwidth_scale = topology.whatif.bandwidth_scale
        self._fallback = None
        # The measured points themselves: between two of them, at the calibrated group size and
        # with no what-if scaling, the model interpolates them rather than trust a segment's
        # line (a 3-point segment can miss a point it fits by 9%, and DDP's buckets sit there).
        self.tables = _tables(doc.get("measurements"))
        self.intra_tables = _tables((doc.get("intra_node") or {}).get("measurements"))

    def link_time(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> float | None:
        """The op's bytes at the link time per byte measured with two all-reduces at once (profile ``concurrency``)."""
        c = self.profile.get("concurrency")
        group = Group.of(group)
        if not c or c.get("sec_per_byte") is None or group.size < 2:
            return None
        if len({self.topology.rank_node[r] for r in group.ranks}) == 1:
            return None
        # Per byte of all-reduce at the calibrated size; other ops and group sizes by their wire factor.
        f_ref = ring_terms(Op.ALL_REDUCE, int(c.get("ranks") or group.size))[1]
        f_op = ring_terms(op, group.size)[1]
        if not f_ref or not f_op:
            return None
        # The all-reduce whose wire bytes are this op's: the size its share is looked up at.
        equiv = nbytes * f_op / f_ref
        return pair_sec_per_byte(c, equiv) * equiv / self.bandwidth_scale

    def _alpha_beta(self):
        if self._fallback is None:
            from .alphabeta import AlphaBetaModel

            self._fallback = AlphaBetaModel(self.topology, self.graph)
        return self._fallback

    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """The fitted segment for ``nbytes``, in the op's ring closed form for this group's size."""
        group = Group.of(group)
        n = group.size
        if n == 1:
            return Estimate(0.0, "local")
        rank_node = self.topology.rank_node
        if len({rank_node[r] for r in group.ranks}) == 1:
            if not self.intra_fits:
                return self._alpha_beta().estimate(op, nbytes, group, root)
            return self._from_fits(self.intra_fits, self.intra_tables, "calibrated intra-node", op, nbytes, group, root)
        return self._from_fits(self.fits, self.tables, "calibrated", op, nbytes, group, root)

    def _from_fits(self, fits, tables, label: str, op: Op, nbytes: int, group: Group, root: int) -> Estimate:
        n = group.size
        fit = fits.get(op)
        if fit is None:
            fit = fits.get(Op.ALL_REDUCE)
            label += "(all_reduce)"
            if fit is None:
                return self._alpha_beta().estimate(op, nbytes, group, root)
        table = tables.get(op)
        if (table is not None and n == fit.n and fit.op == op.value and self.latency_scale == 1.0
                and self.bandwidth_scale == 1.0 and table[0][0] <= nbytes <= table[0][-1]):
            sizes, times = table
            i = min(bisect.bisect_left(sizes, nbytes), len(sizes) - 1)
            if sizes[i] == nbytes or i == 0:
                return Estimate(times[i], f"{label} measured")
            s0, s1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
            return Estimate(t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0), f"{label} measured")
        seg = fit.segment(nbytes)
        big_l, big_f = ring_terms(op, n)
        if n == fit.n and fit.op == op.value:
            # The calibrated size: exactly the fitted line (no rounding through alpha and B).
            t = seg.latency_s * self.latency_scale + seg.sec_per_byte * nbytes / self.bandwidth_scale
        else:
            bw = seg.bandwidth_Bps * self.bandwidth_scale
            t = big_l * seg.alpha_s * self.latency_scale + (0.0 if math.isinf(bw) else big_f * nbytes / bw)
        index = fit.segments.index(seg)
        return Estimate(max(t, 0.0), f"{label} s{index}")


def _tables(measurements: dict | None) -> dict[Op, tuple[list[float], list[float]]]:
    """The measured points per op, by size: between two of them the model interpolates rather than trust a segment's line."""
    out: dict[Op, tuple[list[float], list[float]]] = {}
    for name, rows in (measurements or {}).items():
        pts = sorted((float(r["size"]), float(r["time_s"])) for r in rows if r.get("size"))
        if len(pts) >= 2:
            out[Op.parse(name)] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def pair_sec_per_byte(concurrency: dict, nbytes: float) -> float:
    """Link seconds per byte of all-reduce with two at once, at ``nbytes``: between measured sizes by log size, the nearest beyond them."""
    pts = sorted((float(p["size"]), float(p["sec_per_byte"])) for p in concurrency.get("points") or [] if p.get("size"))
    if not pts:  # a profile from before the sizes were measured: one figure
        return float(concurrency["sec_per_byte"])
    sizes = [s for s, _ in pts]
    if nbytes <= sizes[0]:
        return pts[0][1]
    if nbytes >= sizes[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(sizes, nbytes)
    (s0, v0), (s1, v1) = pts[i - 1], pts[i]
    w = math.log(nbytes / s0) / math.log(s1 / s0)
    return v0 + (v1 - v0) * w


def with_profile(topology, profile: str | Path | None, model: str | None = None, flag: str = "--profile"):
    """``topology`` with a command line's ``--profile FILE`` (and ``--model``) applied over the file's fields.

    A profile is read by the calibrated model only, so ``--profile`` selects that model unless
    ``--model`` names one; naming another model beside a profile is a contradiction (exit 2),
    not something to ignore silently. Without ``--profile`` only ``--model`` applies.
    """
    changes: dict[str, str] = {}
    if model is not None:
        changes["model"] = model
    if profile is not None:
        if model is not None and model != CalibratedModel.name:
            raise InputError(f"{flag}: only model calibrated reads a profile, but --model is {model!r} (drop one of them)")
        path = Path(profile).expanduser()
        if not path.is_file():
            raise InputError(f"{flag}: no such profile file {str(profile)!r}")
        try:
            load_profile(path)
        except InputError as exc:
            raise InputError(f"{flag}: {exc}") from None
        changes.update(profile=str(path.resolve()), model=CalibratedModel.name)
    return topology.with_changes(emulation=changes) if changes else topology
