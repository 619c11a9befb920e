"""Host coupling: a CPU library's op progresses slower while the rank's process computes."""

from __future__ import annotations

import time

import pytest

from neuronabox.collectives import Op
from neuronabox.emu.host_coupling import MIN_RATE, HostCoupling, busy_rate_from_profile
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
    from neuronabox.emu import api

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
