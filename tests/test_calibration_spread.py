"""The calibration-spread benchmark: what it reads from a profile, and its per-system summary."""

import pytest

from .conftest import benchmark_module


def spread():
    return benchmark_module("calibration_spread")


def test_profile_figures_read_the_1mib_sweep_point_the_pair_ratio_and_the_busy_rate():
    profile = {
        "measurements": {"all_reduce": [{"size": 4, "time_s": 0.002}, {"size": 1 << 20, "time_s": 0.094}]},
        "concurrency": {"points": [{"size": 262144, "single_s": 0.025, "pair_s": 0.046},
                                   {"size": 1 << 20, "single_s": 0.095, "pair_s": 0.19}]},
        "busy_progress": {"rate": 0.9},
    }
    f = spread().profile_figures(profile)
    assert f["all_reduce_1MiB_s"] == pytest.approx(0.094)
    assert f["pair_ratio_1MiB"] == pytest.approx(1.0)
    assert f["busy_rate"] == pytest.approx(0.9)


def test_profile_figures_say_none_for_what_a_profile_lacks():
    assert spread().profile_figures({}) == {"all_reduce_1MiB_s": None, "pair_ratio_1MiB": None, "busy_rate": None}


def test_summary_is_the_median_and_range_of_each_systems_runs_and_skips_empty_ones():
    s = spread().summary({"real": [0.150, 0.145, 0.153], "profile 0": [], "profile 1": [0.148]})
    assert s["real"] == {"median": 0.150, "min": 0.145, "max": 0.153}
    assert s["profile 1"]["median"] == 0.148 and "profile 0" not in s
