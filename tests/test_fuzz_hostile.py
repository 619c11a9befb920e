"""A small hostile-input fuzz run in the default suite (a few hundred inputs per surface, seconds);
the long one (10,000+ per surface) is ``make fuzz`` (benchmarks/fuzz_hostile.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from .fuzzing import AgentHarness, check_topology, documents, requests, yaml_texts

FAST = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)


@FAST
@given(documents())
def test_topology_documents_load_within_bounds_or_are_one_line(text):
    check_topology(text)


@FAST
@given(yaml_texts)
def test_yaml_texts_load_within_bounds_or_are_one_line(text):
    check_topology(text)


@pytest.fixture(scope="module")
def harness():
    h = AgentHarness()
    yield h
    h.close()


@FAST
@given(req=requests)
def test_agent_requests_are_2xx_within_bounds_or_4xx(harness, req):
    harness.check(*req)
