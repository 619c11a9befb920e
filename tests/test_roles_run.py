"""``nbox profile`` then ``nbox run --role-profile``: pipeline stages of unequal cost, whichever rank is real."""

import json
import statistics
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="nbox profile and run need torch")

from .conftest import ROOT, run_nbox  # noqa: E402

PY = sys.executable

TOPO = """
name: two
cluster: {nodes: 2, ranks_per_node: 1}
network: {type: switch, link: {bandwidth: 10Gbps, latency: 20us}}
emulation: {library: gloo}
"""

# A 2-stage GPipe pipeline whose stages "compute" by sleeping (a wall-clock cost no machine noise
# changes): stage 0 2 ms a micro-batch each way, stage 1 8 ms. The real pipeline's iteration is
# about 2 + 4 x 8 + 4 x 8 + 2 = 68 ms on either rank; a clone of stage 0 would read about 16 ms.
PIPE = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cost = [0.002, 0.008][rank]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    x = torch.ones(1024)
    for step in range(int(sys.argv[1])):
        for mb in range(4):
            if rank == 0:
                time.sleep(cost); dist.send(x, 1)
            else:
                dist.recv(x, 0); time.sleep(cost)
        for mb in range(4):
            if rank == 1:
                time.sleep(cost); dist.send(x, 0)
            else:
                dist.recv(x, 1); time.sleep(cost)
        opt.step()
    dist.destroy_process_group()
    """
)


@pytest.fixture
def pipe(tmp_path):
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO)
    script = tmp_path / "pipe.py"
    script.write_text(PIPE)
    return topo, script


def _median_iteration(report):
    return json.loads(report.read_text())["iteration_time"]["median"]


def test_replayed_stages_give_either_real_rank_the_pipeline_s_time(pipe, tmp_path):
    topo, script = pipe
    prof = tmp_path / "prof"
    cmd = [PY, str(script), "12"]
    r = run_nbox("profile", str(topo), "--roles", "0,1", "-o", str(prof), "--", *cmd)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in prof.iterdir()) == ["profile.json", "role-r0.json", "role-r1.json"]
    assert "replay it with: nbox run" in r.stdout
    medians = {}
    for rank in (0, 1):
        rep = tmp_path / f"run{rank}.json"
        r = run_nbox("run", str(topo), "--rank", str(rank), "--role-profile", str(prof), "--report", str(rep),
                     "--", *cmd)
        assert r.returncode == 0, r.stderr
        medians[rank] = _median_iteration(rep)
        report = json.loads(rep.read_text())
        roles = report["roles"]
        assert roles[f"r{rank}"]["real"] and not roles[f"r{1 - rank}"]["real"]
        assert "roles (measured iterations" in r.stdout
    clone = tmp_path / "clone.json"
    assert run_nbox("run", str(topo), "--rank", "0", "--report", str(clone), "--", *cmd).returncode == 0
    # Stage 0 alone, with a clone of itself as stage 1, sees its own 16 ms; with stage 1 replayed
    # it waits for the 8 ms stage as the real pipeline does.
    assert _median_iteration(clone) < 0.03
    assert 0.06 < medians[0] < 0.09, medians
    assert abs(medians[0] - medians[1]) / medians[1] < 0.15, medians
    # The replayed stage 1 of rank 0's run has its own iteration time and bubble.
    stage1 = json.loads((tmp_path / "run0.json").read_text())["roles"]["r1"]
    assert stage1["iteration_time"]["median"] == pytest.approx(medians[0], rel=0.15)
    assert stage1["bubble_per_iteration"]["median"] < 0.5 * stage1["iteration_time"]["median"]


def test_a_profile_for_another_run_is_refused_before_it_starts(pipe, tmp_path):
    topo, script = pipe
    prof = tmp_path / "prof"
    assert run_nbox("profile", str(topo), "--roles", "0,1", "-o", str(prof), "--", PY, str(script), "3").returncode == 0
    r = run_nbox("run", str(topo), "--role-profile", str(prof), "--", PY, str(script), "4")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "recorded for another command or script" in r.stderr and "profile.json" in r.stderr
    other = tmp_path / "other.yaml"
    other.write_text(TOPO.replace("name: two", "name: other"))
    r = run_nbox("run", str(other), "--role-profile", str(prof), "--", PY, str(script), "3")
    assert r.returncode == 2 and "recorded for topology 'two', this run has 'other'" in r.stderr
    (prof / "profile.json").unlink()
    r = run_nbox("run", str(topo), "--role-profile", str(prof), "--", PY, str(script), "3")
    assert r.returncode == 2 and "partial profile" in r.stderr


def test_bad_roles_and_a_failing_script_leave_nothing(pipe, tmp_path):
    topo, script = pipe
    prof = tmp_path / "prof"
    r = run_nbox("profile", str(topo), "--roles", "0,2", "-o", str(prof), "--", PY, str(script), "3")
    assert r.returncode == 2 and "rank 2 in '2' is outside the world of 2 ranks" in r.stderr
    assert not prof.exists()
    bad = tmp_path / "bad.py"
    bad.write_text(PIPE + "\nraise SystemExit(3)\n")
    r = run_nbox("profile", str(topo), "--roles", "0,1", "-o", str(prof), "--", PY, str(bad), "2")
    assert r.returncode == 1 and "profiling role r0 (rank 0): the command exited with status 3" in r.stderr
    assert not prof.exists()


def test_pipelining_runs_with_a_later_stage_real(tmp_path):
    # torch.distributed.pipelining's warm-up vote: as a clone's zeros, stage 1 voted for shape
    # inference and died unpickling an empty object list; replayed, it receives stage 0's vote.
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO)
    prof = tmp_path / "prof"
    cmd = [PY, str(ROOT / "examples" / "pipeline_schedule.py"), "--schedule", "1f1b", "--steps", "3"]
    r = run_nbox("profile", str(topo), "--roles", "auto", "-o", str(prof), "--", *cmd)
    assert r.returncode == 0, r.stderr
    assert "roles = auto: 2 pipeline ranks: stage0, stage1" in r.stdout
    r = run_nbox("run", str(topo), "--rank", "1", "-q", "--role-profile", str(prof), "--", *cmd)
    assert r.returncode == 0, r.stderr


def test_mesh_roles_come_from_the_script_s_device_mesh(tmp_path):
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO.replace("nodes: 2", "nodes: 4"))
    prof = tmp_path / "prof"
    cmd = [PY, str(ROOT / "examples" / "mesh_dp_pp.py"), "--steps", "3"]
    r = run_nbox("profile", str(topo), "--roles", "pp", "-o", str(prof), "--", *cmd)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((prof / "profile.json").read_text())
    assert manifest["roles"]["roles"] == {"pp0": [0, 1], "pp1": [2, 3]}
    role = json.loads((prof / "role-pp1.json").read_text())
    assert role["rank"] == 2 and role["mesh"] == [["pp", 2], ["dp", 2]]
    its = []
    for rank in (1, 3):
        rep = tmp_path / f"r{rank}.json"
        r = run_nbox("run", str(topo), "--rank", str(rank), "-q", "--role-profile", str(prof), "--report", str(rep),
                     "--", *cmd)
        assert r.returncode == 0, r.stderr
        its.append(statistics.median(json.loads(rep.read_text())["iterations"]))
    assert all(t > 0 for t in its)
