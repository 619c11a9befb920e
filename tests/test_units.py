import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuronabox.units import (
    UnitError,
    format_bandwidth,
    format_duration,
    format_size,
    parse_bandwidth,
    parse_duration,
    parse_ratio,
    parse_size,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("100Gbps", 12.5e9),
        ("400Gbit/s", 50e9),
        ("1Mbps", 125e3),
        ("25GB/s", 25e9),
        ("1GiB/s", 2**30),
        ("1.5 Gbps", 1.5e9 / 8),
        ("10Kbps", 1250.0),
    ],
)
def test_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected", [("5us", 5e-6), ("5µs", 5e-6), ("2ms", 2e-3), ("1s", 1.0), ("500ns", 5e-7), ("0us", 0.0)]
)
def test_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [("64MiB", 64 * 2**20), ("1GB", 10**9), ("8B", 8), ("1KiB", 1024), ("2kB", 2000)])
def test_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, expected", [("0.1%", 0.001), ("0", 0.0), (0.25, 0.25), ("100%", 1.0)])
def test_ratio(text, expected):
    assert parse_ratio(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["100", 100, "100Gbs", "fast", "", "Gbps", "-1Gbps", "0Gbps", True, None, "1e3 Gb ps"])
def test_bandwidth_rejects(bad):
    with pytest.raises(UnitError):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["5", 5, "5 sec", "5m", "-2ms", "ms", "2 ms ms"])
def test_duration_rejects(bad):
    with pytest.raises(UnitError):
        parse_duration(bad)


@pytest.mark.parametrize("bad", ["64", "64M", "1.5B", "64mib", "-1B"])
def test_size_rejects(bad):
    with pytest.raises(UnitError):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["150%", "-0.1", "2", "lots", None])
def test_ratio_rejects(bad):
    with pytest.raises(UnitError):
        parse_ratio(bad)


def test_error_message_names_value_and_examples():
    with pytest.raises(UnitError, match=r"'100Gbs'.*unknown unit 'Gbs'.*100Gbps"):
        parse_bandwidth("100Gbs")


@given(st.floats(min_value=125, max_value=1.2e13, allow_nan=False))
def test_bandwidth_round_trip(value):
    assert parse_bandwidth(format_bandwidth(value)) == pytest.approx(value, rel=1e-3)
    assert parse_bandwidth(format_bandwidth(value, bits=False)) == pytest.approx(value, rel=1e-3)


@given(st.floats(min_value=1e-9, max_value=1e4, allow_nan=False))
def test_duration_round_trip(value):
    assert parse_duration(format_duration(value)) == pytest.approx(value, rel=1e-3)


def test_format_size():
    assert format_size(64 * 2**20) == "64MiB"
    assert math.isclose(parse_size("64MiB"), 64 * 2**20)
