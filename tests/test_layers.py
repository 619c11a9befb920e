"""The house keeps its layers: import-linter's contracts (pyproject.toml [tool.importlinter]) hold.

cli -> fidelity | deploy -> launcher -> metrics | report -> cluster | emu -> model ->
topology -> the leaf modules ("a | b": independent siblings, neither imports the other), metrics
reading the run through ``neuronabox.recording``, and no import circle among the modules of any
package.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    found = str(exe) if exe.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (pip install -e .[test])")
    return found


def test_the_import_contracts_hold():
    r = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-2000:]
