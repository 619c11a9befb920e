"""Third-party delay models arrive through the ``neuronabox.models`` entry-point group."""

import os
import textwrap

import pytest

from neuronabox.collectives import Op
from neuronabox.errors import InputError
from neuronabox.model.registry import available_models, create_model

from .conftest import run_nbox, switch_topology

PLUGIN = textwrap.dedent(
    '''
    from neuronabox.model.base import CommModel, Estimate

    class ConstantModel(CommModel):
        name = "constant"
        description = "every collective takes 1 ms"
        algorithms = ("fixed",)

        def estimate(self, op, nbytes, group, root=0):
            return Estimate(1e-3, "fixed")

    class NotAModel:
        pass

    def broken():
        raise RuntimeError
    '''
)


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    (tmp_path / "nbox_test_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "nbox_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nbox-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[neuronabox.models]\nconstant = nbox_test_plugin:ConstantModel\n"
        "notamodel = nbox_test_plugin:NotAModel\nmissing = nbox_test_plugin_gone:Model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_is_found_and_used(plugin_path):
    assert available_models()["constant"] == "nbox_test_plugin:ConstantModel"
    m = create_model(switch_topology(4), "constant")
    assert m.estimate(Op.ALL_REDUCE, 1 << 20, range(4)).duration == 1e-3


def test_bad_plugins_give_clear_errors(plugin_path):
    with pytest.raises(InputError, match="'notamodel'.*is not a neuronabox CommModel subclass"):
        create_model(switch_topology(2), "notamodel")
    with pytest.raises(InputError, match="'missing'.*failed to load"):
        create_model(switch_topology(2), "missing")


def test_plugin_through_the_cli(plugin_path):
    env_path = os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    try:
        r = run_nbox("bench", "topologies/cpu-8x1g.yaml", "--model", "constant", "-b", "1K", "-e", "4K")
        listing = run_nbox("models")
    finally:
        os.environ.pop("PYTHONPATH")
    assert r.returncode == 0, r.stderr
    assert "1000.00" in r.stdout and "fixed" in r.stdout
    assert "constant" in listing.stdout and "nbox_test_plugin:ConstantModel" in listing.stdout
