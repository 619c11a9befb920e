"""``nbox calibrate``: measure the collectives on the real links, fit a piecewise alpha-beta model, save a profile.

The ranks run ``neuronabox.fidelity.measure`` in a netns cluster (or among one node's ranks on
this machine, for the intra-node part); ``neuronabox.fidelity.fit`` fits each op's times and
``neuronabox.fidelity.profile`` writes the profile that ``nbox run``, ``nbox bench`` and the
calibrated model read.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from ..collectives import Op
from ..errors import InputError, RunFailed
from ..model.profile import OpFit, Segment, ring_terms
from ..units import parse_fraction_flag
from .fit import fit_piecewise
from .measure import WorkerPlan
from .profile import library_info, make_profile
from .robust import local_times

__all__ = [
    "CALIBRATABLE",
    "DEFAULT_SIZES",
    "parse_size_range",
    "parse_ops",
    "parse_precision",
    "default_sizes",
    "load_for_calibration",
    "run_calibration",
    "run_intra_node",
    "settle_times",
    "fit_measured",
]

DEFAULT_SIZES = "4B:256MiB"  # the sweep's sizes unless told (nbox calibrate --sizes; nbox validate --calibrate)
# What gloo (torch's CPU backend) runs among real ranks; the others are its internals or absent.
CALIBRATABLE = (
    Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.REDUCE, Op.ALL_TO_ALL,
    Op.GATHER, Op.SCATTER, Op.SEND_RECV, Op.BARRIER,
)


# ---- options ------------------------------------------------------------------------------------------
def parse_size_range(text: str, flag: str = "--sizes") -> tuple[int, int]:
    """``4B:256MiB`` -> (4, 268435456); errors name the flag."""
    from ..units import UnitError, parse_size

    lo, sep, hi = str(text).partition(":")
    try:
        a, b = parse_size(lo.strip()), parse_size(hi.strip()) if sep else parse_size(lo.strip())
    except UnitError as exc:
        raise InputError(f"{flag}: {exc}") from None
    if not 1 <= a <= b:
        raise InputError(f"{flag}: expected MIN:MAX with 1 <= MIN <= MAX (e.g. 4B:256MiB), got {text!r}")
    return a, b


def parse_precision(text: str, flag: str = "--precision") -> float:
    """``2%``, ``0.02`` -> 0.02; ``0`` or ``off`` -> 0.0 (no top-up rounds); errors name the flag."""
    return parse_fraction_flag(text, flag, example="2%", off=True, below_one=True)


BUCKET_PRECISION = WorkerPlan.bucket_ci_target  # nbox calibrate --bucket-precision: sizes from 256 KiB up (WorkerPlan.bucket_min)


def _topup(precision: float, budget_s: float, bucket_precision: float = BUCKET_PRECISION) -> dict[str, float]:
    """The WorkerPlan fields of the top-up rounds: 10 budgets a size (40 from DDP's bucket sizes up), 400 in all; none at precision 0.

    A bucket precision finer than the default buys proportionally more: a median's interval
    narrows as one over the square root of its samples, so half the interval takes four times the
    samples and budgets (at most 16 times); with 80 samples at most the flag could not go finer.
    At 0.25 % one calibration's bootstrap sd of the workloads' modeled communication fell from
    0.21 to 0.12-0.16 % at 300 Mbit/s (benchmarks/results/calibration_repeat_precise.md); what
    the host's speed does between calibrations it cannot average out.
    """
    if precision <= 0.0:
        return {"ci_target": 0.0, "topup_s": 0.0, "topup_total_s": 0.0, "bucket_ci_target": 0.0, "bucket_topup_s": 0.0}
    on = bucket_precision > 0.0  # off: those sizes as the others
    more = min(16.0, max(1.0, (BUCKET_PRECISION / bucket_precision) ** 2)) if on else 1.0
    return {"ci_target": precision, "topup_s": 10 * budget_s, "topup_total_s": 400 * budget_s * more,
            "bucket_ci_target": min(precision, bucket_precision) if on else precision,
            "bucket_topup_s": (40 * more if on else 10) * budget_s,
            "bucket_min_samples": WorkerPlan.bucket_min_samples if on else 0,
            "bucket_max_samples": round(WorkerPlan.bucket_max_samples * more) if on else WorkerPlan.max_samples}


def parse_ops(text: str, flag: str = "--ops") -> list[Op]:
    """``all`` or ``all_reduce,broadcast`` -> ops; errors name the flag."""
    if text.strip() == "all":
        return list(CALIBRATABLE)
    ops = []
    for name in (x for x in text.split(",") if x.strip()):
        try:
            op = Op.parse(name)
        except ValueError as exc:
            raise InputError(f"{flag}: {exc}") from None
        if op not in CALIBRATABLE:
            raise InputError(f"{flag}: {op.value} cannot be measured among real gloo ranks")
        ops.append(op)
    if not ops:
        raise InputError(f"{flag}: give at least one op, or all")
    return list(dict.fromkeys(ops))


def default_sizes(lo: int, hi: int, factor: float = 2.0) -> list[int]:
    """Sizes from ``lo`` to ``hi`` by ``factor``, multiples of 4 bytes (float32 elements), ``hi`` included."""
    if factor <= 1:
        raise InputError(f"--step: must be greater than 1, got {factor}")
    out, x = [], float(lo)
    while x <= hi * (1 + 1e-9):
        v = max(4, int(round(x / 4)) * 4)
        if not out or v > out[-1]:
            out.append(v)
        x *= factor
    if out[-1] != max(4, hi // 4 * 4):
        out.append(max(4, hi // 4 * 4))
    return out


def load_for_calibration(path: Path):
    """The topology to calibrate, where its profile goes (the file ``emulation.profile`` names, else ``<topology>.profile.json`` beside it), and whether the topology named it.

    A named profile that does not exist yet is what this run is about to write, so it is no error here.
    """
    from ..topology import load_topology
    from ..topology.resolve import named_profile

    path = Path(path)
    target = named_profile(path)
    topo = load_topology(path, profile_may_be_missing=True)
    if target is not None:
        return topo, target, True
    return topo, path.with_name(f"{path.stem}.profile.json"), False


def run_calibration(
    topology,
    ops: Sequence[Op],
    sizes: Sequence[int],
    *,
    max_op_s: float = 0.5,
    budget_s: float = 0.15,
    precision: float = 0.02,
    bucket_precision: float = BUCKET_PRECISION,
    cluster: str | None = None,
    progress: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Bring the cluster up, measure ``ops`` at ``sizes`` among all ranks of ``topology``, fit; returns the profile."""
    from .real_system import cluster_for, cores_shared, launch_real

    say = progress or (lambda msg: None)
    if topology.world_size < 2:
        raise InputError(f"{topology.source}: calibration needs at least 2 ranks, "
                         f"the topology has {topology.world_size}")
    backend, device = _backend_for(topology, topology.world_size, "the network part")
    cores = cores_shared(topology.world_size)
    if device == "cpu" and cores:
        # Round robin then: every op's time includes ranks waiting for a core, not only the links.
        say(f"note: {topology.world_size} ranks on {cores} cores here: they share cores (round robin), so the "
            f"profile measures that sharing too; a topology of at most {cores} ranks calibrates the links alone")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbox-calibrate-") as tmp:
        # The stall measurement takes the sweep's care: 100 of its per-size budgets, 5-60 s.
        # The top-up rounds (WorkerPlan.ci_target, --precision, --bucket-precision) too: 10 budgets a size,
        # 40 from 256 KiB up, 400 in all (1.5, 6 and 60 s by default).
        plan = WorkerPlan([o.value for o in ops], list(sizes), budget_s=budget_s, max_op_s=max_op_s,
                          out=str(Path(tmp) / "measured.json"), stall_budget_s=min(60.0, max(5.0, 100 * budget_s)),
                          backend=backend, device=device, **_topup(precision, budget_s, bucket_precision))
        if backend != "gloo":  # the host-coupling figures are a CPU library's
            plan.busy_repeats = plan.pair_repeats = plan.stall_repeats = 0
        worker = _worker_command(plan, Path(tmp))
        with cluster_for(topology, cluster, say) as up:
            say(f"cluster {up.name} up; measuring {len(ops)} ops x up to {len(sizes)} sizes "
                f"on {topology.world_size} ranks ({backend})")
            limit = _time_limit(plan, timeout)
            started = time.monotonic()
            _, codes = launch_real(up.name, topology, worker, None, timeout=limit, record_only=False,
                                   log_dir=Path(tmp))
            measured = _read_measured(plan, codes, Path(tmp), limit, time.monotonic() - started)
    settle_times(measured)
    n = topology.world_size
    fits = fit_measured(measured, n)
    meta = _meta(t0, max_op_s, budget_s, sizes, measured)
    profile = make_profile(topology, fits, measured["ops"], measured.get("unsupported", {}), meta, backend)
    for key in ("busy_progress", "cpu_cost", "concurrency", "spin_stall"):
        if measured.get(key):
            profile[key] = measured[key]
    return profile


def run_intra_node(
    topology,
    ops: Sequence[Op],
    sizes: Sequence[int],
    *,
    max_op_s: float = 0.5,
    budget_s: float = 0.15,
    precision: float = 0.02,
    bucket_precision: float = BUCKET_PRECISION,
    progress: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Measure ``ops`` at ``sizes`` among the ranks of one node on this machine, over its own fabric; the profile's ``intra_node`` part.

    No namespaces and no shaping: a node's ranks talk over what the node really has (loopback
    and shared memory for CPU ranks, NVLink or PCIe for GPUs with NCCL), so this machine stands
    for one node of the topology's first kind. Each CPU rank is pinned to its own core (round
    robin past the cores); a GPU rank uses the GPU of its index.
    """
    from ..emu.environ import child_pythonpath, free_port
    from .real_system import rank_preexec, run_ranks

    say = progress or (lambda msg: None)
    node = topology.nodes[0]
    n = node.ranks
    if n < 2:
        raise InputError(f"{topology.source}: cluster.ranks_per_node: {n}: no intra-node part to calibrate "
                         f"(one rank per node)")
    backend, device = _backend_for(topology, n, "the intra-node part")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbox-calibrate-") as tmp:
        plan = WorkerPlan([o.value for o in ops], list(sizes), budget_s=budget_s, max_op_s=max_op_s,
                          out=str(Path(tmp) / "measured.json"), backend=backend, device=device,
                          **_topup(precision, budget_s, bucket_precision),
                          busy_repeats=0, pair_repeats=0, stall_repeats=0)
        worker = _worker_command(plan, Path(tmp))
        say(f"measuring {len(ops)} ops x up to {len(sizes)} sizes among {n} ranks of one {node.device} node "
            f"on this machine ({backend})")
        base = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
        port, path = free_port(), child_pythonpath()
        envs = [dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=path) for r in range(n)]
        cores = sorted(os.sched_getaffinity(0))
        pres = [rank_preexec(None, cores[r % len(cores)] if device == "cpu" else None) for r in range(n)]
        limit = _time_limit(plan, timeout)
        started = time.monotonic()
        codes = run_ranks(worker, envs, pres, timeout=limit, log_dir=Path(tmp))
        measured = _read_measured(plan, codes, Path(tmp), limit, time.monotonic() - started)
    settle_times(measured)
    return {"ranks": n, "device": node.device, "library": library_info(backend),
            "ops": {k: v.as_dict() for k, v in fit_measured(measured, n).items()},
            "unsupported": measured.get("unsupported", {}), "measurements": measured["ops"],
            "meta": _meta(t0, max_op_s, budget_s, sizes, measured)}


def _backend_for(topology, ranks: int, part: str) -> tuple[str, str]:
    """(backend, device) the real ranks measure with: the topology's library; NCCL needs a GPU per rank here."""
    if topology.emulation.library != "nccl":
        return "gloo", "cpu"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < ranks:
        raise InputError(f"{topology.source}: emulation.library: nccl: {part} runs one real rank per GPU on this "
                         f"machine ({ranks} ranks, {gpus} GPUs here); set library: gloo to calibrate with CPU ranks")
    return "nccl", "cuda"


def _worker_command(plan: "WorkerPlan", folder: Path) -> list[str]:
    """The calibration ranks' command line, with ``plan`` written beside it for every rank to read."""
    plan_file = folder / "plan.json"
    plan_file.write_text(json.dumps(asdict(plan)))
    return [sys.executable, "-m", "neuronabox.fidelity.measure", str(plan_file)]


def _time_limit(plan: "WorkerPlan", timeout: float) -> float:
    """How long the ranks may run: ``timeout`` for the sweep and its parts, plus twice the top-up budget.

    A finer --bucket-precision buys up to 16 times the top-up rounds (16 minutes at the default
    budget); a fixed limit ended such a calibration half way.
    """
    return timeout + 2.0 * plan.topup_total_s


def _read_measured(plan: "WorkerPlan", codes: list[int], logs: Path, limit: float = math.inf, ran_s: float = 0.0) -> dict:
    """What rank 0 wrote, or the ranks' failure with rank 0's last lines (a timeout where they ran ``limit`` seconds)."""
    from .real_system import exit_codes_text

    if any(codes) or not Path(plan.out).exists():
        log = logs / "rank0.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        why = (f"did not finish within {limit:.0f} s (a smaller --sizes range, --max-op-time or a coarser "
               f"--bucket-precision measures less)" if ran_s >= limit
               else f"failed (exit status {exit_codes_text(codes)})")
        raise RunFailed(f"the calibration ranks {why}: {' | '.join(tail) or '(no output)'}")
    return json.loads(Path(plan.out).read_text())


def settle_times(measured: dict) -> None:
    """Each sweep row's ``time_s``: its samples' median (kept as ``median_s``) settled by its neighbours' samples (``robust.local_times``).

    The fit and the calibrated model's table read ``time_s``; the median of one size's few
    samples moved 5-10 % between calibrations of one cluster where DDP's buckets are.
    """
    for rows in measured["ops"].values():
        for row, t in zip(rows, local_times(rows)):
            if row.get("samples"):
                row["median_s"] = statistics.median(row["samples"])
            row["time_s"] = t


def _meta(t0: float, max_op_s: float, budget_s: float, sizes: Sequence[int], measured: dict) -> dict[str, Any]:
    """How a part was measured: its time, limits, the sizes asked for and where ops were cut short."""
    return {"seconds": time.perf_counter() - t0, "max_op_s": max_op_s, "budget_s": budget_s,
            "sizes_requested": [min(sizes), max(sizes)], "truncated": measured.get("truncated", {})}


def fit_measured(measured: dict, n: int) -> dict[str, OpFit]:
    """Each op's piecewise fit of its rows' ``time_s`` at group size ``n`` (a barrier's one row: a latency)."""
    fits: dict[str, OpFit] = {}
    for op_name, rows in measured["ops"].items():
        if len(rows) >= 2:
            fits[op_name] = fit_piecewise([r["size"] for r in rows], [r["time_s"] for r in rows], op_name, n)
        elif rows:  # barrier: one latency, no size
            big_l = ring_terms(Op.parse(op_name), n)[0] or 1.0
            t = rows[0]["time_s"]
            seg = Segment(0.0, math.inf, t, 0.0, t / big_l, math.inf, 1, rows[0]["size"], rows[0]["size"])
            fits[op_name] = OpFit(op_name, n, [seg], 0.0, 0.0)
    return fits


