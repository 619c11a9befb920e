"""A calibration that repeats: robust per-size times, the median's interval, the top-up rounds and the resampling of a profile (no root)."""

from __future__ import annotations

import random
import statistics

import pytest

from neuronabox.fidelity.calibrate import default_sizes, settle_times
from neuronabox.fidelity.fit import fit_line
from neuronabox.fidelity.measure import WorkerPlan, _top_up
from neuronabox.fidelity.resample import bootstrap, halves, refit
from neuronabox.fidelity.robust import l1_line, local_times, median_halfwidth, median_interval
from neuronabox.model.calibrated import CalibratedModel
from neuronabox.collectives import Op

from .conftest import topo

TWO = topo("name: two\ncluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 100Mbps, latency: 100us}}\n"
           "emulation: {library: gloo}\n")


def truth(size: float) -> float:
    """A 100 Mbit/s all-reduce of 2 ranks: 1 ms of latency terms, then the link (t = max of a level and a line)."""
    return max(1e-3, 0.4e-3 + size / 11.9e6)


def sweep(seed: int = 3, samples: int = 3, disturbed: dict[int, int] | None = None) -> list[dict]:
    """Rows of a sweep 4 B to 8 MiB: each sample the truth +-0.5 %, and at sizes in ``disturbed`` that many samples +40 % (a core taken)."""
    rng = random.Random(seed)
    rows = []
    for s in default_sizes(4, 8 << 20):
        xs = [truth(s) * (1 + rng.uniform(-0.005, 0.005)) for _ in range(samples)]
        for i in range((disturbed or {}).get(s, 0)):
            xs[i] *= 1.4
        rows.append({"size": s, "time_s": statistics.median(xs), "k": 1, "samples": xs, "per_pass": 1,
                     "rounds": samples})
    return rows


def test_median_interval_is_order_statistics():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # three samples: min..max
    xs = [float(i) for i in range(1, 26)]
    assert median_interval(xs) == (8.0, 18.0)  # n=25: the 8th and 18th, the textbook 95 % ranks
    assert median_halfwidth([1.0, 1.0, 1.0, 1.0]) == float("inf")  # min..max of 4 covers the median 88 %: too few
    assert median_halfwidth([1.0, 1.0, 1.02, 0.98, 1.0]) == pytest.approx(0.02)
    assert median_halfwidth([1.0] * 10) == 0.0


def test_l1_line_ignores_a_minority_of_disturbed_points_where_least_squares_does_not():
    rng = random.Random(5)
    s = [float(x) for x in default_sizes(256 << 10, 8 << 20) for _ in range(5)]
    t = [2e-3 + x / 12e6 for x in s]
    for i in rng.sample(range(len(t)), len(t) * 3 // 10):  # 30 % of the samples +50 %
        t[i] *= 1.5
    a, b = l1_line(s, t)
    assert b == pytest.approx(1 / 12e6, rel=1e-3) and a == pytest.approx(2e-3, rel=0.02)
    assert fit_line(s, t)[1] > 1.05 / 12e6  # least squares follows them


def test_settled_times_hold_where_a_median_of_three_follows_two_disturbed_samples():
    # At 1 MiB two of three samples +40 %: the median reads 40 % high, the settled time is the link's.
    mib = 1 << 20
    rows = sweep(disturbed={mib: 2, 4 << 20: 1, 64 << 10: 2})
    measured = {"ops": {"all_reduce": rows}}
    settle_times(measured)
    for r in rows:
        assert r["time_s"] == pytest.approx(truth(r["size"]), rel=0.01), r["size"]
        lo, hi = median_interval(r["samples"])
        assert lo <= r["time_s"] <= hi  # never outside what its own samples allow
    by = {r["size"]: r for r in rows}
    assert by[mib]["median_s"] > 1.35 * truth(mib)


def test_settled_times_keep_the_kink_between_latency_and_bandwidth():
    rows = sweep(seed=9, samples=7)
    settled = local_times(rows)
    for r, t in zip(rows, settled):
        assert t == pytest.approx(truth(r["size"]), rel=0.01), r["size"]


def test_settled_prediction_moves_less_than_the_median_between_draws_of_one_noisy_host():
    # Ten calibrations of one link on a host that takes a core now and then: a third of the
    # samples +10-60 %, five samples a size. What the model predicts for DDP's buckets: the
    # medians follow a size whose majority was disturbed (up to +18 % here), the settled times do not.
    sizes = (372992, 1071144, 2100008)
    preds = {"median": [], "settled": []}
    for seed in range(10):
        rng = random.Random(100 + seed)
        rows = sweep(seed=seed, samples=5)
        for r in rows:
            r["samples"] = [x * (1 + rng.uniform(0.1, 0.6)) if rng.random() < 1 / 3 else x for x in r["samples"]]
        profile = {"ranks": 2, "measurements": {"all_reduce": rows}}
        for name, settle in (("median", False), ("settled", True)):
            model = CalibratedModel(TWO, profile=refit(profile, profile["measurements"], settle))
            preds[name].append(sum(model.estimate(Op.ALL_REDUCE, s, range(2)).duration for s in sizes))
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in preds.items()}
    assert spread["settled"] < 0.01 and spread["median"] > 0.05
    assert statistics.median(preds["settled"]) == pytest.approx(sum(truth(s) for s in sizes), rel=0.01)


def test_halves_split_by_round_and_bootstrap_is_seeded():
    row = {"size": 1 << 20, "time_s": 1.0, "k": 1, "per_pass": 2, "samples": [1.0, 1.1, 2.0, 2.1, 3.0, 3.1]}
    a, b = halves({"all_reduce": [row]})
    assert a["all_reduce"][0]["samples"] == [1.0, 1.1, 3.0, 3.1] and b["all_reduce"][0]["samples"] == [2.0, 2.1]
    one = {"size": 4, "time_s": 1.0, "k": 1, "per_pass": 3, "samples": [1.0, 2.0, 3.0]}
    assert halves({"x": [one]})[1]["x"][0]["samples"] == [1.0, 2.0, 3.0]  # one round: in both
    d1 = bootstrap({"all_reduce": [row]}, random.Random(4))
    d2 = bootstrap({"all_reduce": [row]}, random.Random(4))
    assert d1 == d2 and set(d1["all_reduce"][0]["samples"]) <= set(row["samples"])


def test_top_up_samples_uncertain_sizes_only_and_within_its_budgets():
    """Real gloo, one rank: a row whose median is known gets nothing; an uncertain one gets rounds up to max_samples."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def decide(values):
            return list(values)

        sure = {"size": 4, "time_s": 1e-5, "k": 2, "per_pass": 2, "rounds": 3, "samples": [1e-5] * 6}
        unsure = {"size": 1024, "time_s": 1e-5, "k": 2, "per_pass": 2, "rounds": 3,
                  "samples": [1e-5, 5e-5, 1e-4, 2e-6, 4e-5, 3e-4]}
        plan = WorkerPlan(["all_reduce"], [4, 1024], max_samples=14, ci_target=0.02, topup_s=10.0)
        _top_up(plan, {"all_reduce": [sure, unsure]}, 0, 1, None, lambda: None, decide)
        assert len(sure["samples"]) == 6 and sure["rounds"] == 3
        assert len(unsure["samples"]) >= 14 and unsure["rounds"] == 3 + (len(unsure["samples"]) - 6) // 2
        assert unsure["time_s"] == statistics.median(unsure["samples"])
        # A total budget already spent by the first round's samples: one round, no more.
        again = dict(unsure, samples=[1e-5, 5e-5, 1e-4, 2e-6, 4e-5, 3e-4], rounds=3)
        _top_up(WorkerPlan(["all_reduce"], [1024], max_samples=40, topup_total_s=1e-12), {"all_reduce": [again]},
                0, 1, None, lambda: None, decide)
        assert len(again["samples"]) == 8
        # From bucket_min up (DDP's buckets) a row is sampled to the tighter target, up to its own cap.
        noisy = [1e-5, 1.008e-5, 0.992e-5, 1.004e-5, 1.006e-5, 0.996e-5]  # within +-0.8 %: known at 2 %, not 0.5 %
        small = {"size": 1024, "time_s": 1e-5, "k": 2, "per_pass": 2, "rounds": 3, "samples": list(noisy)}
        big = {"size": 1 << 20, "time_s": 1e-5, "k": 2, "per_pass": 2, "rounds": 3, "samples": list(noisy)}
        plan = WorkerPlan(["all_reduce"], [1024, 1 << 20], ci_target=0.02, bucket_ci_target=0.005,
                          bucket_max_samples=12, topup_s=10.0, bucket_topup_s=10.0)
        _top_up(plan, {"all_reduce": [small, big]}, 0, 1, None, lambda: None, decide)
        assert len(small["samples"]) == 6
        assert 6 < len(big["samples"]) <= 12 + 2 - 1
        # ... and there a narrow interval from few samples does not stop it before bucket_min_samples.
        tight = {"size": 1 << 20, "time_s": 1e-5, "k": 2, "per_pass": 2, "rounds": 3, "samples": [1e-5] * 6}
        plan = WorkerPlan(["all_reduce"], [1 << 20], bucket_min_samples=10, bucket_topup_s=10.0)
        _top_up(plan, {"all_reduce": [tight]}, 0, 1, None, lambda: None, decide)
        assert len(tight["samples"]) >= 10
    finally:
        dist.destroy_process_group()
