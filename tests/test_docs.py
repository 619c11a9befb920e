"""The front door: the README stays a door (size, links), the docs site builds with --strict,
and the topology reference is the one the schema generates."""

import re
import subprocess
import sys

import pytest

from .conftest import ROOT

README = ROOT / "README.md"


def test_readme_is_a_door_of_at_most_12_kb():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    for command in ("make demo", "make test", "source .venv/bin/activate"):
        assert command in text


def test_every_link_of_the_readme_leads_to_a_file():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_topology_reference_is_generated_from_the_schema():
    from neuronabox.topology.reference import reference_markdown

    committed = (ROOT / "docs/reference/topology.md").read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        "docs/reference/topology.md is out of date: python -m neuronabox.topology.reference docs/reference/topology.md")


def test_the_reference_names_every_field_of_the_schema():
    from neuronabox.topology.reference import reference_markdown
    from neuronabox.topology.schema import json_schema

    page = reference_markdown()
    schema = json_schema()
    for section in [schema, *schema["$defs"].values()]:
        for field in section.get("properties", {}):
            assert f"| `{field}` |" in page, field


def test_the_hardware_profile_reference_is_generated_and_names_every_field():
    from neuronabox.model.hardware import HardwareProfile
    from neuronabox.model.hardware_reference import reference_markdown

    page = reference_markdown()
    assert (ROOT / "docs/reference/hardware.md").read_text(encoding="utf-8") == page, (
        "docs/reference/hardware.md is out of date: python -m neuronabox.model.hardware_reference docs/reference/hardware.md")
    schema = HardwareProfile.model_json_schema()
    for section in [schema, *schema["$defs"].values()]:
        for field in section.get("properties", {}):
            assert f"| `{field}` |" in page, field


def test_the_docs_site_builds_with_strict(tmp_path):
    """Broken links and anchors, a page left out of the nav, a missing included table: all fail."""
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocs-material) is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs, mkdocs-material) is not installed")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "site/results/index.html").read_text(encoding="utf-8")
    assert "100Mbit-1ms" in page  # the committed fidelity table, included from benchmarks/results/
