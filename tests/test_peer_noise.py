"""Peer noise: emulated ranks vary as the real rank does, and a synchronous job waits for the slowest."""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
from types import SimpleNamespace

import pytest

from neuronabox.emu.host_effects.compute_skew import ComputeSkew
from neuronabox.emu.timeline import Recorder

from .conftest import run_nbox


def _excess_over(computes: list[float], peers: int, iterations: int = 4000) -> list[float]:
    """The excess ratio drawn in each of ``iterations`` iterations whose compute times cycle through ``computes``."""
    rec = Recorder()
    rec.t0 = 0.0
    skew = ComputeSkew({}, rec, noise=True, seed=1)
    out, t = [], 0.0
    for i in range(iterations):
        out.append(skew._excess(peers))
        t += computes[i % len(computes)]
        # The iteration's one collective, called at the end of its compute.
        rec.ops.append(SimpleNamespace(iteration=i, enqueue=t, wait=0.0))
        t += 0.05  # waiting for it, and the optimizer: not compute the peers' draws stand for
        rec.iteration_marks.append(t)
    return out


def test_the_slowest_of_the_peers_arrives_as_late_as_the_real_ranks_own_variation_says():
    # Compute alternates 0.1 / 0.2 s: ratios to the median 0.5 and 1.0. Two ranks: the peer is
    # late (by 0.5) when it drew 1.0 and the real rank's draw was 0.5: E = 0.25 * 0.5.
    two = _excess_over([0.1, 0.2], peers=1)
    assert two[:7] == [0.0] * 7  # two warm-up iterations, then no history yet: the peers arrive with the real rank
    assert statistics.mean(two[10:]) == pytest.approx(0.125, abs=0.015)
    # Eight ranks: seven peers, the slowest drew 1.0 unless all drew 0.5: E = (1 - 0.5^7) * 0.25.
    eight = _excess_over([0.1, 0.2], peers=7)
    assert statistics.mean(eight[10:]) == pytest.approx((1 - 0.5 ** 7) * 0.25, abs=0.015)
    # A rank that never varies has clones that never do.
    assert max(_excess_over([0.1], peers=7)) < 1e-9


def test_one_draw_per_iteration_serves_every_op_of_it():
    rec = Recorder()
    rec.t0 = 0.0
    skew = ComputeSkew({}, rec, noise=True)
    for i, t in enumerate((0.1, 0.3, 0.4, 0.6, 0.7, 0.9, 1.0, 1.2)):
        rec.ops.append(SimpleNamespace(iteration=i, enqueue=t - 0.01 * (i % 3), wait=0.0))
        rec.iteration_marks.append(t)
    first = skew._excess(3)
    assert all(skew._excess(3) == first for _ in range(10))


def test_peer_noise_makes_a_varying_job_wait_for_its_slowest_rank(tmp_path):
    script = tmp_path / "vary.py"
    script.write_text(textwrap.dedent(
        """
        import time, torch, torch.distributed as dist
        dist.init_process_group()
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        for i in range(40):
            time.sleep(0.01 if i % 2 else 0.03)   # compute that varies: 10 or 30 ms
            dist.all_reduce(torch.ones(4))
            opt.step()
        """
    ))
    means = {}
    for noise in ("false", "true"):
        topo = tmp_path / f"t-{noise}.yaml"
        topo.write_text("cluster: {nodes: 2, ranks_per_node: 1}\n"
                        "network: {type: switch, link: {bandwidth: 10Gbps, latency: 10us}}\n"
                        f"emulation: {{library: gloo, peer_noise: {noise}}}\n")
        rep = tmp_path / f"r-{noise}.json"
        r = run_nbox("run", str(topo), "--report", str(rep), "-q", "--", sys.executable, str(script))
        assert r.returncode == 0, r.stderr
        its = json.loads(rep.read_text())["iterations"][10:]
        means[noise] = statistics.mean(its)
    # Ratios 1/3 and 1 to the median: the peer is late by 2/3 of the compute so far a quarter
    # of the time, about 3.3 ms per iteration on average (the draws are random: a wide band).
    assert 0.001 < means["true"] - means["false"] < 0.008
