"""Host coupling: a CPU library's op progresses slower while the rank's process computes."""

from __future__ import annotations

import time

import pytest

from neuronabox.collectives import Op
from neuronabox.emu.host_effects.host_coupling import MIN_RATE, HostCoupling, busy_rate_from_profile, busy_stall_from_profile
from neuronabox.emu.timeline import OpRecord


class FakeCPU:
    """A process CPU clock the test moves by hand."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rec(seq: int, start: float, duration: float) -> OpRecord:
    r = OpRecord(seq, "comm0", Op.ALL_REDUCE, (0, 1), 1 << 20, 0, "ring", 0, start, duration, 0.0)
    r.ready = r.start = start
    return r


def test_an_idle_host_finishes_at_the_modeled_time():
    cpu = FakeCPU()
    c = HostCoupling(0.1, cpu)
    c.settle(0.0)
    r = rec(0, 0.0, 0.010)
    assert c.admit(r, float("-inf")) == pytest.approx(0.010)
    c.settle(0.010)
    assert c.done(r) and r.end == pytest.approx(0.010)


def test_computing_slows_the_op_by_the_busy_rate():
    cpu = FakeCPU()
    c = HostCoupling(0.1, cpu)
    c.settle(0.0)
    r = rec(0, 0.0, 0.010)
    c.admit(r, float("-inf"))
    cpu.t = 0.010  # computed the whole 10 ms: 1 ms of progress
    c.settle(0.010)
    assert not c.done(r) and r.end == pytest.approx(0.019)  # 9 ms left, idle from now on
    c.settle(0.019)  # idle meanwhile
    assert c.done(r) and r.end == pytest.approx(0.019)


def test_half_busy_interval_counts_its_cpu_time_exactly():
    cpu = FakeCPU()
    c = HostCoupling(0.0, cpu)  # floored at MIN_RATE
    c.settle(0.0)
    r = rec(0, 0.0, 0.010)
    c.admit(r, float("-inf"))
    cpu.t = 0.005  # 5 of 10 ms computing
    c.settle(0.010)
    left = 0.010 - (0.005 + 0.005 * MIN_RATE)
    assert r.end == pytest.approx(0.010 + left)


def test_ops_behind_a_slowed_op_start_after_it_ends():
    cpu = FakeCPU()
    c = HostCoupling(0.5, cpu)
    c.settle(0.0)
    a, b = rec(0, 0.0, 0.010), rec(1, 0.0, 0.004)
    c.admit(a, float("-inf"))
    c.admit(b, a.end)
    assert b.start == pytest.approx(0.010) and b.end == pytest.approx(0.014)
    cpu.t = 0.010
    c.settle(0.010)  # a made 5 ms of progress
    assert a.end == pytest.approx(0.015) and b.start == pytest.approx(0.015) and b.end == pytest.approx(0.019)
    c.settle(0.019)
    assert c.done(a) and c.done(b) and a.end == pytest.approx(0.015) and b.end == pytest.approx(0.019)


def stalled_op() -> tuple[FakeCPU, HostCoupling, OpRecord]:
    """A 10 ms op admitted at 0 on an accounting with a 4 ms stall, then rate 0.9."""
    cpu = FakeCPU()
    c = HostCoupling(0.9, cpu, stall=0.004)
    c.settle(0.0)
    r = rec(0, 0.0, 0.010)
    c.admit(r, float("-inf"))
    return cpu, c, r


def test_an_op_makes_no_progress_over_its_stall_then_moves_at_the_rate():
    cpu, c, r = stalled_op()
    cpu.t = 0.010  # computed the whole 10 ms: none over the first 4, then 0.9 of 6
    c.settle(0.010)
    assert not c.done(r) and r.end == pytest.approx(0.010 + 0.010 - 0.9 * 0.006)
    c.settle(r.end)
    assert c.done(r)


def test_a_half_busy_host_sits_out_the_stall_over_twice_the_wall_time():
    cpu, c, r = stalled_op()
    cpu.t = 0.005  # 5 of 10 ms computing: the stall's 4 ms of compute take 8 ms, half of them moving
    c.settle(0.010)
    made = 0.5 * 0.008 + (1 - 0.5 * 0.1) * 0.002
    assert r.end == pytest.approx(0.010 + 0.010 - made)


def test_the_stall_is_each_ops_own_and_a_short_compute_costs_all_of_it():
    cpu = FakeCPU()
    c = HostCoupling(0.9, cpu, stall=0.004)
    c.settle(0.0)
    a, b = rec(0, 0.0, 0.003), rec(1, 0.0, 0.003)
    c.admit(a, float("-inf"))
    c.admit(b, a.end)
    cpu.t = 0.002  # 2 ms of compute: a loses both
    c.settle(0.002)
    assert a.end == pytest.approx(0.005) and b.start == pytest.approx(0.005)
    c.settle(0.005)  # idle since: a is done; b, not yet started, has its whole stall ahead
    assert c.done(a) and not c.done(b)
    cpu.t = 0.003
    c.settle(0.006)
    assert b.end == pytest.approx(0.009)


def test_stall_from_a_profile():
    assert busy_stall_from_profile(None) == 0.0
    assert busy_stall_from_profile({"busy_progress": {"rate": 0.9}}) == 0.0
    bp = {"rate": 0.9, "stall_s": 0.003, "rate_after_stall": 0.97}
    assert busy_stall_from_profile({"busy_progress": bp}) == 0.003
    assert busy_rate_from_profile({"busy_progress": bp}) == 0.97  # the rate after the stall, not over the whole op


def test_rate_from_a_profile():
    assert busy_rate_from_profile(None) is None
    assert busy_rate_from_profile({"fits": {}}) is None
    assert busy_rate_from_profile({"busy_progress": {"rate": 0.25}}) == 0.25
    assert busy_rate_from_profile({"busy_progress": {"rate": 0.0}}) == MIN_RATE
    assert busy_rate_from_profile({"busy_progress": {"rate": 3}}) == 1.0


# ---- through the backend: a real training thread computing while the op is in flight --------------
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def emulate_const():
    from neuronabox.emu import api
    from neuronabox.model.base import CommModel, Estimate
    from neuronabox.topology import parse_topology

    class Const(CommModel):
        name = "const"

        def __init__(self, topology, duration, rate):
            super().__init__(topology)
            self.duration = duration
            self.profile = {"busy_progress": {"rate": rate}}

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(self.duration, "const")

    def start(duration: float, rate: float | None, library: str = "gloo"):
        topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n"
                              f"emulation: {{library: {library}}}\n")
        model = Const(topo, duration, rate)
        if rate is None:
            del model.profile
        api.init(topo, rank=0, model=model)
        return api

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield start
    torch.set_num_threads(threads)
    api.shutdown()


def _compute(seconds: float) -> None:
    a = torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


@pytest.mark.parametrize("how", ["wait", "future"])
def test_an_all_reduce_crawls_while_the_rank_computes(emulate_const, how):
    api = emulate_const(0.040, 0.1)
    x = torch.ones(1024)
    took = {}
    for computing in (0.0, 0.030):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            w = dist.all_reduce(x, async_op=True)
            if computing:
                _compute(computing)
            w.wait() if how == "wait" else w.get_future().wait()
            times.append(time.perf_counter() - t)
        took[computing] = sorted(times)[1]
    assert took[0.0] == pytest.approx(0.040, abs=0.006)
    # 30 ms computing moved 3 ms of the op's 40: 27 ms after plus 37 ms left = 67 ms
    assert took[0.030] == pytest.approx(0.067, abs=0.010)
    r = api.recorder().ops[-1]
    assert r.end - r.start == pytest.approx(0.067, abs=0.010) and r.duration == pytest.approx(0.040)


@pytest.mark.parametrize("library, ends", [("nccl", [1, 2, 3]), ("gloo", [1, 1, 2]), ("gloo, gloo_threads: 1", [1, 2, 3]),
                                            ("gloo, gloo_threads: 3", [1, 1, 1])])
def test_gloo_runs_two_ops_of_a_group_at_once(emulate_const, library, ends):
    """Gloo's two worker threads: a second op's latency overlaps the first; a third waits for a thread."""
    api = emulate_const(0.020, None, library)  # a constant model: all of an op's time is latency
    x = torch.ones(16)
    works = [dist.all_reduce(x.clone(), async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    ops = api.recorder().ops[-3:]
    t0 = ops[0].start
    assert [round((r.end - t0) / 0.020) for r in ops] == ends


def linear_100m():
    """A 100 Mbit/s model: one op alone 2 ms + bytes at 10.9 MB/s; two at once reach the link's 11.9 MB/s."""
    from neuronabox.model.base import CommModel, Estimate
    from neuronabox.topology import parse_topology

    class Linear(CommModel):
        name = "linear"

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(0.002 + nbytes / 10.9e6, "linear")

        def link_time(self, op, nbytes, group, root=0):
            return nbytes / 11.9e6

    return Linear(parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 100Mbps}}\nemulation: {library: gloo}\n"))


def test_a_second_gloo_op_fills_the_link_time_the_first_leaves_idle():
    """With the link share known (calibrated two-at-once), the second op overlaps its own idle part
    and the idle link time of the first, not just a latency: measured at 100 Mbit/s, a 0.37 MB
    all-reduce issued 36 ms into a 2.1 MB one ended 21 ms after it, where alone it takes 35."""
    from neuronabox.emu.timeline import Recorder, Timeline

    tl = Timeline("c", (0, 1), linear_100m(), Recorder())
    tl.slots = 2
    a = tl.schedule(Op.ALL_REDUCE, 2_100_000, ready=10.0)
    b = tl.schedule(Op.ALL_REDUCE, 373_000, ready=10.036)
    d_a, d_b, x_a, x_b = a.duration, b.duration, 2_100_000 / 11.9e6, 373_000 / 11.9e6
    idle = (a.end - b.start) * (1 - x_a / d_a)
    assert a.end == pytest.approx(10.0 + d_a)
    assert b.end == pytest.approx(a.end + d_b - ((d_b - x_b) + idle))
    # less than the latency-only rule (all of b but 2 ms after a), no less than b's bytes in a's idle link time
    assert x_b - idle - 1e-9 <= b.end - a.end < d_b - 0.002
    c = tl.schedule(Op.ALL_REDUCE, 373_000, ready=b.end + 1.0)  # nothing in flight: its own time
    assert c.end - c.start == pytest.approx(d_b)



def test_time_an_op_lost_to_compute_is_link_time_a_second_op_can_fill(monkeypatch):
    """The first op ran behind while the host computed; a second op issued then shares the link
    over the time the first really takes, so it ends sooner after the first than with an idle
    host's share (100 Mbit/s CNN: 2.1 MB bucket 6 ms behind, the 0.37 MB one still ended 17 ms
    after it, as with an idle host)."""
    import neuronabox.emu.timeline as tlmod
    from neuronabox.emu.timeline import Recorder, Timeline

    now = [10.0]
    monkeypatch.setattr(tlmod, "clock", lambda: now[0])
    ends = {}
    for busy in (False, True):
        cpu = FakeCPU()
        tl = Timeline("c", (0, 1), linear_100m(), Recorder())
        tl.slots = 2
        tl.attach(HostCoupling(0.5, cpu))
        now[0] = 10.0
        a = tl.schedule(Op.ALL_REDUCE, 2_100_000)
        now[0] = 10.036  # the host computed all 36 ms (busy) or slept
        cpu.t = 0.036 if busy else 0.0
        b = tl.schedule(Op.ALL_REDUCE, 373_000)
        assert tl.effect(HostCoupling).lost(a) == pytest.approx(0.018 if busy else 0.0)
        now[0] = 20.0
        tl.settle(b)
        ends[busy] = (a.end, b.end)
    (a_idle, b_idle), (a_busy, b_busy) = ends[False], ends[True]
    assert a_busy == pytest.approx(a_idle + 0.018)  # the first op itself is late by what it lost
    x_a, x_b, d_a = 2_100_000 / 11.9e6, 373_000 / 11.9e6, 0.002 + 2_100_000 / 10.9e6
    assert b_idle - a_idle == pytest.approx(x_b - (a_idle - 10.036) * (1 - x_a / d_a))
    # b's bytes against the link a leaves idle over the time a really takes (its 18 ms lost included)
    assert b_busy - a_busy == pytest.approx(x_b - (a_busy - 10.036) * (1 - x_a / (d_a + 0.018)))
    assert b_busy - a_busy < x_b - (a_busy - 10.036) * (1 - x_a / d_a) - 0.001  # sooner than an idle host's share

# ---- footprint: the op's CPU spent for real, competing with the training thread ------------------
def test_footprint_spends_the_cost_in_cpu_time_and_completes_after_it():
    from neuronabox.emu.host_effects.footprint import Footprint

    fp = Footprint(0.0, 0.0)
    a, b = rec(0, 0.0, 0.0), rec(1, 0.0, 0.0)
    a.end = b.end = 0.0
    t = time.perf_counter()
    fp.charge(a, 0.030)
    fp.charge(b, 0.010)
    seen = []
    fp.when_done(b, seen.append)
    fp.wait(b)  # FIFO: b's CPU comes after a's
    took = time.perf_counter() - t
    assert fp.done(a) and fp.done(b) and len(seen) == 1
    assert fp.spent == pytest.approx(0.040, abs=0.003)
    assert took >= 0.039 and a.end <= b.end
    fp.stop()


def test_footprint_spends_an_ops_cpu_as_its_bytes_move():
    """Not all at issue: spent up front, a 100 Mbit/s op's CPU took a burst from the compute beside it."""
    from neuronabox.emu.host_effects.footprint import Footprint

    fp = Footprint(0.0, 0.0)
    t = time.perf_counter()
    r = rec(0, t, 0.200)
    r.end = t + 0.200
    fp.charge(r, 0.020)
    time.sleep(0.050)
    early = fp.cpu_time()
    fp.wait(r)
    took = time.perf_counter() - t
    assert early < 0.012  # about a quarter of it by a quarter of the way (5 ms), not all 20 ms
    assert took >= 0.19 and fp.spent == pytest.approx(0.020, abs=0.003)
    fp.stop()


def test_an_op_whose_cpu_is_most_of_its_time_completes_with_its_end(monkeypatch):
    """Each paced quantum starts when its first part falls due: the last one ends with the op, not a quantum past it."""
    from neuronabox.emu.host_effects import footprint
    from neuronabox.emu.host_effects.footprint import Footprint

    monkeypatch.setattr(footprint, "QUANTUM", 0.040)  # coarse, so a quantum's lag would show
    fp = Footprint(0.0, 0.0)
    t = time.perf_counter()
    r = rec(0, t, 0.120)
    r.end = t + 0.120
    fp.charge(r, 0.090)  # CPU for three quarters of its time, as a 10 Gbit/s all-reduce
    fp.wait(r)
    took = time.perf_counter() - t
    fp.stop()
    assert fp.spent == pytest.approx(0.090, abs=0.006)
    assert took < 0.142  # spent a quantum behind its pace it ended 40 ms late, at 160 ms
    assert r.end == pytest.approx(t + 0.120, abs=0.020)


def test_footprint_cost_scales_by_the_bytes_each_rank_moves():
    from neuronabox.emu.host_effects.footprint import Footprint, cpu_cost_from_profile

    assert cpu_cost_from_profile({"cpu_cost": {"per_op_s": 1e-4, "per_byte_s": 2e-9}}) == (1e-4, 2e-9)
    assert cpu_cost_from_profile({"busy_progress": {"rate": 0.5}}) is None
    fp = Footprint(1e-4, 2e-9)
    assert fp.cost(Op.ALL_REDUCE, 1 << 20, 2) == pytest.approx(1e-4 + 2e-9 * (1 << 20))
    # all-gather moves (n-1)/n of the bytes, all-reduce 2(n-1)/n: half the per-byte cost
    assert fp.cost(Op.ALL_GATHER, 1 << 20, 8) == pytest.approx(1e-4 + 1e-9 * (1 << 20))
    assert fp.cost(Op.ALL_REDUCE, 1 << 20, 1) == 0.0


def test_footprint_slows_compute_on_the_same_core(emulate_const):
    import os

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    from neuronabox.emu.host_effects.footprint import Footprint

    emu = emulate_const(0.001, None).current()
    fp = Footprint(0.040, 0.0)  # every op costs 40 ms of CPU
    for tl in emu.timelines:
        tl.attach(fp)
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(old)})  # the footprint thread and this one share one core
    try:
        a = torch.randn(128, 128)
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < 0.040:
            torch.mm(a, a)
            n += 1
        alone = time.perf_counter() - t
        x = torch.ones(16)
        t = time.perf_counter()
        w = dist.all_reduce(x, async_op=True)
        for _ in range(n):  # the same work
            torch.mm(a, a)
        shared = time.perf_counter() - t
        w.wait()
        total = time.perf_counter() - t
    finally:
        os.sched_setaffinity(0, old)
    # the core is shared: the compute takes longer, and the op ends after both are done (~80 ms)
    assert shared > alone * 1.3
    assert total == pytest.approx(alone + 0.040, rel=0.35)


def test_the_footprint_s_own_cpu_does_not_count_as_compute():
    """Otherwise a rank waiting on an op would count as computing while the footprint spins."""
    from neuronabox.emu.emulator import Emulator
    from neuronabox.emu.host_effects.footprint import Footprint
    from neuronabox.model.base import CommModel, Estimate, Group
    from neuronabox.topology import parse_topology

    class Const(CommModel):
        name = "const"
        profile = {"busy_progress": {"rate": 0.1}, "cpu_cost": {"per_op_s": 0.030, "per_byte_s": 0.0}}

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(0.001, "const")

    topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n"
                          "emulation: {library: gloo}\n")
    emu = Emulator(topo, 0, Const(topo))
    fp = emu.effect(Footprint)
    assert emu.effect(HostCoupling).busy_rate == 0.1 and fp is not None
    tl = emu.new_timeline(Group.of((0, 1)))
    assert tl.effect(HostCoupling) is not None and tl.effect(Footprint) is fp
    c0, p0 = emu._compute_cpu(), time.process_time()
    r = tl.schedule(Op.ALL_REDUCE, 64)
    fp.wait(r)
    spent = time.process_time() - p0
    assert spent >= 0.028 and emu._compute_cpu() - c0 < 0.005
    fp.stop()
    emu.waker.stop()


def test_the_footprint_spends_what_the_slowest_rank_lost_beside_an_op():
    """The host's CPU cost is scaled to the compute the slowest rank measurably lost beside an op."""
    from neuronabox.emu.host_effects.footprint import cpu_cost_from_profile, interference

    cost = {"per_op_s": 0.0, "per_byte_s": 1e-9}
    busy = {"rate": 0.5, "size": 4_000_000, "lost_compute_s": [0.003, 0.006]}
    # the op moved half its bytes beside the compute: 2 ms of CPU cost; the slower rank lost 6 ms
    assert interference({"cpu_cost": cost, "busy_progress": busy}) == pytest.approx(3.0)
    assert cpu_cost_from_profile({"cpu_cost": cost, "busy_progress": busy}) == pytest.approx((0.0, 1e-9))
    # a profile from before the measurement (or without one): the CPU cost as it is
    assert interference({"cpu_cost": cost, "busy_progress": {"rate": 0.5, "size": 4_000_000}}) is None
    assert cpu_cost_from_profile({"cpu_cost": cost}) == pytest.approx((0.0, 1e-9))
    # measurements that disagree wildly are not taken at face value
    wild = dict(busy, lost_compute_s=[0.0, 1.0])
    assert interference({"cpu_cost": cost, "busy_progress": wild}) == 4.0


def test_the_surplus_over_an_ops_cpu_is_spent_beside_it_and_never_holds_it_up():
    """scale 3: the op completes once its own CPU is spent; the surplus goes on only until its modeled end."""
    from neuronabox.emu.host_effects.footprint import Footprint

    fp = Footprint(0.0, 0.0, scale=3.0)
    t = time.perf_counter()
    r = rec(0, t, 0.060)
    r.end = t + 0.060
    fp.charge(r, 0.030)  # 30 ms of CPU holds it; 60 more beside it, but the op lasts only 60 ms
    fp.wait(r)
    held = time.perf_counter() - t
    time.sleep(0.100)
    fp.stop()
    assert fp.done(r) and held < 0.055  # its own 30 ms, paced over its 60 ms as a third of the total
    assert fp.spent == pytest.approx(0.060, abs=0.008)  # stopped at the op's end: not 90 ms
    assert r.end == pytest.approx(t + 0.060, abs=0.002)  # not extended
    small = Footprint(0.0, 0.0, scale=0.5)
    r2 = rec(1, 0.0, 0.0)
    r2.end = 0.0
    small.charge(r2, 0.020)
    small.wait(r2)
    time.sleep(0.010)
    small.stop()
    assert small.spent == pytest.approx(0.010, abs=0.003)  # below 1 the cost itself shrinks


def test_an_ops_cost_goes_before_another_ops_surplus():
    """DDP's second bucket, issued while the first runs: its cost does not wait for the first's surplus."""
    from neuronabox.emu.host_effects.footprint import Footprint

    fp = Footprint(0.0, 0.0, scale=3.0)
    t = time.perf_counter()
    a = rec(0, t, 0.100)
    a.end = t + 0.100
    fp.charge(a, 0.020)  # 20 ms holds it, 40 more beside it until its end
    b = rec(1, t, 0.010)
    b.end = t + 0.010  # already due: its 10 ms go first
    fp.charge(b, 0.010)
    fp.wait(b)
    took = time.perf_counter() - t
    fp.wait(a)
    fp.stop()
    assert took < 0.050  # not after a's 60 ms (about 100 ms in)
    assert a.end == pytest.approx(t + 0.100, abs=0.003)


def test_an_op_beside_a_running_one_spends_its_cpu_from_then():
    """With ``since`` the CPU spreads from the op's issue, not only over its link time after the other op."""
    from neuronabox.emu.host_effects.footprint import Footprint

    fp = Footprint(0.0, 0.0)
    t = time.perf_counter()
    r = rec(0, t + 0.080, 0.020)  # its link time: the last 20 ms of 100
    r.end = t + 0.100
    fp.charge(r, 0.020, since=t)
    time.sleep(0.050)
    halfway = fp.cpu_time()
    fp.wait(r)
    took = time.perf_counter() - t
    fp.stop()
    assert 0.005 < halfway < 0.016  # about half by half the way: paced from t, not from t + 80 ms
    assert took < 0.130  # its 20 ms fit in 100 ms: the op is not held long past its end
