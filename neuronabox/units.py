"""Strings with units <-> numbers in base units (bytes, bytes/second, seconds), parsed strictly.

Bandwidths are stored in bytes per second, durations in seconds, sizes in bytes. Network
people write bits (``100Gbps``), storage people write bytes (``25GB/s``); both are accepted
and nothing else is: a bare number is ambiguous and rejected, as is an unknown suffix.

Bounds. Every quantity that enters nbox (a topology file, a CLI flag, a request to the shaping
agent) is checked here, against bounds stated once: a bandwidth is finite, at least
``MIN_BANDWIDTH`` (1 kbit/s) and at most ``MAX_BANDWIDTH`` (100 Tbit/s); a link latency or jitter is finite, at least zero and at most
``MAX_LATENCY`` (60 s); a ratio lies in [0, 1]. Beyond them a value is a typo or an attack, never
a network: the kernel's qdiscs refuse (below about 100 bit/s a full-size frame takes longer
than tbf's 32-bit count of timer ticks holds; pyroute2 sends tbf's rate as 32 bits) and the
models would compute infinities.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "UnitError",
    "quoted",
    "MIN_BANDWIDTH",
    "MAX_BANDWIDTH",
    "MAX_LATENCY",
    "as_float",
    "check_bandwidth",
    "check_latency",
    "parse_latency",
    "parse_bandwidth",
    "parse_duration",
    "parse_size",
    "parse_fraction_flag",
    "parse_ratio",
    "format_bandwidth",
    "format_duration",
    "format_size",
    "BANDWIDTH_EXAMPLES",
    "DURATION_EXAMPLES",
    "SIZE_EXAMPLES",
    "RATIO_EXAMPLES",
]


class UnitError(ValueError):
    """A string that is not a valid quantity of the expected kind."""


def quoted(value: object) -> str:
    """A value as an error message quotes it: at most 60 characters, so the message stays one line."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr of a 5,000-digit int raises ValueError
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MIN_BANDWIDTH = 1e3 / 8  # bytes/s: 1 kbit/s; a rate of 1 B/s made the kernel path fail (struct.error)
MAX_BANDWIDTH = 100e12 / 8  # bytes/s: 100 Tbit/s, a hundred times today's fastest port
MAX_LATENCY = 60.0  # s: one link's latency or jitter; TCP gives up on a connection long before


def as_float(value: object) -> float:
    """A JSON or YAML number as a float; an integer too large for one is infinity (refused by every check)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_bandwidth(value: float, text: object = None) -> float:
    """``value`` (bytes/s) if finite and within [1 kbit/s, 100 Tbit/s]; else UnitError naming ``text``."""
    shown = value if text is None else text
    if not math.isfinite(value) or value < MIN_BANDWIDTH or value > MAX_BANDWIDTH:
        raise UnitError(f"invalid bandwidth {quoted(shown)}: must lie between 1Kbps and 100Tbps")
    return float(value)


def check_latency(value: float, text: object = None) -> float:
    """``value`` (seconds) if finite and within [0, 60 s]; else UnitError naming ``text``."""
    shown = value if text is None else text
    if not math.isfinite(value) or value < 0 or value > MAX_LATENCY:
        raise UnitError(f"invalid latency {quoted(shown)}: must lie between 0s and {MAX_LATENCY:g}s")
    return float(value)


_NUMBER = r"(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"

# Decimal prefixes for bits and SI bytes, binary prefixes for KiB and friends.
_DEC = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}


def _bandwidth_units() -> dict[str, float]:
    units: dict[str, float] = {}
    for p, m in _DEC.items():
        # bits per second: 100Gbps, 100Gbit/s, 100 Gb/s
        for suffix in ("bps", "bit/s", "b/s", "bit"):
            units[p + suffix] = m / 8.0
        # bytes per second: 25GB/s, 25GBps
        for suffix in ("B/s", "Bps"):
            units[p + suffix] = m
    for p, m in _BIN.items():
        for suffix in ("B/s", "Bps"):
            units[p + suffix] = m
        for suffix in ("bit/s", "bps"):
            units[p + suffix] = m / 8.0
    return units


_BANDWIDTH = _bandwidth_units()
_DURATION = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
_SIZE = {**{p + "B": m for p, m in _DEC.items() if p != "k"}, "kB": 1e3, **{p + "B": m for p, m in _BIN.items()}}

BANDWIDTH_EXAMPLES = "100Gbps, 400Gbit/s, 25GB/s, 1Mbps"
DURATION_EXAMPLES = "5us, 1.5ms, 2s, 500ns"
SIZE_EXAMPLES = "8B, 64MiB, 1GB"
RATIO_EXAMPLES = "0.1%, 0.001"

_PATTERN = re.compile(r"^\s*" + _NUMBER + r"\s*(?P<unit>[^\s0-9.][^\s]*)?\s*$")


def _split(text: object, kind: str, examples: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, str):
        raise UnitError(f"expected a {kind} with a unit as a string (e.g. {examples}), got {quoted(text)}")
    m = _PATTERN.match(text)
    if not m or m.group("unit") is None:
        raise UnitError(f"invalid {kind} {quoted(text)} (expected a number and a unit, e.g. {examples})")
    return float(m.group("num")), m.group("unit")


def parse_bandwidth(text: object) -> float:
    """Parse ``100Gbps``/``25GB/s`` into bytes per second (must be > 0)."""
    num, unit = _split(text, "bandwidth", BANDWIDTH_EXAMPLES)
    if unit not in _BANDWIDTH:
        raise UnitError(f"invalid bandwidth {quoted(text)}: unknown unit {quoted(unit)} (e.g. {BANDWIDTH_EXAMPLES})")
    return check_bandwidth(num * _BANDWIDTH[unit], text)


def parse_duration(text: object) -> float:
    """Parse ``5us``/``2ms`` into seconds (finite, >= 0)."""
    num, unit = _split(text, "duration", DURATION_EXAMPLES)
    if unit not in _DURATION:
        raise UnitError(f"invalid duration {quoted(text)}: unknown unit {quoted(unit)} (e.g. {DURATION_EXAMPLES})")
    value = num * _DURATION[unit]
    if not math.isfinite(value):  # 1e999s reads as infinity
        raise UnitError(f"invalid duration {quoted(text)}: not a finite number")
    return value


def parse_latency(text: object) -> float:
    """Parse a link latency or jitter (``2ms``) into seconds, within [0, 60 s]."""
    return check_latency(parse_duration(text), text)


def parse_size(text: object) -> int:
    """Parse ``64MiB``/``1GB``/``8B`` into a whole number of bytes."""
    num, unit = _split(text, "size", SIZE_EXAMPLES)
    if unit not in _SIZE:
        raise UnitError(f"invalid size {quoted(text)}: unknown unit {quoted(unit)} (e.g. {SIZE_EXAMPLES})")
    value = num * _SIZE[unit]
    if not math.isfinite(value):
        raise UnitError(f"invalid size {quoted(text)}: not a finite number")
    if value != int(value):
        raise UnitError(f"invalid size {quoted(text)}: not a whole number of bytes")
    return int(value)


def parse_ratio(text: object) -> float:
    """Parse ``0.1%`` or a plain fraction like ``0.001`` into a fraction in [0, 1]."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = as_float(text)
    elif isinstance(text, str):
        s = text.strip()
        try:
            value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
        except ValueError:
            raise UnitError(f"invalid ratio {quoted(text)} (e.g. {RATIO_EXAMPLES})") from None
    else:
        raise UnitError(f"invalid ratio {quoted(text)} (e.g. {RATIO_EXAMPLES})")
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise UnitError(f"invalid ratio {quoted(text)}: must lie between 0 and 100%")
    return value


def parse_fraction_flag(text: object, flag: str, example: str = "1%", off: bool = False,
                        below_one: bool = False) -> float:
    """A command-line fraction: ``1%`` or ``0.01`` -> 0.01 (and ``off`` -> 0.0 where ``off``); errors name ``flag``."""
    from .errors import InputError

    s = str(text).strip().lower()
    if off and s == "off":
        return 0.0
    fraction = f"{float(example.rstrip('%')) / 100:g}"
    try:
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        expected = (f"a percentage like {example}, a fraction like {fraction}, or off" if off
                    else f"a percentage like {example} or a fraction like {fraction}")
        raise InputError(f"{flag}: expected {expected}; got {text!r}") from None
    if not (0.0 <= value < 1.0 if below_one else 0.0 <= value < math.inf):  # NaN fails both
        limit = "0 (off) or a fraction under 1" if below_one else "0 or more"
        raise InputError(f"{flag}: must be {limit}, got {text!r}")
    return value


def _scaled(value: float, steps: list[tuple[float, str]], precision: int) -> str:
    for factor, unit in steps:
        if abs(value) >= factor:
            return f"{value / factor:.{precision}g}{unit}"
    factor, unit = steps[-1]
    return f"{value / factor:.{precision}g}{unit}"


def format_bandwidth(bytes_per_s: float, bits: bool = True) -> str:
    """Format bytes/second as ``100Gbps`` (bits) or ``12.5GB/s`` (bytes)."""
    if bits:
        return _scaled(bytes_per_s * 8, [(1e12, "Tbps"), (1e9, "Gbps"), (1e6, "Mbps"), (1e3, "Kbps"), (1, "bps")], 4)
    return _scaled(bytes_per_s, [(1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s"), (1, "B/s")], 4)


def format_duration(seconds: float) -> str:
    """Format seconds as ``5us``, ``1.5ms``, ``2s``."""
    if seconds == 0:
        return "0s"
    return _scaled(seconds, [(1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")], 4)


def format_size(nbytes: float) -> str:
    """Format a byte count with binary prefixes: ``64MiB``."""
    return _scaled(nbytes, [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1, "B")], 4)
