"""Every command of the README's set-up and five-minute tour, run as written (from the
repository's folder, with the venv's bin first on the PATH, as after `source .venv/bin/activate`)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow


def _blocks(start: str, end: str) -> list[str]:
    """The ```bash blocks of the README between two headings."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    part = text[text.index(start):text.index(end)]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", part, re.S)]


SETUP = _blocks("## Set up", "## A five-minute tour")
TOUR = _blocks("## A five-minute tour", "## Documentation")


def _which(block: str) -> str:
    for key, words in (("cluster", "nbox up"), ("metrics", "--metrics-addr"), ("whatif", "nbox whatif"),
                       ("own script", "nbox report"), ("demo", "cpu-64-demo.yaml --report")):
        if words in block:
            return key
    raise AssertionError(f"a tour block this test does not know; add its checks: {block}")


def _bash(block: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "200"}
    return subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_readme_shows_the_two_commands_and_the_path():
    assert SETUP[0].splitlines()[0].startswith("make demo") and SETUP[0].splitlines()[1].startswith("make test")
    assert "source .venv/bin/activate" in SETUP[1]


def test_nbox_is_on_the_path_after_activate():
    if not (ROOT / ".venv/bin/activate").exists():
        pytest.skip("no .venv here (make demo / make test build it)")
    r = subprocess.run(["bash", "-e", "-c", SETUP[1]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nbox" in r.stdout, r.stdout + r.stderr


def test_the_tour_has_the_five_steps():
    assert sorted(_which(b) for b in TOUR) == sorted(["demo", "own script", "whatif", "cluster", "metrics"])


@pytest.mark.parametrize("block", TOUR, ids=[_which(b) for b in TOUR])
def test_a_tour_step_runs_as_written(block):
    pytest.importorskip("torch", reason="nbox run needs torch")
    kind = _which(block)
    if kind == "cluster":
        if os.geteuid() != 0:
            pytest.skip("needs root (network namespaces, qdiscs, iptables)")
        if not (shutil.which("iptables") and shutil.which("ping")):
            pytest.skip("needs iptables and ping (make sysdeps installs them)")
    if kind == "metrics" and not shutil.which("curl"):
        pytest.skip("needs curl")
    try:
        r = _bash(block)
    finally:
        if kind == "cluster":  # a failed step must not leave the cluster up
            _bash("nbox down lab >/dev/null 2>&1 || true", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if kind == "demo":
        assert "iteration time" in r.stdout
        assert json.loads((ROOT / "out/demo-run.json").read_text())["world_size"] == 64
    elif kind == "own script":
        assert (ROOT / "out/run.png").stat().st_size > 10_000
    elif kind == "whatif":
        assert (ROOT / "out/whatif/whatif_inject_all_reduce.png").stat().st_size > 10_000
        assert "5ms" in (ROOT / "out/whatif/whatif.md").read_text()  # the table has the sweep's last point
    elif kind == "cluster":
        assert "3 received" in r.stdout and "iteration time" in r.stdout, r.stdout
    elif kind == "metrics":
        # The block's grep passes only the sample's own line, but curl and the training script share one
        # stdout: the sample can land between a step's text and its newline ("loss 2.2965nbox_iter...").
        assert re.search(r"nbox_iteration_duration_seconds_count\S* [1-9]", r.stdout), r.stdout
