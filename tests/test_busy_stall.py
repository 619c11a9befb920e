"""The busy-progress curve: an op stalls over its first compute, then moves at a rate; fitted by least absolute deviations."""

from __future__ import annotations

import random

import pytest

from neuronabox.fidelity.busy_stall import busy_loss, fit_busy_stall


def test_loss_is_all_of_the_compute_up_to_the_stall_then_a_rate():
    assert busy_loss(0.002, 0.004, 0.9) == pytest.approx(0.002)
    assert busy_loss(0.024, 0.004, 0.9) == pytest.approx(0.004 + 0.1 * 0.020)
    assert busy_loss(0.024, 0.0, 0.9) == pytest.approx(0.1 * 0.024)  # no stall: the rate alone


def test_the_fit_finds_a_stall_and_a_rate_under_two_mode_noise():
    rng = random.Random(3)
    windows = [0.06 / 2 ** k for k in range(6)]
    pts = []
    for c in windows:
        for _ in range(21):
            # Most samples on the curve, a third lose nothing (the threads got the core at once).
            pts.append((c, busy_loss(c, 0.004, 0.95) + rng.gauss(0, 0.0003) if rng.random() > 0.33 else rng.gauss(0, 0.0003)))
    stall, rate = fit_busy_stall(pts)
    assert stall == pytest.approx(0.004, abs=0.0008)
    assert rate == pytest.approx(0.95, abs=0.02)


def test_the_fit_ignores_rare_long_delays():
    rng = random.Random(3)
    windows = [0.06 / 2 ** k for k in range(6)]
    pts = []
    for c in windows:
        for i in range(31):
            # Losses spread by +-2 ms about the curve; one in 31 a stray scheduler delay of 30 ms.
            pts.append((c, busy_loss(c, 0.004, 0.95) + rng.uniform(-0.002, 0.002) + (0.03 if i == 7 else 0.0)))
    stall, rate = fit_busy_stall(pts)
    assert stall == pytest.approx(0.004, abs=0.0008)
    assert rate == pytest.approx(0.95, abs=0.02)


def test_each_window_is_measured_against_its_own_ops_idle_time():
    from neuronabox.fidelity.busy_stall import fit_windows

    ops = {0.06 / 2 ** k: 0.06 / 2 ** k for k in range(6)}  # each window beside an op lasting as long
    windows = [{"compute_s": c, "idle_samples": [w] * 5, "samples": [w + busy_loss(c, 0.003, 0.97)] * 5}
               for c, w in ops.items()]
    stall, rate = fit_windows(0.06, windows)
    assert stall == pytest.approx(0.003, abs=0.0004) and rate == pytest.approx(0.97, abs=0.01)
    # an older profile's windows, all beside one op, read the profile's idle time
    old = [{"compute_s": c, "samples": [0.06 + busy_loss(c, 0.003, 0.97)] * 5} for c in ops]
    assert fit_windows(0.06, old) == pytest.approx((stall, rate), abs=0.0004)


def test_a_loss_in_proportion_to_the_compute_fits_no_stall():
    pts = [(c, 0.3 * c) for c in (0.002, 0.004, 0.008, 0.016, 0.032)]
    stall, rate = fit_busy_stall(pts)
    assert stall == pytest.approx(0.0, abs=1e-9) and rate == pytest.approx(0.7)


def test_the_rate_is_held_within_its_bounds():
    stall, rate = fit_busy_stall([(0.01, 0.05), (0.02, 0.09)], min_rate=0.02)
    assert 0.02 <= rate <= 1.0
    with pytest.raises(ValueError):
        fit_busy_stall([(0.0, 0.001)])


def test_a_profiles_stall_is_redrawn_from_its_own_samples():
    from neuronabox.fidelity.resample import figure_draws

    rng = random.Random(5)
    idle = [0.060 + rng.gauss(0, 0.0002) for _ in range(21)]
    windows = [{"compute_s": c, "idle_samples": [c + rng.gauss(0, 0.0002) for _ in range(21)],
                "samples": [c + busy_loss(c, 0.003, 0.96) + rng.gauss(0, 0.0003) for _ in range(21)]}
               for c in (0.06 / 2 ** k for k in range(6))]
    profile = {"busy_progress": {"rates": [0.9] * 21, "idle_samples": idle, "windows": windows}}
    got = figure_draws(profile, random.Random(1), 20)
    assert len(got["busy_stall_s"]) == 20 and all(abs(s - 0.003) < 0.001 for s in got["busy_stall_s"])
    assert all(abs(r - 0.96) < 0.02 for r in got["busy_rate_after_stall"])
