"""Gloo's spin stalls in model mode: drawn per op from the profile by size and idle gap, spent on the real rank's core."""

from __future__ import annotations

import time

import pytest

from neuronabox.collectives import Op
from neuronabox.emu.host_effects.spin_stall import BACK_TO_BACK_S, SpinStall


def profile(cells: list[tuple[int, float, list[list[float]]]]) -> dict:
    return {"spin_stall": {"ranks": 2, "cells": [{"size": s, "gap_s": g, "samples": rows} for s, g, rows in cells]}}


PROFILE = profile([
    (4, 0.002, [[0.0, 0.0, 0.0]]),
    (4, 0.02, [[0.003, 0.003, 0.0]]),
    (262144, 0.002, [[0.001, 0.0, 0.001]]),
    (262144, 0.02, [[0.005, 0.0, 0.005]]),
])


def test_no_samples_or_no_excess_means_no_stalls():
    assert SpinStall.from_profile(None) is None
    assert SpinStall.from_profile({"busy_progress": {"rate": 0.5}}) is None
    assert SpinStall.from_profile(profile([(4, 0.02, [[0.0, 0.0, 0.0]] * 5)])) is None


@pytest.mark.parametrize("nbytes, gap, wall", [
    (4, 0.001, 0.0), (4, 0.05, 0.003), (1000, 0.02, 0.003),  # 1000 B is nearer 4 B than 256 KiB on a log scale
    (100_000, 0.02, 0.005), (64 << 20, 0.002, 0.001), (1 << 20, 0.02, 0.005),
])
def test_the_nearest_size_and_a_measured_or_outlying_gap(nbytes, gap, wall):
    st = SpinStall.from_profile(PROFILE, seed=1)
    assert st.draw(nbytes, gap)[0] == wall


@pytest.mark.parametrize("gap", [0.003, 0.0063, 0.015])
def test_a_gap_between_two_measured_ones_draws_from_both_by_nearness_on_a_log_scale(gap):
    import math

    st = SpinStall.from_profile(PROFILE, seed=2)
    w = math.log(gap / 0.002) / math.log(10)  # the share of the 20 ms cell
    draws = [st.draw(262144, gap)[0] for _ in range(4000)]
    assert set(draws) == {0.001, 0.005}
    assert draws.count(0.005) / len(draws) == pytest.approx(w, abs=0.03)
    assert st.mean(262144, gap)[0] == pytest.approx((1 - w) * 0.001 + w * 0.005)


def test_this_rank_spins_as_any_one_of_the_sampled_ranks():
    st = SpinStall.from_profile(profile([(4, 0.02, [[0.004, 0.004, 0.0]])]), seed=3)
    spins = {st.draw(4, 0.02)[1] for _ in range(200)}
    assert spins == {0.004, 0.0}
    assert st.mean(4, 0.02) == (0.004, 0.002)


def test_draws_follow_the_samples_and_a_seed_repeats_them():
    rows = [[0.0, 0.0, 0.0]] * 3 + [[0.004, 0.004, 0.0]]
    p = profile([(4, 0.02, rows)])
    a, b = SpinStall.from_profile(p, seed=7), SpinStall.from_profile(p, seed=7)
    draws = [a.draw(4, 0.02) for _ in range(2000)]
    assert draws == [b.draw(4, 0.02) for _ in range(2000)]
    assert sum(1 for w, _ in draws if w > 0) / 2000 == pytest.approx(0.25, abs=0.04)


def _timeline(stall: SpinStall):
    from neuronabox.emu.timeline import Recorder, Timeline
    from neuronabox.model.base import CommModel, Estimate, Group
    from neuronabox.topology import parse_topology

    class Const(CommModel):
        name = "const"

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(0.001, "const")

    topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n")
    return Timeline("comm0", Group((0, 1)), Const(topo), Recorder(), [stall])


def test_an_op_issued_on_an_idle_communicator_lasts_its_stall_longer():
    tl = _timeline(SpinStall.from_profile(profile([(4, 0.02, [[0.003, 0.003, 0.003]])])))
    t = time.perf_counter()
    first = tl.schedule(Op.ALL_REDUCE, 4, ready=t)
    # the bytes move after the spin: the op starts its stall late and then takes its modeled time
    assert first.stall == 0.003 and first.start == pytest.approx(t + 0.003) and first.end - first.start == pytest.approx(0.001)
    # issued back to back after it: part of a loop, which the profile's own times hold
    loop = tl.schedule(Op.ALL_REDUCE, 4, ready=first.end + BACK_TO_BACK_S / 2)
    assert loop.stall == 0.0 and loop.duration == pytest.approx(0.001)
    # issued while the previous op runs: one I/O thread, one stall for both
    beside = tl.schedule(Op.ALL_REDUCE, 4, ready=loop.end - 0.0005)
    assert beside.stall == 0.0
    later = tl.schedule(Op.ALL_REDUCE, 4, ready=beside.end + 0.02)
    assert later.stall == 0.003 and later.as_dict()["stall"] == 0.003


def test_an_op_issued_in_another_s_stall_moves_its_bytes_while_the_link_waits():
    """Gloo's second worker thread: the link is idle while the first op waits out its spin, so the second fits there."""
    from neuronabox.emu.timeline import Recorder, Timeline
    from neuronabox.model.base import CommModel, Estimate, Group
    from neuronabox.topology import parse_topology

    class LinkBound(CommModel):  # every op's time is link time: two at once share it
        name = "link-bound"

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(0.001 if nbytes > 4 else 0.0, "const")

        def link_time(self, op, nbytes, group, root=0):
            return self.estimate(op, nbytes, group, root).duration

    topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n")
    ends = {}
    for wall in (0.003, 0.0):
        tl = Timeline("comm0", Group((0, 1)), LinkBound(topo), Recorder())
        tl.slots = 2
        if wall:
            tl.attach(SpinStall({(1 << 20, 0.02): [(0, [wall, 0.0, 0.0])]}))
        t = time.perf_counter()
        first = tl.schedule(Op.ALL_REDUCE, 1 << 20, ready=t)
        second = tl.schedule(Op.ALL_REDUCE, 1 << 19, ready=t + 0.0005)
        ends[wall] = (first.end - t, second.end - t)
    assert ends[0.003] == pytest.approx((0.004, 0.004))  # 1 ms of bytes in the 2.5 ms the first still waits
    assert ends[0.0] == pytest.approx((0.001, 0.002))  # no stall: the link is busy, so it queues


def test_an_op_drawn_faster_than_the_profile_s_time_is_shorter_not_early():
    # The sweep's median can sit between two modes: an op after compute that took the fast one
    # took less than it, down to a floor for sizes far from the measured one.
    tl = _timeline(SpinStall.from_profile(profile([(4, 0.02, [[-0.0004, 0.0, 0.0]]), (1 << 20, 0.02, [[0.003, 0.0, 0.0]])])))
    t = time.perf_counter()
    fast = tl.schedule(Op.ALL_REDUCE, 4, ready=t)
    assert fast.stall == 0.0 and fast.start == pytest.approx(t) and fast.duration == pytest.approx(0.0006)
    tl2 = _timeline(SpinStall.from_profile(profile([(4, 0.02, [[-0.005, 0.0, 0.0]]), (1 << 20, 0.02, [[0.003, 0.0, 0.0]])])))
    assert tl2.schedule(Op.ALL_REDUCE, 4, ready=t).duration == pytest.approx(0.0001)  # FASTEST_SHARE of 1 ms


def test_the_real_rank_s_own_spin_is_spent_on_its_core_unscaled_and_never_holds_the_op():
    from neuronabox.emu.host_effects.footprint import Footprint

    tl = _timeline(SpinStall.from_profile(profile([(4, 0.02, [[0.040, 0.015, 0.015]])])))
    # Scale 3 multiplies the calibrated cost (here none) but not the measured spin.
    fp = Footprint(0.0, 0.0, scale=3.0)
    tl.attach(fp)
    t = time.perf_counter()
    r = tl.schedule(Op.ALL_REDUCE, 4, ready=t)
    fp.wait(r)
    assert time.perf_counter() < r.end + 0.005  # done at its modeled end, the spin not awaited
    time.sleep(max(0.0, r.end - time.perf_counter()) + 0.01)
    assert fp.spent == pytest.approx(0.015, abs=0.004)  # spent within the stall and the op
    fp.stop()


def test_a_communicator_draws_from_one_measured_process_group():
    rows = [[0.004, 0.004, 0.0]] * 4 + [[0.0, 0.0, 0.0]] * 4
    p = {"spin_stall": {"ranks": 2, "cells": [{"size": 4, "gap_s": 0.02, "samples": rows, "groups": [0] * 4 + [1] * 4}]}}
    st = SpinStall.from_profile(p, seed=5)
    seen = set()
    for _ in range(20):
        view = st.for_communicator()
        seen.add(frozenset(view.draw(4, 0.02)[0] for _ in range(30)))
    assert seen == {frozenset({0.004}), frozenset({0.0})}  # each view one group's; both groups picked
    assert {st.draw(4, 0.02)[0] for _ in range(200)} == {0.004, 0.0}  # the whole: every group


def test_the_footprint_scale_leaves_out_what_the_spins_took():
    from neuronabox.emu.host_effects.footprint import interference

    cost = {"per_op_s": 0.0, "per_byte_s": 1e-9}
    busy = {"rate": 0.5, "size": 4_000_000, "lost_compute_s": [0.006, 0.008]}
    assert interference({"cpu_cost": cost, "busy_progress": busy}) == pytest.approx(4.0)
    # the mean spin of one rank at that size, after the shortest gap: 2 ms of the 8 lost
    with_spins = {"cpu_cost": cost, "busy_progress": busy,
                  **profile([(4_000_000, 0.002, [[0.004, 0.004, 0.0]]), (4_000_000, 0.02, [[0.02, 0.02, 0.02]])])}
    assert interference(with_spins) == pytest.approx(3.0)


def test_the_emulator_draws_stalls_only_for_a_modeled_cpu_library():
    from neuronabox.emu.emulator import Emulator
    from neuronabox.model.base import CommModel, Estimate, Group
    from neuronabox.topology import parse_topology

    class Profiled(CommModel):
        name = "profiled"
        profile = PROFILE

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(0.001, "const")

    for library, expect in (("gloo", True), ("nccl", False)):
        topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n"
                              f"emulation: {{library: {library}}}\n")
        emu = Emulator(topo, 0, model=Profiled(topo))
        assert (emu.new_timeline(Group((0, 1))).effect(SpinStall) is not None) is expect


def test_the_wire_thread_waits_a_stall_spending_its_spin_in_cpu():
    from neuronabox.emu.host_effects.spin_stall import wait_spinning

    t, c = time.perf_counter(), time.thread_time()
    wait_spinning(0.030, 0.010)
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    assert wall >= 0.030 and cpu == pytest.approx(0.010, abs=0.004)


def test_wire_mode_waits_only_as_long_as_a_rank_spun():
    """The rest of the excess is the path's own cost after idling, which wire mode's real sockets pay."""
    st = SpinStall.from_profile(profile([(4, 0.02, [[0.005, 0.003, 0.001]])]), seed=2)
    assert st.for_communicator().draw(4, 0.02)[0] == 0.005
    wire = st.for_communicator(spin_only=True)
    assert {wire.draw(4, 0.02) for _ in range(50)} == {(0.003, 0.003), (0.003, 0.001)}
