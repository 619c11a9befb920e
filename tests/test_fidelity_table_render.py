"""The error interval (a bootstrap over whole runs, seeded) and the fidelity table's cell."""

from .conftest import benchmark_module


def table():
    return benchmark_module("fidelity_table")


def test_the_interval_brackets_the_error_and_widens_with_the_run_to_run_noise():
    from neuronabox.stats import error_interval

    ft = table()
    real = [0.100, 0.101, 0.099, 0.100, 0.102]
    lo, hi = error_interval(real, [x * 1.10 for x in real])
    assert lo - 1e-9 <= 0.10 <= hi + 1e-9
    assert hi - lo < 0.05
    noisy = [0.080, 0.120, 0.095, 0.110, 0.100]
    lo2, hi2 = error_interval(noisy, [x * 1.10 for x in real])
    assert hi2 - lo2 > 2 * (hi - lo)
    assert error_interval(real, real) == error_interval(real, real)  # seeded: the same table twice
    assert error_interval(real[:1], real) is None
    assert ft._error_cell({"error": 0.0316, "median_s": 0.149, "verdict": "FAIL", "run_medians_s": real}, real).startswith("+3.16% [")
