"""``nbox validate``'s load twin: during each emulated run, the real system's other ranks run beside it, pinned alike."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from neuronabox.fidelity.validate import rank_cores, twin_ranks

from .conftest import run_nbox

TOPO = """name: twin1g
cluster: {nodes: 2}
network: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}
emulation: {library: gloo}
"""

# Every process that runs the script leaves a note: which rank, emulated or real, which cores, when.
NOTES = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t0 = time.time()  # training starts: a process's start-up before it varies by up to 0.75 s here
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    # Steps long enough for the intervals of concurrent processes to overlap clearly.
    for _ in range(16):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
    note = {"rank": dist.get_rank(), "emulated": "NBOX_REAL_RANK" in os.environ,
            "cores": sorted(os.sched_getaffinity(0)), "start": t0, "end": time.time(),
            "wire": "NBOX_WIRE" in os.environ, "footprint": os.environ.get("NBOX_FOOTPRINT")}
    with open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w") as f:
        json.dump(note, f)
    dist.destroy_process_group()
    """
)


def test_the_twin_is_every_other_rank_on_its_own_core():
    cores = rank_cores(4)
    assert twin_ranks(2, 0) == [(1, rank_cores(2)[1])]
    assert twin_ranks(4, 2) == [(0, cores[0]), (1, cores[1]), (3, cores[3])]
    assert twin_ranks(1, 0) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)")
def test_each_emulated_run_has_its_twin_running_beside_it_pinned_to_the_other_core(tmp_path, monkeypatch):
    # (--no-twin is checked in test_validate_root's gating case, which needs no notes.)
    pytest.importorskip("torch")
    monkeypatch.setenv("NBOX_STATE_DIR", str(tmp_path / "state"))
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPO)
    script = tmp_path / "notes.py"
    script.write_text(NOTES)
    notes_dir = tmp_path / "notes"
    notes_dir.mkdir()
    out = tmp_path / "v.json"
    r = run_nbox("validate", str(topo), "--modes", "model,wire", "--warmup", "2", "--repeats", "1", "--tolerance", "1000%",
                 "--json", str(out), "--", sys.executable, str(script), str(notes_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads(out.read_text())
    notes = [json.loads(p.read_text()) for p in notes_dir.iterdir()]
    real = [n for n in notes if not n["emulated"]]
    measured = [n for n in notes if n["emulated"] and n["rank"] == 0]
    twins = [n for n in notes if n["emulated"] and n["rank"] == 1]
    cores = rank_cores(2)
    assert len(real) == 2 and len(measured) == 2  # one run of the real system (2 ranks) and of each mode
    assert all(n["cores"] == [cores[0]] for n in measured)
    assert v["twin_ranks"] == [1] and "load twin: rank(s) 1 run beside each emulated run" in r.stdout
    assert len(twins) == 2 and all(n["cores"] == [cores[1]] for n in twins)
    # Each twin trained while its measured rank trained: they meet when their process groups
    # exist and the twin waits for the measured rank at the end of its first iteration, so it
    # neither leaves the measured rank's last steps to an idle machine nor lags behind them.
    for m in measured:
        t = min(twins, key=lambda n: abs(n["start"] - m["start"]))
        shared = min(m["end"], t["end"]) - max(m["start"], t["start"])
        assert shared > 0.9 * (m["end"] - m["start"]), (m, t)
        # Beside a wire-mode run the bytes really move: the twin spends no footprint of its own.
        assert t["footprint"] == ("0" if m["wire"] else None), (m, t)
    assert sorted(m["wire"] for m in measured) == [False, True]


def test_the_start_gate_meets_at_the_first_group_and_holds_a_twin_until_the_measured_rank_opens_it(
        tmp_path, monkeypatch):
    import threading

    from neuronabox.emu import start_gate
    from neuronabox.emu.timeline import Recorder

    gate = tmp_path / "run.gate"
    monkeypatch.setenv(start_gate.ENV_GATE, str(gate))
    monkeypatch.setenv(start_gate.ENV_PARTIES, "2")
    monkeypatch.setattr(start_gate, "_met", False)
    met = threading.Event()

    def first_group():
        start_gate.rendezvous()
        met.set()

    th = threading.Thread(target=first_group, daemon=True)
    th.start()
    assert not met.wait(0.2), "one process went on before the other had its group"
    (gate / "4242.ready").touch()  # the other process (another pid) arrives
    th.join(5)
    assert met.is_set()

    twin = Recorder()
    start_gate.install(twin)
    marked = threading.Event()

    def iterate():
        twin.mark_iteration()
        marked.set()
        twin.mark_iteration()  # later iterations pass freely

    th = threading.Thread(target=iterate, daemon=True)
    th.start()
    assert not marked.wait(0.2), "the twin went past the closed gate"
    monkeypatch.setenv(start_gate.ENV_LEAD, "1")
    measured = Recorder()
    start_gate.install(measured)
    measured.mark_iteration()  # opens the gate without waiting
    th.join(5)
    assert marked.is_set() and len(twin.iteration_marks) == 2
    # Without a gate nothing listens.
    monkeypatch.delenv(start_gate.ENV_GATE)
    plain = Recorder()
    start_gate.install(plain)
    assert plain.iteration_listeners == []


def test_nobody_waits_at_an_abandoned_start_gate(tmp_path, monkeypatch):
    import time

    from neuronabox.emu import start_gate
    from neuronabox.emu.timeline import Recorder

    gate = tmp_path / "run.gate"
    gate.mkdir()
    (gate / start_gate.ABANDONED).touch()  # the launcher saw a partner end before it came
    monkeypatch.setenv(start_gate.ENV_GATE, str(gate))
    monkeypatch.setenv(start_gate.ENV_PARTIES, "3")
    monkeypatch.setattr(start_gate, "_met", False)
    t = time.monotonic()
    start_gate.rendezvous()
    twin = Recorder()
    start_gate.install(twin)
    twin.mark_iteration()
    assert time.monotonic() - t < 1.0
