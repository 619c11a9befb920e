"""What each calibration rank runs (``python -m neuronabox.fidelity.measure PLAN``): the sweep and the host-coupling measurements.

Every rank of the topology runs for real in its node's namespace of a netns cluster (the
launcher of ``validate``), gloo over the shaped links. For each op and size, nccl-tests' way:
a barrier, then k back-to-back ops timed on every rank; the sample is the slowest rank's
time / k (an op is over when its last rank is done). k grows for small sizes so a sample
lasts a few tens of ms, the sample count is bounded by a time budget per size, and an op's
sweep stops after the first size whose op takes longer than ``max_op_s``: that keeps the
default run (4 B to 256 MiB, every op gloo has) to a few minutes on a 100 Mbit link, where
256 MiB alone would take 20 s an op. With gloo, rank 0 then also measures how collectives and
the host's compute share the CPU: progress while computing, CPU cost, two ops at once, and the
stalls of ops issued after compute (docs/fidelity.md, "A CPU library's collectives").
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..collectives import Op
from .fit import fit_line
from .robust import median_halfwidth

__all__ = ["WorkerPlan", "PAIR_SIZES", "cpu_cost_rows", "pair_ratios"]

_CHUNKED = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER)
# Sizes below the main one at which two all-reduces at once are also timed: DDP's buckets.
PAIR_SIZES = (256 << 10, 1 << 20, 4 << 20)


@dataclass
class WorkerPlan:
    """What every calibration rank runs (written to a JSON file that all ranks read)."""

    ops: list[str]
    sizes: list[int]
    budget_s: float = 0.15
    sample_s: float = 0.02
    max_op_s: float = 0.5
    min_samples: int = 3
    # The budget decides below this. At 100 Mbit/s one 2 MiB all-reduce takes 182-228 ms (the
    # same cluster, minutes apart): the median of 9 moved 192-204 ms between calibrations, and
    # DDP's buckets sit there; a longer budget may now buy more samples.
    max_samples: int = 40
    backend: str = "gloo"  # nccl: the ranks' tensors on GPUs (each rank the GPU of its index)
    device: str = "cpu"
    out: str = ""
    extra: dict = field(default_factory=dict)
    busy_repeats: int = 31  # samples of each busy-progress window, and of its op idle (0: skip it)
    busy_target_s: float = 0.03  # its all-reduce lasts about this long on an idle host (the nearest swept size)
    busy_windows: int = 6  # compute windows beside it: its idle time, then halving (1: that one only, no stall)
    # Samples of two all-reduces at once (0: skip it). The model's overlap turns a small change
    # of its figure into a large one of the idle link it fills (1 - x*S/T): at 100 Mbit/s two
    # calibrations of 7 read 93.7 and 86.5 ns/B, and the DDP CNN +6.9 and +1.5 % (one pair
    # spread 187-208 ms within a calibration). 21 cost 4-9 s more.
    pair_repeats: int = 21
    # The sweep visits every size this many times, each with a share of the budget, and the
    # two-at-once measurement runs a share after each visit: an op's level moves over seconds here.
    # At 100 Mbit/s the 1 MiB all-reduce's median read 93.3-99.8 ms in eight calibrations of one
    # cluster, each from one 4 s window (92.8-94.8 in eight with three passes), and the MLP's
    # model-mode iteration followed it (each profile within +-0.7 ms over three runs).
    sweep_passes: int = 3
    # Then more rounds of the sizes whose median is still uncertain: a size gets another
    # ``per_pass`` samples a round while the median's 95 % interval is wider than +-ci_target,
    # its samples fewer than max_samples and its extra samples' time under topup_s; all sizes
    # together under topup_total_s. With one sample a pass, the 1 MiB all-reduce at 100 Mbit/s
    # read 88.4-101.9 ms in one calibration (bootstrap sd of the median 2-4 %, benchmarks/
    # results/calibration_repeat.md); rounds interleave the sizes, as passes do, so a slow
    # minute of a shared host falls on all of them.
    ci_target: float = 0.02
    topup_s: float = 1.0  # nbox calibrate: 10 budgets
    topup_total_s: float = 45.0  # nbox calibrate: 400 budgets
    # Sizes from bucket_min up, where DDP's and FSDP's buckets lie, are topped up to a tighter
    # interval, by a sample count more than a time: at 100 Mbit/s a 2 MiB all-reduce sample takes
    # 180-280 ms, so 10 budgets bought 8-15 samples, and its median moved 2.4 % between five
    # calibrations, each on its own cluster (4 MiB: 6.4 %) while 32 KiB-1 MiB held within 0.2-1.5 %.
    # With 40 budgets a size (at most 80 samples) one calibration's own bootstrap sd of the
    # workloads' modeled communication fell 0.24-1.8 % -> 0.17-0.6 %, and five calibrations of one
    # cluster read them 0.32-0.98 % apart (benchmarks/results/calibration_repeat_one_cluster.md).
    # And at least bucket_min_samples there before a narrow interval may stop them: with 8-11
    # samples a 1 MiB all-reduce's interval happened to be within +-0.5 % and stopped it in one
    # calibration of five at each rate, its median then the lowest of the five (0.3-0.5 % below
    # the others'): a few samples that happen to agree are more often all from the floor than
    # from the tail a shared host adds, so stopping on them is biased.
    bucket_min: int = 256 << 10
    bucket_ci_target: float = 0.005
    bucket_min_samples: int = 24
    bucket_max_samples: int = 80
    bucket_topup_s: float = 4.0  # nbox calibrate: 40 budgets
    stall_repeats: int = 32  # samples per (size, gap) of the op-after-compute measurement (0: skip it)
    stall_groups: int = 4  # spread over this many fresh process groups
    stall_gaps_s: tuple[float, ...] = (0.002, 0.006, 0.02)  # the compute before each of its ops
    stall_budget_s: float = 60.0


def _worker(plan_path: str) -> None:
    """One calibration rank (``python -m neuronabox.fidelity.measure PLAN``): measure every op and size."""
    import torch
    import torch.distributed as dist

    plan = WorkerPlan(**json.loads(Path(plan_path).read_text()))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if plan.device == "cuda":
        # One GPU per rank, by its index; NCCL's ops are asynchronous on the GPU: sync() ends a timing.
        device = torch.device("cuda", int(os.environ.get("RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(plan.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[dict]] = {}
    unsupported: dict[str, str] = {}
    truncated: dict[str, int] = {}

    def decide(values: list[float]) -> list[float]:
        # Every rank must run the same number of ops, and a timing is the slowest rank's: the max
        # is everyone's. A block of timings is gathered once after the block: an op gathering each
        # sample right after it slows the next (100 Mbit/s, 1 ms: 1 MiB 98.9-99.2 ms against
        # 92.3-94.2 with only the barrier between samples, 92.9-93.4 with compute).
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    passes = max(1, plan.sweep_passes)
    for op_name in plan.ops:
        op = Op.parse(op_name)
        rows: list[dict] = []
        for size in plan.sizes:
            try:
                call, nbytes = _op_call(op, size, rank, n, device)
                call()  # warm-up; also finds ops this library lacks
                sync()
                ok = 1.0
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                ok, why = 0.0, str(exc).splitlines()[0][:200]
            if decide([1.0 - ok])[0] > 0:
                if not rows:
                    unsupported[op.value] = why if ok == 0.0 else "failed on another rank"
                break
            dist.barrier()
            sync()
            t = time.perf_counter()
            call()
            sync()
            first = decide([time.perf_counter() - t])[0]
            k = max(1, min(1000, int(plan.sample_s / max(first, 1e-7))))
            samples_n = max(-(-plan.min_samples // passes),
                            min(plan.max_samples // passes, int(plan.budget_s / passes / max(first * k, 1e-7))))
            samples = _sweep_samples(call, k, samples_n, sync, decide)
            med = statistics.median(samples)
            rows.append({"size": nbytes, "time_s": med, "k": k, "samples": samples, "per_pass": samples_n,
                         "rounds": 1})
            if rank == 0:
                print(f"{op.value:>14} {nbytes:>11} B  {med * 1e6:12.1f} us  (k={k}, {samples_n} samples)", flush=True)
            if op is Op.BARRIER:
                break  # no size
            if med > plan.max_op_s:
                truncated[op.value] = nbytes
                break
        if rows:
            results[op.value] = rows
    # Two all-reduces at once, in a share after each pass: its figure is a ratio of two times,
    # and both move with the level as the sweep's do.
    ar_rows = results.get(Op.ALL_REDUCE.value, [])
    pair_sizes = _pair_sizes(plan, ar_rows) if plan.pair_repeats > 0 and len(ar_rows) >= 2 else []
    pairs: dict[int, tuple[list[float], list[float]]] = {}
    for p in range(passes):
        if p > 0:
            for op_name, rows in results.items():
                op = Op.parse(op_name)
                for row in rows:
                    call, _ = _op_call(op, row["size"], rank, n, device)
                    call()
                    sync()
                    row["samples"] += _sweep_samples(call, row["k"], row["per_pass"], sync, decide)
                    row["time_s"] = statistics.median(row["samples"])
                    row["rounds"] += 1
        for size in pair_sizes:
            single, two = _pair_samples(size, -(-plan.pair_repeats // passes), decide)
            singles, twos = pairs.setdefault(size, ([], []))
            singles.extend(single)
            twos.extend(two)
    _top_up(plan, results, rank, n, device, sync, decide)
    busy = cpu = pair = stall = None
    if plan.stall_repeats > 0 and results.get(Op.ALL_REDUCE.value):
        stall = _spin_stall(plan, results[Op.ALL_REDUCE.value], decide)
        if rank == 0:
            for c in stall["cells"]:
                print(f"{c['gap_s'] * 1e3:.0f} ms after compute: a {c['size']} B all-reduce took "
                      f"{c['median_excess_s'] * 1e3:.2f} ms more than in the sweep (median); a rank spun in "
                      f"{c['spun']:.0%} of {len(c['samples'])} (median {c['median_spin_stall_s'] * 1e3:.2f} ms)", flush=True)
    if plan.busy_repeats > 0 and results.get(Op.ALL_REDUCE.value):
        busy = _busy_progress(plan, results[Op.ALL_REDUCE.value], decide)
        cpu = _cpu_cost(results[Op.ALL_REDUCE.value], n, decide)
        if rank == 0:
            print(f"busy progress: rate {busy['rate']:.3f} at {busy['size']} B "
                  f"(idle {busy['idle_s'] * 1e3:.2f} ms, computing {busy['compute_s'] * 1e3:.2f} ms); "
                  f"fitted over {len(busy['windows'])} windows: no progress over the first "
                  f"{busy['stall_s'] * 1e3:.2f} ms of compute, then rate {busy['rate_after_stall']:.3f}", flush=True)
        if rank == 0 and cpu:
            print(f"cpu cost per rank: {cpu['per_op_s'] * 1e6:.1f} us + {cpu['per_byte_s'] * 1e9:.3f} ns/B "
                  f"(all-reduce)", flush=True)
    if pairs:
        pair = _concurrency(ar_rows, n, pairs)
        if rank == 0:
            print(f"two at once: {pair['size']} B all-reduce {pair['single_s'] * 1e3:.2f} ms alone, "
                  f"{pair['pair_s'] * 1e3:.2f} ms for two", flush=True)
    if rank == 0:
        Path(plan.out).write_text(json.dumps({"ops": results, "unsupported": unsupported, "truncated": truncated,
                                              "busy_progress": busy, "cpu_cost": cpu, "concurrency": pair,
                                              "spin_stall": stall}))
    dist.destroy_process_group()


def _top_up(plan: WorkerPlan, results: dict[str, list[dict]], rank: int, n: int, device, sync, decide) -> None:
    """Rounds over the sweep's rows whose median is uncertain (``WorkerPlan.ci_target``; ``bucket_ci_target`` from ``bucket_min`` up), ``per_pass`` samples each, within the top-up budgets.

    Every decision reads the agreed samples only (the slowest rank's, the same on every rank),
    so all ranks run the same ops; the time spent is counted from them too, not from a clock.
    """
    spent: dict[int, float] = {}
    total = 0.0

    def wanted(row: dict) -> bool:
        bucket = row["size"] >= plan.bucket_min
        least, most, target, allowed = (
            (plan.bucket_min_samples, plan.bucket_max_samples, plan.bucket_ci_target, plan.bucket_topup_s) if bucket
            else (0, plan.max_samples, plan.ci_target, plan.topup_s))
        uncertain = len(row["samples"]) < least or median_halfwidth(row["samples"]) > target
        return (len(row["samples"]) < most and uncertain
                and spent.get(id(row), 0.0) + row["time_s"] * row["k"] * row["per_pass"] <= allowed)

    while True:
        todo = [(op_name, row) for op_name, rows in results.items() for row in rows if wanted(row)]
        # The widest interval in seconds first: if the total runs out, what is left uncertain costs
        # the least time (on a loaded host a 4 B op's interval stayed at +-10-70 % after 40 samples).
        todo.sort(key=lambda item: -median_halfwidth(item[1]["samples"]) * item[1]["time_s"])
        if not todo or total >= plan.topup_total_s:
            return
        for op_name, row in todo:
            call, _ = _op_call(Op.parse(op_name), row["size"], rank, n, device)
            call()
            sync()
            new = _sweep_samples(call, row["k"], row["per_pass"], sync, decide)
            row["samples"] += new
            row["time_s"] = statistics.median(row["samples"])
            row["rounds"] += 1
            took = sum(new) * row["k"]
            spent[id(row)] = spent.get(id(row), 0.0) + took
            total += took
            if total >= plan.topup_total_s:
                return


def _sweep_samples(call: Callable[[], object], k: int, count: int, sync, decide) -> list[float]:
    """``count`` samples of ``k`` back-to-back calls each, every rank starting each after a barrier; seconds per call, the slowest rank's."""
    import torch.distributed as dist

    samples = []
    for _ in range(count):
        dist.barrier()
        sync()
        t = time.perf_counter()
        for _ in range(k):
            call()
        sync()
        samples.append((time.perf_counter() - t) / k)
    return decide(samples)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; user, system, irq, softirq, steal)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


CPU_COST_MIN_BYTES = 64 << 10  # DDP's gradient buckets and up: the line must hold where training's ops are
CPU_COST_POINTS = 6


def cpu_cost_rows(rows: list[dict]) -> list[dict]:
    """The sweep rows the CPU cost is measured at: up to six, evenly spread over those from 64 KiB that take at most 0.2 s.

    The line fitted through them is what model mode spends for every op, so it has to hold at a
    gradient bucket's size. Three sizes of 5-200 ms (4, 16 and 64 MiB at 10 Gbit/s) put its
    intercept at 1.75 ms, and a 1 MiB all-reduce at 3.1 ms of CPU per rank, more than its 2.5 ms
    of wall time: the 10 Gbit/s MLP's backward lost 1.2 ms more to the footprint than to gloo
    (its second bucket issued 3.1 ms after the forward, 2.0 in the real system). Measured from
    128 KiB up, 1 MiB cost 1.5 ms and the fit 0.26 ms + 1.29 ns/B; the bucket issued at 1.8 ms.
    """
    picks = [r for r in rows if r["size"] >= CPU_COST_MIN_BYTES and r["time_s"] <= 0.2]
    if len(picks) <= CPU_COST_POINTS:
        return picks
    at = sorted({round(i * (len(picks) - 1) / (CPU_COST_POINTS - 1)) for i in range(CPU_COST_POINTS)})
    return [picks[i] for i in at]


def _cpu_cost(rows: list[dict], n: int, decide) -> dict | None:
    """CPU per rank that an all-reduce costs the host, as a line in the size; and the ranks' own share.

    Every rank of the calibration runs on this machine, so the machine's busy time while the
    ranks run k ops, less the idle machine's own rate, over k·n is one rank's share: gloo's
    threads, the kernel's TCP and softirqs, and, on an ``nbox up`` cluster, the relay that delays
    its links (at 100 Mbit/s 32 ms per 2 MiB all-reduce against 4.6 ms in each rank's process).
    That is what the compute beside the op loses on this host, so it is what model mode spends.
    ``process_per_byte_s`` (each rank's own process CPU) is kept for the record. Measured at the
    sizes of ``cpu_cost_rows``; each window lasts at least 1 s (the kernel counts in
    10 ms ticks), and the idle rate comes from 0.5 s idle windows before each, pooled (it was
    one 0.3 s window: 3 ticks of noise). The cost itself still varies between calibrations: at
    100 Mbit/s 5.6, 9.4 and 12.3 ns/B per rank with the shorter windows, 7.5, 9.8 and 9.6 in
    three with these (the relay's CPU per byte depends on how its reads fall).
    """
    import torch
    import torch.distributed as dist

    picks = cpu_cost_rows(rows)
    if not picks:
        return None
    idle_busy = idle_wall = 0.0
    windows, own = [], []
    for r in picks:
        dist.barrier()
        t, b = time.perf_counter(), _machine_busy_s()
        time.sleep(0.5)
        idle_busy += _machine_busy_s() - b
        idle_wall += time.perf_counter() - t
        x = torch.ones(max(1, r["size"] // 4))
        k = max(2, int(1.0 / r["time_s"]))
        dist.barrier()
        t, b, c = time.perf_counter(), _machine_busy_s(), time.process_time()
        for _ in range(k):
            dist.all_reduce(x)
        mine = torch.tensor([(time.process_time() - c) / k], dtype=torch.float64)
        dist.barrier()
        windows.append((float(x.numel() * 4), k, time.perf_counter() - t, _machine_busy_s() - b))
        dist.all_reduce(mine)
        own.append((float(x.numel() * 4), mine.item() / n))  # summed over the ranks: the same on each
    base_rate = decide([max(0.0, idle_busy / idle_wall)])[0]
    pts = [(size, decide([max(0.0, busy - base_rate * wall) / k / n])[0]) for size, k, wall, busy in windows]
    extra = {"points": pts, "idle_rate": base_rate,
             "process_per_byte_s": sum(y for _, y in own) / max(sum(x for x, _ in own), 1.0), "process_points": own}
    measured = [p for p in pts if p[1] > 0]
    if len(measured) < 2:  # one point (or none above the noise): all of it per byte
        per_byte = measured[0][1] / measured[0][0] if measured else 0.0
        return {"per_op_s": 0.0, "per_byte_s": per_byte, **extra}
    # The same line fit as the op times: relative error, intercept and slope >= 0.
    per_op, per_byte, _ = fit_line([p[0] for p in measured], [p[1] for p in measured])
    return {"per_op_s": per_op, "per_byte_s": per_byte, **extra}


def _after_barrier(call: Callable[[], object]) -> float:
    """Seconds ``call()`` took on this rank, every rank starting it after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _busy_progress(plan: WorkerPlan, rows: list[dict], decide) -> dict:
    """How fast an all-reduce progresses while every rank computes, relative to idle ranks (0..1), and its stall.

    A sample: all ranks start an async all-reduce of S bytes, compute (matrix products on the
    main thread) for ``Tc`` = its time in the sweep, then wait; the op took ``T``, and ``W``
    idle. Work left after computing was ``W - r·Tc``, so ``T = Tc + W - r·Tc`` and
    ``r = 1 - (T - W)/Tc``. ``Tc ≈ W`` spans r = 0..1 over T = 2W..W, so a few ms of noise in
    one sample moves r little (with W/2 the rate at 100 Mbit/s swung between 0.6 and 1.0). Idle
    and busy samples alternate, so drift hits both; the rate is the median of 31 (of 9, it read
    0.71-1.00 in six calibrations of one 1 Gbit/s network).

    The loss is not proportional to the compute: at 300 Mbit/s 2.5 ms of compute beside a 2.1 MB
    all-reduce cost it 1.3-2.8 ms, 40 ms cost 5-7 (the op's threads wait for the core at first).
    So each repeat also computes for shorter windows, halving down to ``Tc / 2**(busy_windows -
    1)``, and ``busy_stall.fit_busy_stall`` fits the stall and the rate after it to every sample.
    A short window runs beside the smallest op that lasts about as long (a 2 ms window beside the
    60 ms op cost 60 ms a sample), right after an idle sample of that op: the same time buys
    half again the samples, and every window has its own idle time (one median of 21 moved the
    stall by up to 0.9 ms).
    """
    import torch
    import torch.distributed as dist

    from .busy_stall import fit_windows

    # The measured size whose all-reduce lasts nearest the target (on a log scale): long enough
    # to time well. "The smallest lasting the target" read 1 MiB at 300 Mbit/s (29.8-30.4 ms
    # against 30) in some calibrations and 2 MiB in others, and the rate with it (0.87 / 0.97).
    # Its sweep time is the compute window: agreed already, so every rank computes as long.
    row = min(rows, key=lambda r: abs(math.log(max(r["time_s"], 1e-9) / plan.busy_target_s)))
    tc = row["time_s"]
    windows = [tc / 2 ** k for k in range(max(1, plan.busy_windows))]
    # Each window's op: the smallest measured size lasting 0.9 of it (the main op for the first).
    sizes = [row["size"]] + [next((r["size"] for r in rows if r["time_s"] >= 0.9 * c), row["size"]) for c in windows[1:]]
    bufs = {size: torch.ones(max(1, size // 4)) for size in set(sizes)}
    a = torch.randn(128, 128)

    def compute(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            torch.mm(a, a)
            done += 1
        return done

    def beside_op(x, window: float, count: list | None) -> None:
        t = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        done = compute(t + window)
        if count is not None:
            count.append(done)
        work.wait()

    alone, beside = [], []
    idle: list[list[float]] = [[] for _ in windows]
    busy: list[list[float]] = [[] for _ in windows]
    for x in bufs.values():
        dist.all_reduce(x)
    for _ in range(plan.busy_repeats):
        # Samples are gathered once after the block: an op agreeing each right after it slowed
        # the next one timed (the sweep's lesson, 2a044bc).
        dist.barrier()
        alone.append(compute(time.perf_counter() + tc))  # the same compute with no op in flight
        for i, (window, size) in enumerate(zip(windows, sizes)):
            x = bufs[size]
            idle[i].append(_after_barrier(lambda: dist.all_reduce(x)))
            busy[i].append(_after_barrier(lambda: beside_op(x, window, beside if i == 0 else None)))
    per = plan.busy_repeats
    flat = decide([t for i in range(len(windows)) for t in idle[i] + busy[i]])
    idle = [flat[2 * i * per:(2 * i + 1) * per] for i in range(len(windows))]
    busy = [flat[(2 * i + 1) * per:(2 * i + 2) * per] for i in range(len(windows))]
    w = statistics.median(idle[0])
    rates = [max(0.0, min(1.0, 1.0 - (took - w) / tc)) for took in busy[0]]
    rate = statistics.median(rates)
    measured = [{"compute_s": c, "size": size, "idle_samples": i_s, "samples": b}
                for c, size, i_s, b in zip(windows, sizes, idle, busy)]
    stall, after = fit_windows(w, measured) if len(windows) > 1 else (0.0, rate)
    # Compute each rank lost beside the op: its matrix products against the same window alone.
    rank, n = dist.get_rank(), dist.get_world_size()
    lost = torch.zeros(n, dtype=torch.float64)
    lost[rank] = w * max(0.0, 1.0 - statistics.median(beside) / max(statistics.median(alone), 1))
    dist.all_reduce(lost)
    return {"rate": rate, "size": row["size"], "idle_s": w, "compute_s": tc,
            "idle_samples": idle[0], "busy_samples": busy[0], "rates": rates, "lost_compute_s": lost.tolist(),
            "stall_s": stall, "rate_after_stall": after,
            "windows": measured}


STALL_MIN_S = 0.3e-3  # a rank's CPU in an op beyond its fast runs: below this, noise, not a spin


def _spin_stall(plan: WorkerPlan, rows: list[dict], decide) -> dict:
    """The op's wall time beyond the sweep's and each rank's CPU beyond its fast runs, for ops issued after compute.

    Gloo's I/O thread handles a socket only when it gets the pair's lock without waiting; while
    another thread of the rank holds it, epoll reports the socket again and again and the I/O
    thread spins. With one core per rank the holder waits for that core, so the op stalls until
    the scheduler rotates, and the spin burns the rank's core meanwhile. Measured on the 2-core
    machine, 10 Gbit/s: after 20 ms of compute a 0.37 MB all-reduce took 3.4-6.5 ms where the
    sweep's back-to-back loop takes 0.6, and the slow ones spent that time in CPU on one or both
    ranks; after 2 ms of compute it stalled in some runs and not in others. So the gap matters:
    a sample is ``gap`` seconds of matrix products on every rank, then one all-reduce timed in
    wall and process CPU time per rank, in one block per cell and group. Kept per
    (size, gap): samples of (wall excess, CPU excess of rank 0, of rank 1, ...), each with the
    process group it ran in (``stall_groups`` fresh ones, as each stalls at a rate of its own).
    """
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    a = torch.randn(128, 128)
    # Three sizes a training step issues: a tiny op, a small bucket, DDP's first bucket (1 MiB);
    # of each, the largest that the sweep measured under 50 ms.
    picks: dict[int, float] = {}
    for want in (4, 256 << 10, 1 << 20):
        cands = [r for r in rows if r["size"] <= want and r["time_s"] < 0.05]
        if cands:
            picks[cands[-1]["size"]] = cands[-1]["time_s"]
    bufs = {size: torch.ones(max(1, size // 4)) for size in picks}
    cells = [(size, gap) for size in picks for gap in plan.stall_gaps_s]
    walls: dict[tuple, list[float]] = {c: [] for c in cells}
    cpus: dict[tuple, list[list[float]]] = {c: [] for c in cells}
    groups: dict[tuple, list[int]] = {c: [] for c in cells}
    per_group = max(1, plan.stall_repeats // plan.stall_groups)
    t_all = time.perf_counter()
    for gi in range(plan.stall_groups):
        # Each group is a fresh gloo context (its own threads and sockets), and how often its ops
        # stall is its own: 1 MiB after 2 ms, 0 to 21 of 22 in six groups of one process. A job
        # keeps one for its life, so the samples keep their group and a run draws from one.
        pg = dist.new_group(backend="gloo")
        for x in bufs.values():
            dist.all_reduce(x, group=pg)
        # A cell's samples run as one block, each op after the same compute and the same op: a
        # training step repeats one pattern. Cells interleaved stalled more (10 Gbit/s, 1 MiB
        # after 2 ms: a 4.0-5.6 ms median against 2.6-3.1 in blocks, three pairs of runs; 4 B
        # 0.9-2.4 against 0.6-0.9), more than DDP's ops did (its MLP's 1 MiB bucket 3.5-4.8 ms
        # with a 0.5 MiB one beside it). A block's first op follows another cell: left out.
        order = [cell for cell in cells for _ in range(per_group + 1)]
        mine = torch.zeros(len(order), n + 1, dtype=torch.float64)
        for i, (size, gap) in enumerate(order):
            # Compute, then the op, and nothing else between ops: as in a training step, the
            # op before is what the compute follows. A barrier (or an op gathering the figures)
            # before each made it stall more (10 Gbit/s, 0.37 MB after 6 ms: 6.7 ms median with
            # a barrier, 1.2 without); the figures are gathered once the group is done.
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                torch.mm(a, a)
            t, c = time.perf_counter(), time.process_time()
            dist.all_reduce(bufs[size], group=pg)
            mine[i, 0], mine[i, 1 + rank] = time.perf_counter() - t, time.process_time() - c
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=pg)
        for i, (cell, row) in enumerate(zip(order, mine.tolist())):
            if i % (per_group + 1) == 0:
                continue
            walls[cell].append(row[0])
            cpus[cell].append(row[1:])
            groups[cell].append(gi)
        dist.destroy_process_group(pg)
        if decide([time.perf_counter() - t_all])[0] > plan.stall_budget_s:
            break  # a slow network: what was measured will do

    def excess(values: list[float]) -> list[float]:
        base = sorted(values)[len(values) // 10]
        return [v - base if v - base >= STALL_MIN_S else 0.0 for v in values]

    cells_out = []
    for (size, gap), w in walls.items():
        # Wall time against the sweep's (what the profile's fit holds): an op after compute is
        # slower even when no rank spins (10 Gbit/s, 2 MiB: 3.8 ms at best, 2.6 in the sweep).
        # Signed: the sweep's own samples can be two modes (10 Gbit/s, 512 KiB: 0.55 ms or 2-3.6),
        # its median between them, and an op after compute that took the fast one took less.
        # Clamped at 0, the draws averaged more than the samples did: every sample's noise below
        # the sweep's median counted as none, every one above it as a stall.
        w_ex = [v - picks[size] for v in w]
        c_ex = list(zip(*[excess([c[r] for c in cpus[(size, gap)]]) for r in range(n)]))
        spun = [x for x, c in zip(w_ex, c_ex) if max(c) > 0]
        cells_out.append({"size": bufs[size].numel() * 4, "gap_s": gap, "swept_s": picks[size],
                          "samples": [[x, *c] for x, c in zip(w_ex, c_ex)], "groups": groups[(size, gap)],
                          "spun": len(spun) / len(w_ex), "median_excess_s": statistics.median(w_ex),
                          "median_spin_stall_s": statistics.median(spun) if spun else 0.0})
    return {"ranks": n, "cells": cells_out}


def _pair_sizes(plan: WorkerPlan, rows: list[dict]) -> list[int]:
    """The sizes ``_concurrency`` measures: the main one (the smallest that takes ``busy_target_s`` x 3) and DDP's bucket sizes below it."""
    main = next((r["size"] for r in rows if r["time_s"] >= 3 * plan.busy_target_s), rows[-1]["size"])
    return sorted({s for s in PAIR_SIZES if s < main} | {main})


def _concurrency(rows: list[dict], n: int, pairs: dict[int, tuple[list[float], list[float]]]) -> dict:
    """Link time per byte of all-reduce when two run at once (gloo runs two ops of a group together), by size.

    One all-reduce leaves the link idle part of its time (the ring waits on each step's
    reduction and round trip); a second op in flight fills it. Measured at 100 Mbit/s, 1 ms: a
    2.1 MB all-reduce alone 193 ms, with a 0.37 MB one issued 36 ms in 214 ms together where
    one after the other is 228. Two all-reduces of S bytes started together take ``T2``; their
    bytes share the link, so its time per byte is ``(T2 - t(4 B)) / 2S`` (the latency once).
    The main S is the smallest measured size that takes ``busy_target_s`` x 3 (long enough that
    the link, not the start, dominates); ``points`` adds DDP's bucket sizes below it, where the
    share differs: at 10 Gbit/s two 64 MiB ops read 1.4 ns/B, a 1 MiB and a 0.5 MiB one 2.9-4.0
    ms together against 3.3-4.6 one after the other (0.9 of serial, where the 64 MiB figure lets
    the model overlap a third of each). ``pairs``: per size, the samples of one alone and of two
    at once (``_pair_samples``); medians.
    """
    latency = rows[0]["time_s"]
    points = []
    for size, (single, two) in sorted(pairs.items()):
        t1, t2 = statistics.median(single), statistics.median(two)
        points.append({"size": size, "single_s": t1, "pair_s": t2,
                       "sec_per_byte": max(t2 - latency, 0.0) / (2 * size),
                       "single_samples": single, "pair_samples": two})
    top = points[-1]
    # Every size keeps its samples: what a resampling of the calibration draws from (fidelity/resample.py).
    return {**top, "ranks": n, "points": points}


def pair_ratios(concurrency: dict) -> list[tuple[int, float]]:
    """(size, two at once over one after the other) per size the profile's ``concurrency`` measured."""
    return [(pt["size"], pt["pair_s"] / (2 * pt["single_s"])) for pt in concurrency.get("points") or []
            if pt["single_s"] > 0]


def _pair_samples(size: int, repeats: int, decide) -> tuple[list[float], list[float]]:
    """Seconds of one all-reduce of ``size`` bytes alone and of two at once, alternating; the slowest rank's."""
    import torch
    import torch.distributed as dist

    a, b = torch.ones(max(1, size // 4)), torch.ones(max(1, size // 4))
    dist.all_reduce(a)

    def two() -> None:
        for w in [dist.all_reduce(x, async_op=True) for x in (a, b)]:
            w.wait()

    single, pair = [], []
    for _ in range(repeats):
        single.append(_after_barrier(lambda: dist.all_reduce(a)))
        pair.append(_after_barrier(two))
    both = decide(single + pair)
    return both[:repeats], both[repeats:]


def _op_call(op: Op, size: int, rank: int, n: int, device=None):
    """A zero-argument function running ``op`` on ``size`` bytes (nccl-tests size) on ``device``, and the bytes it really moves."""
    import functools

    import torch
    import torch.distributed as dist

    ones = functools.partial(torch.ones, device=device)
    empty = functools.partial(torch.empty, device=device)

    elems = max(1, size // 4)
    if op in _CHUNKED:
        elems = max(n, (elems + n - 1) // n * n)  # n equal chunks of at least one element
    nbytes = elems * 4
    if op is Op.ALL_REDUCE:
        x = ones(elems)
        return (lambda: dist.all_reduce(x)), nbytes
    if op is Op.BROADCAST:
        x = ones(elems)
        return (lambda: dist.broadcast(x, 0)), nbytes
    if op is Op.REDUCE:
        x = ones(elems)
        return (lambda: dist.reduce(x, 0)), nbytes
    # torch 2.13 renamed the tensor forms (the old names warn); older releases have only those.
    if op is Op.ALL_GATHER:
        out, inp = empty(elems), ones(elems // n)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(out, inp)), nbytes
    if op is Op.REDUCE_SCATTER:
        inp, out = ones(elems), empty(elems // n)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, inp)), nbytes
    if op is Op.ALL_TO_ALL:
        inp, out = ones(elems), empty(elems)
        return (lambda: dist.all_to_all_single(out, inp)), nbytes
    if op is Op.GATHER:
        inp = ones(elems // n)
        outs = [empty(elems // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.gather(inp, outs, dst=0)), nbytes
    if op is Op.SCATTER:
        out = empty(elems // n)
        ins = [ones(elems // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.scatter(out, ins, src=0)), nbytes
    if op is Op.SEND_RECV:
        # nccl-tests SendRecv: every rank sends to the next and receives from the previous, at once.
        send, recv = ones(elems), empty(elems)

        def sendrecv() -> None:
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
            for r in reqs:
                r.wait()

        return sendrecv, nbytes
    if op is Op.BARRIER:
        return (lambda: dist.barrier()), 0
    raise ValueError(f"{op.value} cannot be calibrated")


if __name__ == "__main__":
    _worker(sys.argv[1])
