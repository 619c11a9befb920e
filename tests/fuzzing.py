"""Hypothesis strategies and checks for the hostile-input fuzz (issue 31), shared by the small run in
``tests/test_fuzz_hostile.py`` and the long one in ``benchmarks/fuzz_hostile.py``.

Two surfaces. Topology documents: a valid file with one to four fields replaced by values past
any sense (huge, negative, NaN and infinite numbers; unit strings with exponents of 999; names
that are options or shell; deep lists), or raw YAML text of brackets, aliases and numbers; each
must load within bounds or be refused with one ``TopologyError`` line, quickly. Agent requests:
bodies (JSON with NaN and Infinity allowed, arbitrary bytes) and Content-Length headers sent
raw to the agent's own HTTP handler; each must be answered 2xx with values within the bounds,
or 4xx with one line naming the problem, never 5xx, never a traceback in the server.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from typing import Any

import yaml
from hypothesis import strategies as st

from neuronabox.cluster.agent import Agent, JsonRequestHandler, _Server
from neuronabox.cluster.shaping import LinkShape
from neuronabox.errors import TopologyError
from neuronabox.topology import parse_topology
from neuronabox.topology.schema import MAX_NODES, MAX_RANKS_PER_NODE, MAX_WORLD, NAME_PATTERN
from neuronabox.units import MAX_BANDWIDTH, MAX_LATENCY, MIN_BANDWIDTH

__all__ = ["documents", "yaml_texts", "check_topology", "requests", "AgentHarness"]

BASE = {
    "name": "fuzz",
    "cluster": {"nodes": 2, "ranks_per_node": 1, "device": "cpu"},
    "intra_node": {"fabric": "shm"},
    "network": {"type": "ring", "link": {"bandwidth": "1Gbps", "latency": "100us"}},
    "emulation": {"real_ranks": [0], "library": "gloo"},
}

_NUMBERS = ["0", "1", "-1", "1e999", "1e30", "1e12", "1e308", "nan", "inf", "-0", "0.5", "100", "1e-30", "99999999999"]
_UNITS = ["Gbps", "Tbps", "bps", "GB/s", "s", "ms", "us", "ns", "min", "%", "", "x", " Gbps", "GiB/s"]
_NASTY = ["", "-rf", "--help", "$(touch x)", "a b", "n" * 64, "node0", "node0:0", "../x", "\x00", "é", "[" * 50]

scalars = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.builds(lambda n, u: n + u, st.sampled_from(_NUMBERS), st.sampled_from(_UNITS)),
    st.sampled_from(_NASTY),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)

_PATHS = [
    ("name",), ("description",), ("cluster", "nodes"), ("cluster", "ranks_per_node"), ("cluster", "device"),
    ("cluster", "overrides"), ("cluster", "overrides", "0"), ("cluster", "overrides", "0", "compute_slowdown"),
    ("cluster", "overrides", "0", "ranks"), ("network", "type"), ("network", "link", "bandwidth"),
    ("network", "link", "latency"), ("network", "link", "jitter"), ("network", "link", "loss"),
    ("network", "nics_per_node"), ("network", "mtu"), ("network", "switch_latency"), ("network", "fat_tree"),
    ("network", "switches"), ("network", "links"), ("intra_node", "bandwidth"), ("intra_node", "latency"),
    ("emulation", "real_ranks"), ("emulation", "gloo_threads"), ("emulation", "model"),
    ("whatif", "world_size"), ("whatif", "latency_scale"), ("whatif", "bandwidth_scale"),
    ("whatif", "stragglers"), ("whatif", "inject"), ("whatif", "inject", "all_reduce"),
]
_NODE_LIST = st.lists(st.fixed_dictionaries({"name": st.one_of(st.sampled_from(_NASTY), st.text(max_size=8))}),
                      min_size=1, max_size=3)


def _set(doc: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        nxt = doc.get(key)
        if not isinstance(nxt, dict):
            nxt = doc[key] = {}
        doc = nxt
    doc[path[-1]] = value


def _around(bound: float, unit: str, scale: float) -> st.SearchStrategy:
    """Unit strings on both sides of a bound (``bound`` in ``unit``s) and near zero."""
    near = st.floats(min_value=0.0, max_value=2.0).map(lambda f: f"{f * bound:.6g}{unit}")
    return st.one_of(near, st.floats(min_value=-1e-6, max_value=1e-6).map(lambda f: f"{f * scale:.3g}{unit}"))


# Values on both sides of each bound, so that many documents are accepted and every accepted
# value is held to the bound (the hostile values above are nearly all refused).
_NEAR = {
    ("network", "link", "bandwidth"): st.one_of(_around(100, "Tbps", 1e6), _around(1, "Kbps", 1)),
    ("network", "link", "latency"): _around(60, "s", 1),
    ("network", "link", "jitter"): _around(60000, "ms", 1),
    ("network", "link", "loss"): st.floats(min_value=-0.5, max_value=1.5),
    ("intra_node", "bandwidth"): st.one_of(_around(12.5, "TB/s", 1e6), _around(125, "B/s", 1)),
    ("intra_node", "latency"): _around(60e6, "us", 1),
    ("network", "switch_latency"): _around(60, "s", 1),
    ("cluster", "ranks_per_node"): st.integers(min_value=-2, max_value=2 * MAX_RANKS_PER_NODE),
    ("cluster", "nodes"): st.integers(min_value=-2, max_value=2000),
    ("whatif", "world_size"): st.sampled_from([1, 2, 4, 1024, MAX_WORLD, MAX_WORLD + 1, 10**9]),
    ("whatif", "latency_scale"): st.floats(min_value=-1, max_value=2000),
    ("whatif", "bandwidth_scale"): st.floats(min_value=-1, max_value=2000),
    ("network", "nics_per_node"): st.integers(min_value=-1, max_value=2 * MAX_RANKS_PER_NODE),
    ("whatif", "inject", "all_reduce"): _around(60, "s", 1),
}


@st.composite
def documents(draw) -> str:
    """A valid topology with a few fields replaced by hostile values, or by values near their bounds, as YAML text."""
    doc = json.loads(json.dumps(BASE))
    if draw(st.booleans()):
        for path in draw(st.lists(st.sampled_from(sorted(_NEAR)), min_size=1, max_size=3)):
            _set(doc, path, draw(_NEAR[path]))
        return yaml.safe_dump(doc, allow_unicode=True)
    for path in draw(st.lists(st.sampled_from(_PATHS), min_size=1, max_size=4)):
        _set(doc, path, draw(values))
    if draw(st.booleans()):
        doc["cluster"]["nodes"] = draw(_NODE_LIST)
    return yaml.safe_dump(doc, allow_unicode=True)


_TOKENS = ["[", "]", "{", "}", ": ", ", ", "\n", "  ", "- ", "&a ", "*a", "!!python/object ", "1e999", "9" * 50,
           "cluster", "nodes", "network", "link", "bandwidth", "'", '"', "#", "---\n", "? ", "|\n", ".nan", ".inf"]
yaml_texts = st.one_of(
    st.lists(st.sampled_from(_TOKENS), max_size=60).map("".join),
    st.builds(lambda n: "cluster: {nodes: " + "[" * n + "]" * n + "}\n", st.integers(0, 3000)),
    st.builds(lambda d: "cluster: {nodes: 2, ranks_per_node: " + "9" * d + "}\nnetwork: {link: {bandwidth: 1Gbps}}\n",
              st.integers(1, 6000)),
    st.text(max_size=200),
)


def check_topology(text: str, limit_s: float = 2.0) -> str:
    """Load ``text``: it loads within the bounds, or is refused with one line; returns 'ok' or 'refused'."""
    t0 = time.monotonic()
    try:
        t = parse_topology(text, "fuzz.yaml")
    except TopologyError as exc:
        msg = str(exc)
        assert "\n" not in msg and msg.startswith("fuzz.yaml") and len(msg) < 600, msg
        took = time.monotonic() - t0
        assert took < limit_s, f"refused in {took:.2f} s (bound {limit_s} s): {text[:120]!r}"
        return "refused"
    took = time.monotonic() - t0
    assert took < limit_s, f"loaded in {took:.2f} s (bound {limit_s} s): {text[:120]!r}"
    assert 1 <= t.world_size <= MAX_WORLD and len(t.nodes) <= MAX_NODES
    import re

    for n in t.nodes:
        assert re.match(NAME_PATTERN, n.name) and 1 <= n.ranks <= MAX_RANKS_PER_NODE and n.nics <= MAX_RANKS_PER_NODE
        assert MIN_BANDWIDTH <= n.intra_bandwidth <= MAX_BANDWIDTH and 0 <= n.intra_latency <= MAX_LATENCY
        assert math.isfinite(n.compute_slowdown) and n.compute_slowdown > 0
    links = [t.network.link, *t.network.links]
    for lk in links:
        if lk.bandwidth is not None:
            assert MIN_BANDWIDTH <= lk.bandwidth <= MAX_BANDWIDTH
        for d in (lk.latency, lk.jitter):
            assert d is None or 0 <= d <= MAX_LATENCY
        assert lk.loss is None or 0 <= lk.loss <= 1
    return "ok"


# ---- agent requests ----------------------------------------------------------------------------
_BODY_KEYS = ["rate", "delay", "jitter", "loss", "direction", "toxics", "Rate", ""]
_NEAR_BODY = st.fixed_dictionaries({}, optional={
    "rate": st.one_of(_around(100, "Tbps", 1e6), _around(1, "Kbps", 1), st.just("unlimited"),
                      st.floats(min_value=-1, max_value=2 * MAX_BANDWIDTH), st.floats(min_value=-1, max_value=1000)),
    "delay": st.one_of(_around(60, "s", 1), st.floats(min_value=-1, max_value=120)),
    "jitter": st.one_of(_around(60000, "ms", 1), st.floats(min_value=-1, max_value=120)),
    "loss": st.one_of(st.floats(min_value=-0.5, max_value=1.5), st.floats(0, 150).map(lambda f: f"{f:.3g}%")),
    "direction": st.sampled_from(["both", "ab", "ba"]),
}).map(lambda d: json.dumps(d).encode())
_bodies = st.one_of(
    _NEAR_BODY, _NEAR_BODY, _NEAR_BODY, _NEAR_BODY,
    st.dictionaries(st.sampled_from(_BODY_KEYS), values, max_size=4).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(st.sampled_from(_BODY_KEYS), st.sampled_from(["both", "ab", "ba", "1Gbps", "2ms", "1%", 0, 1e308]),
                    max_size=4).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
    st.builds(lambda n: b"[" * n + b"]" * n, st.integers(0, 20000)),
    st.builds(lambda n: b'{"a":' * n + b"1" + b"}" * n, st.integers(0, 3000)),
    st.builds(lambda d: b'{"rate": ' + b"9" * d + b"}", st.integers(1, 6000)),
)
_lengths = st.one_of(st.just(None), st.just(None), st.just(None), st.sampled_from([b"abc", b"-5", b"+5", b" 5", b"1e3", b"0x10", b"", b"99999999999999999999",
                                                      str(10**12).encode(), b"65537"]))
# The link that exists, most of the time: the bodies are what is fuzzed.
_OTHER_PATHS = st.sampled_from(["/links/nosuch", "/links/%00", "/other", "/links/" + "x" * 2000])
requests = st.tuples(st.one_of(st.just("/links/l0"), st.just("/links/l0"), st.just("/links/l0"), _OTHER_PATHS),
                     _bodies, _lengths)


class AgentHarness:
    """The agent's real HTTP handler and server on 127.0.0.1, over a link store that needs no kernel.

    ``set_link`` records what reached it; the checks hold every recorded value to the bounds.
    """

    def __init__(self, read_timeout: float = 0.3):
        agent = Agent.__new__(Agent)  # no cluster: the parts the handler touches, set by hand
        agent.name = "fuzz"
        agent.links = {0: {"name": "l0"}}
        agent.by_name = {"l0": 0}
        agent.relays = agent.delayline = None
        agent.relay_ns = set()
        agent.shapes = {0: [LinkShape(), LinkShape()]}
        self.applied: list[tuple[dict, str]] = []
        agent.set_link = lambda lid, changes, direction: (self.applied.append((changes, direction)), {"ok": True})[1]
        agent.counters = lambda: {}
        agent.view = lambda lid, counters=None: {"id": lid}
        handler = agent.handler()
        handler.timeout = read_timeout  # a body shorter than its length waits this long, not 5 s
        self.errors: list[str] = []
        harness = self

        class Server(_Server):
            def handle_error(self, request, client_address):  # a traceback: the fuzz fails on it
                import traceback

                harness.errors.append(traceback.format_exc())

        self.httpd = Server(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def send(self, path: str, body: bytes, length: bytes | None) -> tuple[int, bytes]:
        """POST ``body`` with ``length`` as its Content-Length (None: the true one); the status and reply body."""
        n = str(len(body)).encode() if length is None else length
        head = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + n + b"\r\nConnection: close\r\n\r\n"
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            try:
                s.sendall(head + body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the whole body was read: the reply is still there
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except ConnectionResetError:
                pass
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
        return status, data.partition(b"\r\n\r\n")[2]

    def check(self, path: str, body: bytes, length: bytes | None, limit_s: float = 2.0) -> int:
        """Send one request and hold the answer to the contract; returns the status."""
        before = len(self.applied)
        t0 = time.monotonic()
        status, reply = self.send(path, body, length)
        assert time.monotonic() - t0 < limit_s
        assert not self.errors, self.errors[0]
        assert status in (200, 400, 404, 408, 413), (status, reply[:300])
        if status == 200:
            (changes, direction), = self.applied[before:]
            assert direction in ("both", "ab", "ba")
            for k, v in changes.items():
                assert isinstance(v, float) and math.isfinite(v), (k, v)
                bound = {"rate": MAX_BANDWIDTH, "delay": MAX_LATENCY, "jitter": MAX_LATENCY, "loss": 1.0}[k]
                assert 0 <= v <= bound and (k != "rate" or v == 0 or v >= MIN_BANDWIDTH), (k, v)
        else:
            assert len(self.applied) == before
            err = json.loads(reply)["error"]
            assert isinstance(err, str) and "\n" not in err and len(err) < 600, err
        return status
