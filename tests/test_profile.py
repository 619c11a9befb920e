"""Calibration profiles as first-class input: ``emulation.profile``, ``--profile`` and ``nbox calibrate``'s line."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from neuronabox.collectives import Op
from neuronabox.errors import InputError, TopologyError
from neuronabox.fidelity.calibrate import default_sizes
from neuronabox.fidelity.fit import fit_piecewise
from neuronabox.fidelity.profile import make_profile, profile_reference, save_profile, write_profile_field
from neuronabox.model.calibrated import with_profile
from neuronabox.model.registry import create_model
from neuronabox.topology import load_topology

from .conftest import run_nbox, topo

NET = "cluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
ALPHA = 10e-3  # per step: a 2-rank all-reduce costs 2 alpha = 20 ms, far from anything the link would give


def write_profile(path, alpha=ALPHA, bandwidth=1e9):
    """A profile whose all-reduce is t = 2 alpha + S/B (n = 2): easy to tell from every other model."""
    sizes = default_sizes(4, 1 << 20)
    fits = {"all_reduce": fit_piecewise(sizes, [2 * alpha + s / bandwidth for s in sizes], Op.ALL_REDUCE, n=2)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(make_profile(topo(NET + "emulation: {library: gloo}\n"), fits, {}, {}), path)
    return path


def ar_time(model, size=4096):
    return model.estimate(Op.ALL_REDUCE, size, [0, 1]).duration


@pytest.fixture
def files(tmp_path):
    """A topology in conf/ naming a profile in conf/profiles/ by a relative path."""
    prof = write_profile(tmp_path / "conf" / "profiles" / "p.json")
    t = tmp_path / "conf" / "t.yaml"
    t.write_text(NET + "emulation: {library: gloo, profile: profiles/p.json}\n")
    return t, prof


# ---- the field ----------------------------------------------------------------------------------------
def test_field_is_relative_to_the_topology_folder_and_selects_calibrated(files, tmp_path, monkeypatch):
    t, prof = files
    monkeypatch.chdir(tmp_path)  # not the topology's folder: the path must not depend on the cwd
    tp = load_topology(t)
    assert tp.emulation.profile == str(prof.resolve()) and tp.raw["emulation"]["profile"] == str(prof.resolve())
    assert tp.emulation.model == "calibrated"
    assert ar_time(create_model(tp)) == pytest.approx(2 * ALPHA + 4096 / 1e9, rel=1e-6)
    # a file that names another model keeps it (the profile waits for --model calibrated)
    t2 = t.with_name("t2.yaml")
    t2.write_text(NET + "emulation: {library: gloo, model: alpha-beta, profile: profiles/p.json}\n")
    assert load_topology(t2).emulation.model == "alpha-beta"
    assert ar_time(create_model(load_topology(t2), "calibrated")) == pytest.approx(2 * ALPHA + 4096 / 1e9, rel=1e-6)
    # what-if merges re-validate the raw YAML: the absolute path survives them
    assert tp.with_changes(whatif={"latency_scale": 2}).emulation.profile == str(prof.resolve())


@pytest.mark.parametrize("content, fragment", [
    (None, "no such profile file 'profiles/p.json'"),
    ("{not json", "is not a readable JSON profile"),
    ('{"format": "something-else/1"}', "is not a calibration profile"),
])
def test_a_bad_profile_field_names_file_field_and_value(tmp_path, content, fragment):
    t = tmp_path / "t.yaml"
    t.write_text(NET + "emulation: {profile: profiles/p.json}\n")
    if content is not None:
        (tmp_path / "profiles").mkdir()
        (tmp_path / "profiles" / "p.json").write_text(content)
    with pytest.raises(TopologyError) as err:
        load_topology(t)
    msg = str(err.value)
    assert msg.startswith(f"{t}: emulation.profile: ") and fragment in msg and "\n" not in msg


def test_verbs_before_calibration_take_a_topology_whose_profile_is_not_written_yet(tmp_path):
    """nbox up brings up the cluster that nbox calibrate then measures to write the named profile."""
    t = tmp_path / "t.yaml"
    t.write_text(NET + "emulation: {library: gloo, model: calibrated, profile: profiles/p.json}\n")
    with pytest.raises(TopologyError, match="no such profile file"):
        load_topology(t)
    tp = load_topology(t, profile_may_be_missing=True)
    assert tp.emulation.profile is None and tp.emulation.model == "calibrated" and tp.world_size == 2
    # once written, it is read as always
    write_profile(tmp_path / "profiles" / "p.json")
    assert load_topology(t, profile_may_be_missing=True).emulation.profile == str((tmp_path / "profiles" / "p.json").resolve())
    # a broken file is still refused: only a missing one waits for calibration
    (tmp_path / "profiles" / "p.json").write_text("{not json")
    with pytest.raises(TopologyError, match="not a readable JSON profile"):
        load_topology(t, profile_may_be_missing=True)


def test_a_profile_whose_fits_do_not_parse_is_named_by_the_field(tmp_path):
    (tmp_path / "p.json").write_text('{"format": "neuronabox-calibration/1", "ops": {"all_reduce": {"n": 2}}}')
    t = tmp_path / "t.yaml"
    t.write_text(NET + "emulation: {profile: p.json}\n")
    with pytest.raises(TopologyError, match=r"t\.yaml: emulation\.profile: calibration profile"):
        create_model(load_topology(t))


# ---- where the calibrated model finds its profile ------------------------------------------------------
def test_flag_over_field_over_environment(files, tmp_path, monkeypatch):
    t, prof = files
    other = write_profile(tmp_path / "other.json", alpha=1e-3)
    env = write_profile(tmp_path / "env.json", alpha=4e-3)
    monkeypatch.setenv("NBOX_PROFILE", str(env))
    field = load_topology(t)
    assert ar_time(create_model(field)) == pytest.approx(2 * ALPHA + 4096 / 1e9, rel=1e-6)  # field beats env
    flagged = with_profile(field, other)
    assert flagged.emulation.profile == str(other.resolve())
    assert ar_time(create_model(flagged)) == pytest.approx(2e-3 + 4096 / 1e9, rel=1e-6)  # flag beats field
    bare = topo(NET + "emulation: {model: calibrated}\n")
    assert ar_time(create_model(bare)) == pytest.approx(8e-3 + 4096 / 1e9, rel=1e-6)  # env, last
    monkeypatch.delenv("NBOX_PROFILE")
    with pytest.raises(InputError, match="emulation.profile.*--profile"):
        create_model(bare)


def test_the_flag_selects_calibrated_and_contradictions_exit_2(files, tmp_path):
    t, prof = files
    plain = topo(NET + "emulation: {model: nccl}\n")
    assert with_profile(plain, prof).emulation.model == "calibrated"
    assert with_profile(plain, prof, "calibrated").emulation.model == "calibrated"
    assert with_profile(plain, None, "flow").emulation.model == "flow"
    with pytest.raises(InputError, match=r"--profile: only model calibrated reads a profile, but --model is 'nccl'"):
        with_profile(plain, prof, "nccl")
    with pytest.raises(InputError, match=r"--profile: no such profile file"):
        with_profile(plain, tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "x"}')
    with pytest.raises(InputError, match=r"^--profile: calibration profile .*format"):
        with_profile(plain, bad)


# ---- the verbs -------------------------------------------------------------------------------------------
def test_bench_reads_the_field_and_the_flag(files, tmp_path):
    t, prof = files
    r = run_nbox("bench", str(t), "-b", "4096", "-e", "4096", "--json", "-")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "calibrated" and doc["rows"][0]["time_us"] == pytest.approx(2e6 * ALPHA + 4.096, rel=1e-3)
    plain = tmp_path / "plain.yaml"
    plain.write_text(NET)
    other = write_profile(tmp_path / "other.json", alpha=1e-3)
    r = run_nbox("bench", str(plain), "--profile", str(other), "-b", "4096", "-e", "4096", "--json", "-")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "calibrated" and doc["rows"][0]["time_us"] == pytest.approx(2e3 + 4.096, rel=1e-3)


SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(1024)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for _ in range(4):
        dist.all_reduce(x)
        opt.step()
    dist.destroy_process_group()
    """
)


def test_run_uses_the_field_through_its_temporary_topology_and_the_flag_over_it(files, tmp_path):
    pytest.importorskip("torch")
    t, prof = files
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    rep = tmp_path / "r.json"
    r = run_nbox("run", str(t), "-q", "--report", str(rep), "--", sys.executable, str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    comm = json.loads(rep.read_text())["comm_modeled_per_iteration"]["median"]
    assert comm == pytest.approx(2 * ALPHA + 4096 / 1e9, rel=1e-3)
    other = write_profile(tmp_path / "other.json", alpha=1e-3)
    r = run_nbox("run", str(t), "-q", "--profile", str(other), "--report", str(rep), "--", sys.executable, str(script))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(rep.read_text())["comm_modeled_per_iteration"]["median"] == pytest.approx(2e-3 + 4096 / 1e9, rel=1e-3)


def test_bad_profile_paths_exit_2_with_one_line_on_every_verb(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text(NET + "emulation: {library: gloo}\n")
    missing = str(tmp_path / "missing.json")
    cmd = ["--", sys.executable, "-c", "pass"]
    cases = [
        ["run", str(plain), "--profile", missing, *cmd],
        ["bench", str(plain), "--profile", missing],
        ["whatif", str(plain), "--sweep", "inject=0ms,1ms", "--profile", missing, *cmd],
        ["validate", str(plain), "--profile", missing, *cmd],
        ["run", str(plain), "-m", "alpha-beta", "--profile", str(write_profile(tmp_path / "p.json")), *cmd],
    ]
    for args in cases:
        r = run_nbox(*args)
        assert r.returncode == 2, (args, r.stdout[-500:], r.stderr[-1000:])
        assert "--profile" in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    bad_field = tmp_path / "field.yaml"
    bad_field.write_text(NET + "emulation: {profile: nowhere.json}\n")
    for verb in (["run", str(bad_field), *cmd], ["bench", str(bad_field)], ["validate", str(bad_field), *cmd],
                 ["whatif", str(bad_field), "--sweep", "inject=0ms", *cmd]):
        r = run_nbox(*verb)
        assert r.returncode == 2 and "emulation.profile" in r.stderr and "nowhere.json" in r.stderr, (verb, r.stderr)


def test_whatif_profile_reaches_every_point(files, tmp_path):
    pytest.importorskip("torch")
    t, prof = files
    plain = tmp_path / "plain.yaml"
    plain.write_text(NET + "emulation: {library: gloo}\n")
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    other = write_profile(tmp_path / "other.json", alpha=1e-3)
    r = run_nbox("whatif", str(plain), "--profile", str(other), "--sweep", f"topology={plain},{t}",
                 "-o", str(out), "--warmup", "0", "--", sys.executable, str(script))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = (out / "whatif.csv").read_text().splitlines()[1:]
    comm = [float(ln.split(",")[4]) for ln in lines]
    assert comm == [pytest.approx(2.004, rel=1e-3)] * 2  # the flag's 2 ms per all-reduce, for both files


# ---- nbox calibrate's line -------------------------------------------------------------------------------
@pytest.mark.parametrize("before, after", [
    ("emulation: {library: gloo}  # keep me\n", "emulation: {library: gloo, profile: profiles/p.json}  # keep me\n"),
    ("emulation:\n    library: gloo\n    profile: old.json\n# end\n",
     "emulation:\n    library: gloo\n    profile: \"profiles/p.json\"\n# end\n"),
    ("emulation:  # section\n  library: gloo\n", "emulation:  # section\n  profile: \"profiles/p.json\"\n  library: gloo\n"),
    ("", "emulation:\n  profile: \"profiles/p.json\"\n"),
])
def test_calibrate_writes_the_field_keeping_the_other_lines(tmp_path, before, after):
    prof = write_profile(tmp_path / "profiles" / "p.json")
    (tmp_path / "old.json").write_text(prof.read_text())
    t = tmp_path / "t.yaml"
    t.write_text("# my cluster\n" + NET + before)
    assert write_profile_field(t, prof) == "profiles/p.json"
    assert t.read_text() == "# my cluster\n" + NET + after
    assert load_topology(t).emulation.profile == str(prof.resolve())


def test_calibrate_reference_and_a_shape_it_leaves_to_the_user(tmp_path):
    prof = write_profile(tmp_path / "a" / "p.json")
    assert profile_reference(tmp_path / "b" / "t.yaml", prof) == "../a/p.json"
    assert profile_reference(tmp_path / "b" / "c" / "d" / "t.yaml", prof) == str(prof.resolve())
    t = tmp_path / "t.yaml"
    text = NET + "emulation: {library: gloo,\n  model: flow}\n"
    t.write_text(text)
    with pytest.raises(InputError, match=r"emulation.profile: add `profile: \"a/p.json\"` under `emulation:` by hand"):
        write_profile_field(t, prof)
    assert t.read_text() == text
    assert os.path.exists(prof)
