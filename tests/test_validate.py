"""``nbox validate`` without a cluster: options, the error table and verdicts, the record-only mode of the real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from neuronabox.errors import InputError
from neuronabox.fidelity import validate as val
from neuronabox.fidelity.validate import parse_modes, parse_tolerance
from neuronabox.fidelity.verdict import ModeResult, compare, error_table

from .conftest import ROOT, run_nbox


def test_tolerance_and_modes_parse_and_name_the_flag():
    assert parse_tolerance("1%") == pytest.approx(0.01)
    assert parse_tolerance("0.02") == pytest.approx(0.02)
    assert parse_tolerance("0%") == 0.0
    for bad in ("x", "-1%", "nan"):
        with pytest.raises(InputError, match="--tolerance"):
            parse_tolerance(bad)
    assert parse_modes("model,wire") == ["model", "wire"]
    assert parse_modes("wire, model,wire") == ["wire", "model"]
    assert parse_modes("model,real-again") == ["model", "real-again"]
    for bad in ("", "model,real"):
        with pytest.raises(InputError, match="--modes"):
            parse_modes(bad)


def test_errors_verdicts_and_spread():
    real = ModeResult("real", runs=[[0.100, 0.102, 0.098], [0.104, 0.106, 0.104]])
    model = ModeResult("model", runs=[[0.1005, 0.1015], [0.1025, 0.1035]])
    wire = ModeResult("wire", runs=[[0.120, 0.121], [0.119, 0.122]])
    off = ModeResult("wire2", available=False, why="nbox run has no --mode wire")
    spread = compare(real, [model, wire, off], tolerance=0.01)
    assert real.median_s == pytest.approx(0.103)
    assert real.run_medians_s == [0.100, 0.104]
    assert spread == pytest.approx(0.004 / 0.102)
    assert model.error == pytest.approx((0.102 - 0.103) / 0.103)
    # two runs a side cannot tell -1 % from +-1 %: the gate follows the median, the verdict says so
    lo, hi = model.interval
    assert lo <= model.error <= hi and (lo < -0.01 or hi > 0.01)
    assert model.verdict == "pass (within the real spread; undecided)"
    assert wire.verdict == "FAIL" and wire.error > 0.15 and wire.interval[0] > 0.01  # decided: every resample fails
    assert off.verdict == "not available" and off.error is None
    v = val.Validation("t.yaml", ["python"], 2, 1, 2, 0.01, real, [model, wire, off], spread)
    assert not v.passed
    rows = error_table(v)
    assert rows[0][:5] == ["system", "median (ms)", "p95 (ms)", "error of median", "95% interval"]
    assert rows[1][0] == "real" and rows[1][5] == f"{spread * 100:.2f}%"
    assert rows[3][3].startswith("+") and rows[3][4].startswith("+") and rows[3][6] == "FAIL"
    assert rows[4][6].startswith("not available")
    d = v.as_dict()
    assert d["passed"] is False and d["modes"][0]["mode"] == "model"
    json.dumps(d)
    # Only available modes gate: drop the failing one and it passes.
    assert val.Validation("t.yaml", ["python"], 2, 1, 2, 0.01, real, [model, off], spread).passed


def test_real_again_reads_the_machines_own_error_and_never_gates():
    real = ModeResult("real", runs=[[0.100, 0.100], [0.110, 0.110]])
    again = ModeResult("real-again", runs=[[0.120, 0.120], [0.110, 0.110]])
    model = ModeResult("model", runs=[[0.112, 0.112], [0.114, 0.114]])
    compare(real, [model, again], tolerance=0.01)
    assert again.error == pytest.approx((0.115 - 0.105) / 0.105)  # the real system 9.5 % off itself
    assert again.interval is not None and again.verdict.startswith("the real system against itself")
    # model is 7.6 % off: a FAIL of the gate, but no larger than the machine's own error
    assert model.error == pytest.approx((0.113 - 0.105) / 0.105)
    assert model.verdict.startswith("FAIL") and "within real-again's" in model.verdict
    v = val.Validation("t.yaml", ["python"], 2, 1, 2, 0.2, real, [model, again], None)
    assert v.passed and v.floor_note() is None
    v.tolerance = 0.08
    assert v.passed  # real-again's 9.5 % is over 8 % and does not count
    assert v.floor_note() == ("real-again: the real system read +9.52% against itself, past the tolerance 8.00%: "
                              "on this machine these runs cannot show an emulator within it")
    assert error_table(v)[3][0] == "real-again" and error_table(v)[3][3] == "+9.52%"


def test_a_mode_whose_runs_failed_fails_the_validation_but_keeps_its_row():
    real = ModeResult("real", runs=[[0.1, 0.1]])
    model = ModeResult("model", runs=[[0.1, 0.1]])
    wire = ModeResult("wire", failed="nbox run failed with status 1: boom")
    compare(real, [model, wire], 0.5)
    v = val.Validation("t.yaml", ["python"], 2, 1, 1, 0.5, real, [model, wire], None)
    assert model.verdict == "pass" and wire.verdict.startswith("FAIL: nbox run failed")
    assert not v.passed and error_table(v)[3][6].endswith("boom")


def test_enough_runs_decide_a_small_error():
    # Ten quiet runs a side: a +0.5 % error is a pass the runs can tell from a 1 % one.
    real = ModeResult("real", runs=[[0.100 + 0.0001 * (i % 3)] * 3 for i in range(10)])
    m = ModeResult("model", runs=[[0.1005 + 0.0001 * (i % 3)] * 3 for i in range(10)])
    compare(real, [m], 0.01)
    assert m.verdict.startswith("pass") and "undecided" not in m.verdict
    assert -0.01 < m.interval[0] <= m.error <= m.interval[1] < 0.01


def test_one_run_has_no_spread():
    real = ModeResult("real", runs=[[0.1, 0.1]])
    m = ModeResult("model", runs=[[0.1, 0.1]])
    assert compare(real, [m], 0.0) is None
    assert m.error == 0.0 and m.verdict == "pass" and m.interval is None


def test_wire_availability_follows_nbox_run(monkeypatch):
    from neuronabox.launcher import runner

    ok, why = val.wire_available()
    import inspect

    has = {"cluster", "mode"} <= set(inspect.signature(runner.run_command).parameters)
    assert ok is has and (why == "") is has

    def run_command(topology, command): ...

    monkeypatch.setattr(runner, "run_command", run_command)
    ok, why = val.wire_available()
    assert not ok and "--mode wire" in why


def test_rank_cores_pin_each_rank_to_its_own_core_while_there_are_enough():
    cores = sorted(os.sched_getaffinity(0))
    got = val.rank_cores(len(cores) + 1)
    assert got[: len(cores)] == cores and got[-1] == cores[0]


RECORDED = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    assert dist.get_backend() == "gloo", dist.get_backend()   # the real backend stays
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        other.step()   # a second optimizer does not mark iterations
    dist.destroy_process_group()
    """
)


def test_record_only_mode_records_iterations_and_leaves_gloo_in_place(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "s.py"
    script.write_text(RECORDED)
    rec = tmp_path / "rec.json"
    from neuronabox.emu.environ import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(val.RECORD_ONLY_DIR), str(ROOT)]), "NBOX_RECORD_ONLY": "1",
           "NBOX_RECORD": str(rec), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.pop("NBOX_TOPOLOGY", None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads(rec.read_text())
    assert len(data["iterations"]) == 5 and all(t > 0 for t in data["iterations"])
    assert data["model"] == "real (gloo)" and data["ops"] == [] and data["world_size"] == 1
    from neuronabox.report.run_summary import summarize

    assert summarize(data, 1)["iteration_time"]["count"] == 4


def test_record_reports_a_command_killed_by_a_signal_as_a_shell_does(tmp_path):
    # gloo can abort a rank at teardown (SIGABRT): the status reads 134, not -6 wrapped to 250.
    r = run_nbox("record", "-o", str(tmp_path / "rec"), "--", sys.executable, "-c", "import os; os.abort()")
    assert r.returncode == 128 + 6, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == f"nbox record: {sys.executable} was killed by SIGABRT"


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("cluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps}}\nemulation: {library: gloo}\n")
    nccl = tmp_path / "nccl.yaml"
    nccl.write_text(topo.read_text().replace("gloo", "nccl"))
    cases = [
        (["validate", str(topo)], "no command to run"),
        (["validate", str(topo), "--tolerance", "lots", "--", "python", "x.py"], "--tolerance"),
        (["validate", str(topo), "--modes", "real", "--", "python", "x.py"], "--modes"),
        (["validate", str(tmp_path / "none.yaml"), "--", "python", "x.py"], "no such topology file"),
        (["validate", str(topo), "-m", "calibrated", "--profile", str(tmp_path / "no.json"), "--", "python", "x.py"], "--profile"),
        (["validate", str(topo), "--calibrate", "--calibrate-ops", "nope", "--", "python", "x.py"], "--calibrate-ops"),
        (["validate", str(topo), "--calibrate-ops", "all_reduce", "--", "python", "x.py"], "only read with --calibrate"),
        (["validate", str(topo), "--calibrate-sizes", "4B:1MiB", "--", "python", "x.py"], "--calibrate-sizes: only read"),
        (["validate", str(topo), "--calibrate", "--calibrate-sizes", "1MiB:4B", "--", "python", "x.py"],
         "--calibrate-sizes: expected MIN:MAX"),
        (["validate", str(topo), "--calibrate-budget", "1s", "--", "python", "x.py"], "--calibrate-budget: only read"),
        (["validate", str(topo), "--calibrate", "--calibrate-budget", "soon", "--", "python", "x.py"], "--calibrate-budget: "),
        (["validate", str(topo), "--calibrate-bucket-precision", "0.15%", "--", "python", "x.py"],
         "--calibrate-bucket-precision: only read"),
        (["validate", str(topo), "--calibrate", "--calibrate-bucket-precision", "fine", "--", "python", "x.py"],
         "--calibrate-bucket-precision"),
        (["validate", str(topo), "--calibrate", "-m", "nccl", "--", "python", "x.py"], "--calibrate: measures a profile"),
        (["validate", str(nccl), "--calibrate", "--", "python", "x.py"], "only a gloo profile"),
        (["calibrate", str(topo), "--sizes", "8MiB:4B"], "--sizes"),
        (["calibrate", str(topo), "--ops", "all_reduce,nope"], "--ops"),
        (["calibrate", str(topo), "--max-op-time", "soon"], "--max-op-time"),
    ]
    for args, message in cases:
        r = run_nbox(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_rank_lists_and_exit_statuses_fit_a_line():
    from neuronabox.fidelity.validate import exit_codes_text, rank_ranges

    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8" and rank_ranges([3]) == "3"
    assert exit_codes_text([1] * 64) == "1 on ranks 0-63"
    assert exit_codes_text([0, -9, 0, 0, 1]) == "0 on ranks 0, 2-3; -9 on rank 1; 1 on rank 4"
