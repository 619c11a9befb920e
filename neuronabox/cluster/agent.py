"""The shaping agent: one daemon per cluster, started by ``nbox up`` (``python -m neuronabox.cluster.agent``).

It owns what changes while a cluster runs:

- an HTTP/JSON API on 127.0.0.1 in the style of toxiproxy: ``GET /links``, ``GET /links/<name>``,
  ``POST /links/<name>`` with ``{"rate": "100Mbps", "delay": "2ms", "jitter": "100us",
  "loss": "0.1%", "direction": "both|ab|ba"}`` (strings with units, or numbers in bytes/s,
  seconds and fractions), applied live (``tc change`` through pyroute2, the relay's delay
  table, the loss rules); ``GET /metrics`` (Prometheus), ``GET /health``;
- supervision: a delay relay or a stub (wire mode's peer, ``stub.py``) that dies is started
  again within a second; ``GET /health`` answers 503 while a relay is down;
- the user-space delay path for all node namespaces when the kernel lacks netem: the TCP relays
  (``relay.py``, one process per node CPU: ``relay_pool.py``) and the NFQUEUE delay line for
  ICMP and UDP (``nfqueue.py``), fed the same delay table;
- per-link counters read from the kernel on each scrape: bytes and packets (the sending end's
  tx counters) and drops (its qdisc's drops, its tx drops and the receiver's rx drops),
  exported as ``nbox_link_*`` metrics in base units.

The API is strict: a POST body is a ``ShapeRequest`` (pydantic, unknown fields refused), every
number within the bounds of ``neuronabox.units`` (rate 0 or up to 100 Tbit/s, delay and jitter
0-60 s, loss 0-1), at most ``MAX_BODY`` bytes read within ``READ_TIMEOUT_S``; anything else is
a 4xx naming the field and the bound. A change goes to the kernel first and is kept (in memory
and in the state file) only when every part of it took; otherwise what was applied is put back
and the reply is a 500 that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, Callable, Literal
from urllib.parse import unquote

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from ..errors import InputError, NboxError
from ..units import UnitError, as_float, quoted, check_bandwidth, check_latency, parse_bandwidth, parse_latency, parse_ratio
from .namespace import Namespace
from .nfqueue import DelayLine
from .relay import Delays, DelayTable, TimerQueue
from .relay_pool import RelayPool
from .shaping import (
    LOSS_CHAIN, LinkShape, apply_loss, apply_rate, delay_rules, delete_root, iptables, loss_rules, mechanisms,
)
from .state import ClusterState
from .steering import steer_flows, steering

__all__ = ["Agent", "NoSuchLink", "ShapeRefused", "ShapeRequest", "parse_shape_changes", "main"]

MAX_BODY = 64 * 1024  # bytes: a shape request is under 200
READ_TIMEOUT_S = 5.0  # a client that announces more than it sends is dropped after this
LISTEN_BACKLOG = 128  # http.server's default of 5 reset a burst of 100 connections


class JsonRequestHandler(BaseHTTPRequestHandler):
    """The agents' HTTP handlers: JSON (or text) replies, a read timeout, and no per-request log lines."""

    server_version = "nbox-agent"
    timeout = READ_TIMEOUT_S  # StreamRequestHandler sets it on the socket: headers and body alike

    def read_body(self) -> bytes:
        """The request's body, at most MAX_BODY bytes; InputError (400) for a bad or missing length."""
        if self.headers.get("Transfer-Encoding"):
            raise InputError("Transfer-Encoding: not accepted, send Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        raw = raw.strip()
        # int() would take '+5', ' 5', '٥' and a 4,000-digit number; a length is a few ASCII digits.
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            raise InputError(f"Content-Length: expected a number of bytes, got {raw[:40]!r}")
        n = int(raw)
        if n > MAX_BODY:
            raise BodyTooLarge(f"Content-Length: {n} bytes, at most {MAX_BODY}")
        data = self.rfile.read(n)  # TimeoutError after READ_TIMEOUT_S of silence
        if len(data) != n:
            raise InputError(f"Content-Length: {n} bytes announced, {len(data)} sent")
        return data

    def log_message(self, fmt, *args):
        """Nothing: the agent's log keeps errors only, not a line per request."""

    def _send(self, code: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body, indent=1) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def answer_shape(self, target: Callable[[], Any], change: Callable[[Any, "ShapeRequest"], Any]) -> None:
        """POST /links/<name>: find ``target()``, read and check the body, answer ``change(target, request)``'s view.

        Each failure is the status that names it: 404 (no such link, before the body is read),
        408 (the body did not arrive), 413 (too large), 400 (anything else malformed), 500 (the
        kernel refused, and the link kept its shape).
        """
        try:
            found = target()
            self._send(200, change(found, parse_shape_request(self.read_body())))
        except TimeoutError:
            self.close_connection = True
            self._send(408, {"error": f"the body did not arrive within {READ_TIMEOUT_S:g} s"})
        except NoSuchLink as exc:
            self._send(404, {"error": str(exc)})
        except BodyTooLarge as exc:
            self.close_connection = True  # the body is left unread
            self._send(413, {"error": str(exc)})
        except InputError as exc:
            self.close_connection = True  # a body may be left unread
            self._send(400, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the kernel refused (ShapeRefused) or worse: report, serve on
            said = str(exc) if isinstance(exc, ShapeRefused) else f"{type(exc).__name__}: {exc}"
            self._send(500, {"error": said})


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog for bursts of clients (a real one: 5 reset 24 of 100)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


class NoSuchLink(InputError):
    """A link name the cluster does not have (HTTP 404)."""


class BodyTooLarge(InputError):
    """A request body over MAX_BODY (HTTP 413)."""


class ShapeRefused(NboxError):
    """The kernel refused a change; what was applied of it is undone and the link keeps its shape (HTTP 500)."""


def _number(value: Any) -> float | None:
    """A JSON number as a float, None for anything else (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return as_float(value)


def _rate(value: Any) -> float:
    # 0 (or "none", "unlimited") takes the limit away; a number is bytes/s.
    num = _number(value)
    if num is not None:
        return 0.0 if num == 0 else check_bandwidth(num)
    if isinstance(value, str) and value.strip() in ("0", "none", "unlimited"):
        return 0.0
    return parse_bandwidth(value)


def _latency(value: Any) -> float:
    num = _number(value)  # a number is seconds
    return check_latency(num) if num is not None else parse_latency(value)


def _unit_error(fn):
    """A parser whose UnitError reaches pydantic as the ValueError it reports per field."""
    def check(value: Any) -> float:
        try:
            return fn(value)
        except UnitError as exc:
            raise ValueError(str(exc)) from None
    return check


class ShapeRequest(BaseModel):
    """The body of ``POST /links/<name>``: each field optional, strings with units or numbers in base units."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Typed float with a None default: an explicit null is refused (validated), an absent field is None.
    rate: Annotated[float, BeforeValidator(_unit_error(_rate))] = None  # type: ignore[assignment]
    delay: Annotated[float, BeforeValidator(_unit_error(_latency))] = None  # type: ignore[assignment]
    jitter: Annotated[float, BeforeValidator(_unit_error(_latency))] = None  # type: ignore[assignment]
    loss: Annotated[float, BeforeValidator(_unit_error(parse_ratio))] = None  # type: ignore[assignment]
    direction: Literal["both", "ab", "ba"] = "both"

    def changes(self) -> dict[str, float]:
        """The fields given, in base units (bytes/s, s, fraction)."""
        return self.model_dump(exclude_unset=True, exclude={"direction"})


def _validation_error(exc: ValidationError) -> InputError:
    """The first problem of a request as one line naming the field."""
    err = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "json_invalid":
        return InputError(f"body is not JSON: {msg}")
    if err["type"] == "model_type":
        return InputError("body must be a JSON object")
    if err["type"] == "extra_forbidden":
        return InputError(f"unknown field {field!r} (rate, delay, jitter, loss, direction)")
    return InputError(f"{field}: {msg}")


def parse_shape_request(body: bytes | dict) -> ShapeRequest:
    """A POST body (raw JSON or already a dict) as a ShapeRequest; InputError naming the field and bound."""
    try:
        if isinstance(body, dict):
            return ShapeRequest.model_validate(body)
        return ShapeRequest.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise _validation_error(exc) from None


def parse_shape_changes(body: dict) -> dict[str, float]:
    """Validate a POST body into base units (bytes/s, s, fraction); raises InputError."""
    return parse_shape_request(body).changes()


class Agent:
    """A cluster's live shaping state: links, their shapes, the kernel objects and the relay."""

    def __init__(self, name: str, token: str = ""):
        self.name = name
        self.token = token
        st = ClusterState.load(name)
        plan = st["plan"]
        self.plan = plan
        self.links = {lk["id"]: lk for lk in plan["links"]}
        self.by_name = {lk["name"]: lk["id"] for lk in plan["links"]}
        self.shapes = {int(k): [LinkShape(**v[0]), LinkShape(**v[1])] for k, v in st["shapes"].items()}
        self.netem = bool(plan.get("netem"))
        self.rate_kind = plan.get("rate_kind", "tbf")
        self.subnet = plan["subnet"]
        self.relay_port = plan["relay_port"]
        self.hosts = plan["hosts"]  # [{"node", "ns", "address"}]
        self.pair_links = plan["pair_links"]  # [[src node, dst node, [[link, dir], ...]], ...]
        self.relay_ns: set[str] = set(plan.get("relay_ns", []))
        self.lock = threading.RLock()
        self.iprs: dict[str, object] = {}
        # pyroute2 keeps one socket per thread, made in whatever namespace that thread is in
        # when it first talks: every netlink call therefore runs on this one thread, whose
        # sockets are made inside the right namespace.
        self.nl = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbox-netlink")
        self.relays: RelayPool | None = None
        self.delays = DelayTable()  # the delay line's copy of the table the relays hold
        self.timers: TimerQueue | None = None  # the delay line's
        self.delayline: DelayLine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lookups ---------------------------------------------------------------------------
    def link_id(self, name: str) -> int:
        """A link's id from its name (``node0:0--switch``) or ``l<id>``/``<id>``."""
        if name in self.by_name:
            return self.by_name[name]
        raw = name[1:] if name.startswith("l") else name
        if raw.isdigit() and int(raw) in self.links:
            return int(raw)
        raise NoSuchLink(f"no link named {quoted(name)} (GET /links lists them)")

    def _ipr(self, ns: str):
        ipr = self.iprs.get(ns)
        if ipr is None:
            ipr = self.iprs[ns] = Namespace(ns).iproute()
        return ipr

    # ---- delays for the relay -----------------------------------------------------------
    def node_addresses(self) -> dict[str, list[str]]:
        """Per node: its node address and each of its NICs' addresses."""
        addrs: dict[str, list[str]] = {h["node"]: [h["address"]] for h in self.hosts}
        for lk in self.links.values():
            for end in (lk["a"], lk["b"]):
                node = end["vertex"].split("/", 1)[0]
                if end.get("addr") and node in addrs and end["addr"] not in addrs[node]:
                    addrs[node].append(end["addr"])
        return addrs

    def route_delays(self) -> dict[str, dict[str, Delays]]:
        """Per node namespace: destination address -> one-way delays of the route both ways."""
        # A node is reached at its node address and at each of its NICs' addresses: traffic to
        # any of them crosses the same route, so each gets the route's delays.
        addrs = self.node_addresses()
        ns_of = {h["node"]: h["ns"] for h in self.hosts}
        one_way: dict[tuple[str, str], tuple[float, float]] = {}
        for src, dst, hops in self.pair_links:
            d = sum(self.shapes[lid][dr].delay for lid, dr in hops)
            j = sum(self.shapes[lid][dr].jitter for lid, dr in hops)
            one_way[(src, dst)] = (d, j)
        table: dict[str, dict[str, Delays]] = {ns: {} for ns in ns_of.values()}
        for (src, dst), (d, j) in one_way.items():
            rd, rj = one_way.get((dst, src), (0.0, 0.0))
            if d or j or rd or rj:
                for a in addrs[dst]:
                    table[ns_of[src]][a] = Delays(d, rd, j, rj)
        return table

    def needs_relay(self) -> set[str]:
        """Node namespaces that have a delayed route and so need their traffic redirected."""
        return {ns for ns, t in self.route_delays().items() if t} if not self.netem else set()

    def _sync_relay(self) -> None:
        if self.netem or self.relays is None:
            return
        table = self.route_delays()
        need = self.needs_relay()
        rules = delay_rules(self.relay_port, self.subnet)
        for ns in need - self.relay_ns:
            with ClusterState(self.name).locked() as st:
                st.record("iptables", [{"ns": ns, "rule": r} for r in rules])
            for r in rules:
                iptables(Namespace(ns), r)
        for ns in self.relay_ns - need:
            # No delay left: new connections go straight again (the relay costs throughput: it
            # tops out near 4-6 Gbit/s here). Connections it already carries keep their NAT
            # entry and it serves them to their end.
            for r in rules:
                iptables(Namespace(ns), [*r[:2], "-D", *r[3:]])
        if need != self.relay_ns:  # the state file is written only when the set changed
            self.relay_ns = need
            with ClusterState(self.name).locked() as st:
                st.data["plan"]["relay_ns"] = sorted(need)
                st.save()
        for ns, t in table.items():
            self._set_delays(ns, t)

    def _set_delays(self, ns: str, table: dict[str, Delays]) -> None:
        self.relays.set_delays(ns, table)
        self.loop.call_soon_threadsafe(self.delays.set, ns, table)

    # ---- health ----------------------------------------------------------------------------
    def parts_down(self) -> list[str]:
        """What of the agent's delay path is not running now, one phrase each (empty: all is well)."""
        if self.relays is None:
            return []
        return [f"delay relay {i} (pid {self.relays.workers[i].proc.pid}) is not running; the agent restarts it"
                for i in self.relays.dead()]

    async def supervise(self, every: float = 0.5) -> None:
        """Restart dead relays and stubs, for as long as the agent runs."""
        from .stub import revive_stubs

        while True:
            await asyncio.sleep(every)
            try:
                revived = await self.loop.run_in_executor(None, revive_stubs, self.name)
                if revived:
                    print(f"nbox agent: restarted the stub(s) of {', '.join(revived)}", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001 - tried again next round; status says so meanwhile
                print(f"nbox agent: restarting a stub failed: {exc}", file=sys.stderr, flush=True)
            if self.relays is not None and self.relays.dead():
                try:
                    revived = await self.loop.run_in_executor(None, self.relays.revive)
                    print(f"nbox agent: restarted delay relay(s) {revived}", file=sys.stderr, flush=True)
                except Exception as exc:  # noqa: BLE001 - tried again next round; /health says so meanwhile
                    print(f"nbox agent: restarting a delay relay failed: {exc}", file=sys.stderr, flush=True)

    # ---- views ---------------------------------------------------------------------------
    def view(self, lid: int, counters: dict | None = None) -> dict:
        """A link as the API shows it."""
        lk = self.links[lid]
        ab, ba = self.shapes[lid]
        out = {
            "id": lid,
            "name": lk["name"],
            "a": {k: lk["a"][k] for k in ("ns", "ifname", "vertex", "addr")},
            "b": {k: lk["b"][k] for k in ("ns", "ifname", "vertex", "addr")},
            "ab": ab.as_dict(),
            "ba": ba.as_dict(),
            "mechanisms": mechanisms([ab, ba], self.netem, self.rate_kind),
        }
        if counters is not None:
            out["counters"] = counters.get(lid)
        return out

    def counters(self) -> dict[int, dict[str, dict[str, int]]]:
        """Per link and direction: bytes, packets and drops, read from the kernel now."""
        return self.nl.submit(self._counters).result()

    def _counters(self) -> dict[int, dict[str, dict[str, int]]]:
        stats: dict[tuple[str, int], dict] = {}
        qdrops: dict[tuple[str, int], int] = {}
        namespaces = {lk[e]["ns"] for lk in self.links.values() for e in ("a", "b")}
        with self.lock:
            for ns in namespaces:
                ipr = self._ipr(ns)
                for msg in ipr.get_links():
                    s = msg.get_attr("IFLA_STATS64") or {}
                    stats[(ns, msg["index"])] = s
                for q in ipr.get_qdiscs():
                    s2 = q.get_attr("TCA_STATS2")
                    drops = 0
                    if s2 is not None:
                        qs = s2.get_attr("TCA_STATS_QUEUE")
                        drops = qs.get("drops", 0) if qs else 0
                    qdrops[(ns, q["index"])] = qdrops.get((ns, q["index"]), 0) + drops
        out: dict[int, dict[str, dict[str, int]]] = {}
        for lid, lk in self.links.items():
            per = {}
            for label, src, dst in (("ab", lk["a"], lk["b"]), ("ba", lk["b"], lk["a"])):
                s = stats.get((src["ns"], src["index"]), {})
                r = stats.get((dst["ns"], dst["index"]), {})
                per[label] = {
                    "bytes": int(s.get("tx_bytes", 0)),
                    "packets": int(s.get("tx_packets", 0)),
                    "drops": int(qdrops.get((src["ns"], src["index"]), 0) + s.get("tx_dropped", 0) + r.get("rx_dropped", 0)),
                }
            out[lid] = per
        return out

    # ---- changes ----------------------------------------------------------------------------
    def set_link(self, lid: int, changes: dict[str, float], direction: str = "both") -> dict:
        """Apply new rate/delay/jitter/loss to a link (one or both directions), live."""
        return self.nl.submit(self._set_link, lid, changes, direction).result()

    def _set_link(self, lid: int, changes: dict[str, float], direction: str) -> dict:
        if direction not in ("both", "ab", "ba"):
            raise InputError(f"direction: expected both, ab or ba, got {direction!r}")
        with self.lock:
            dirs = [0, 1] if direction == "both" else [0 if direction == "ab" else 1]
            old = self.shapes[lid]
            # The kernel first: the new shapes are what _apply reads, and stay only if every part took.
            self.shapes[lid] = [replace(s, **changes) if d in dirs else replace(s) for d, s in enumerate(old)]
            try:
                self._apply(lid, changes, dirs)
            except Exception as exc:  # noqa: BLE001 - a refusal of the kernel, of iptables or of a relay
                self.shapes[lid] = old
                try:
                    self._apply(lid, changes, dirs)  # the old shapes back, through the same path
                except Exception as undo:  # noqa: BLE001
                    print(f"nbox agent: undoing a refused change of link {lid} failed too: {undo}",
                          file=sys.stderr, flush=True)
                raise ShapeRefused(f"link {self.links[lid]['name']}: the kernel refused the change "
                                   f"({type(exc).__name__}: {str(exc)[:200]}); the link keeps its shape") from None
            ab, ba = self.shapes[lid]
            with ClusterState(self.name).locked() as st:
                st.data.setdefault("shapes", {})[str(lid)] = [ab.as_dict(), ba.as_dict()]
                st.save()
        return self.view(lid)

    def _apply(self, lid: int, changes: dict[str, float], dirs: list[int]) -> None:
        """Make the kernel, loss rules and relays' delay table match ``self.shapes[lid]`` in the changed fields."""
        lk = self.links[lid]
        ab, ba = self.shapes[lid]
        if "rate" in changes or (self.netem and changes):
            for d in dirs:
                end = lk["a"] if d == 0 else lk["b"]
                self._set_rate(end, self.shapes[lid][d])
            self._steer({lk["a"]["ns"], lk["b"]["ns"]})
        if "loss" in changes and not self.netem:
            from types import SimpleNamespace as NS

            link = NS(id=lid, a=NS(**lk["a"]), b=NS(**lk["b"]))
            rules = loss_rules(link, ab.loss, ba.loss)
            touched = sorted({lk["a"]["ns"], lk["b"]["ns"]})
            with ClusterState(self.name).locked() as st:
                st.record("iptables", [{"ns": ns, "chains": LOSS_CHAIN} for ns in touched]
                          + [{"ns": ns, "rule": r} for ns in touched for r in rules.get(ns, [])])
            for ns in touched:
                apply_loss(Namespace(ns), rules.get(ns, []), {lid})
        if ("delay" in changes or "jitter" in changes) and not self.netem:
            self._sync_relay()

    def _steer(self, namespaces: set[str]) -> None:
        """Steer (or stop steering) the namespaces' interfaces for their links' rates now (steering.py)."""
        plan = steering(([(l["a"]["ns"], l["a"]["ifname"]), (l["b"]["ns"], l["b"]["ifname"])],
                         self.shapes[i][0].rate, self.shapes[i][1].rate) for i, l in self.links.items())
        steer_flows({Namespace(ns).path: plan[ns] for ns in namespaces if ns in plan})

    def _set_rate(self, end: dict, shape: LinkShape) -> None:
        ipr = self._ipr(end["ns"])
        try:
            apply_rate(ipr, end["index"], shape, self.rate_kind, change=True, netem=self.netem)
        # No qdisc to change yet (an unshaped link), or tbf to become htb above 34 Gbit/s: replace it.
        except Exception:  # noqa: BLE001
            delete_root(ipr, end["index"])
            with ClusterState(self.name).locked() as st:
                st.record("qdiscs", {"ns": end["ns"], "ifname": end["ifname"], "kind": self.rate_kind})
            apply_rate(ipr, end["index"], shape, self.rate_kind, change=False, netem=self.netem)

    # ---- metrics ----------------------------------------------------------------------------
    def collector(self):
        """A prometheus-client collector reading the kernel's counters at scrape time."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        agent = self

        class LinkCollector:
            """Reads every link's counters from the kernel when Prometheus scrapes."""

            def collect(self):
                counters = agent.counters()
                labels = ["cluster", "link", "direction"]
                fam = {
                    "bytes": CounterMetricFamily("nbox_link_transmit_bytes", "Bytes sent into the link (sending end)", labels=labels),
                    "packets": CounterMetricFamily("nbox_link_transmit_packets", "Packets sent into the link", labels=labels),
                    "drops": CounterMetricFamily("nbox_link_drops", "Packets dropped by the shaping queue or the veth", labels=labels),
                }
                rate = GaugeMetricFamily("nbox_link_rate_bytes_per_second", "Configured rate (0: unshaped)", labels=labels)
                delay = GaugeMetricFamily("nbox_link_delay_seconds", "Configured one-way delay", labels=labels)
                jitter = GaugeMetricFamily("nbox_link_jitter_seconds", "Configured jitter", labels=labels)
                loss = GaugeMetricFamily("nbox_link_loss_ratio", "Configured loss", labels=labels)
                for lid, per in counters.items():
                    name = agent.links[lid]["name"]
                    for d, label in enumerate(("ab", "ba")):
                        lv = [agent.name, name, label]
                        for k, f in fam.items():
                            f.add_metric(lv, per[label][k])
                        s = agent.shapes[lid][d]
                        rate.add_metric(lv, s.rate)
                        delay.add_metric(lv, s.delay)
                        jitter.add_metric(lv, s.jitter)
                        loss.add_metric(lv, s.loss)
                yield from fam.values()
                yield from (rate, delay, jitter, loss)
                if agent.relays is not None:
                    rs = agent.relays.stats()
                    c = CounterMetricFamily("nbox_relay_connections", "Connections through the delay relay", labels=["cluster"])
                    c.add_metric([agent.name], rs["connections"])
                    yield c
                    b = CounterMetricFamily("nbox_relay_bytes", "Bytes through the delay relay", labels=["cluster"])
                    b.add_metric([agent.name], rs["bytes"])
                    yield b
                if agent.delayline is not None:
                    q = CounterMetricFamily("nbox_nfqueue_packets", "Non-TCP packets held by the NFQUEUE delay line",
                                            labels=["cluster"])
                    q.add_metric([agent.name], agent.delayline.held)
                    yield q

        return LinkCollector()

    # ---- serving ----------------------------------------------------------------------------
    def handler(self):
        """The HTTP request handler class bound to this agent."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(self.collector())
        agent = self

        class Handler(JsonRequestHandler):
            """GET/POST /links[/<name>], GET /metrics, GET /health."""

            def do_GET(self):
                path = unquote(self.path.split("?")[0]).rstrip("/")
                try:
                    if path == "/metrics":
                        self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
                    elif path == "/health":
                        r, q = agent.relays, agent.delayline
                        down = agent.parts_down()
                        # 503 while a part is down: a probe that reads only the status sees it too.
                        self._send(503 if down else 200, {
                            "cluster": agent.name, "pid": os.getpid(), "healthy": not down, "down": down,
                            "relay_namespaces": sorted(agent.relay_ns), "relay": None if r is None else r.stats(),
                            "nfqueue": None if q is None else {"queues": len(q.queues), "held": q.held,
                                                               "released": q.released}})
                    elif path == "/links":
                        c = agent.counters()
                        self._send(200, [agent.view(lid, c) for lid in sorted(agent.links)])
                    elif path.startswith("/links/"):
                        lid = agent.link_id(path[len("/links/"):])
                        self._send(200, agent.view(lid, agent.counters()))
                    else:
                        self._send(404, {"error": f"no such resource {quoted(path)}"})
                except InputError as exc:
                    self._send(404, {"error": str(exc)})

            def do_POST(self):
                path = unquote(self.path.split("?")[0]).rstrip("/")
                if not path.startswith("/links/"):
                    self._send(404, {"error": f"no such resource {quoted(path)}"})
                    return
                self.answer_shape(lambda: agent.link_id(path[len("/links/"):]),
                                  lambda lid, req: agent.set_link(lid, req.changes(), req.direction))

        return Handler

    async def run(self, port: int = 0) -> None:
        """Serve until SIGTERM: relay listeners in node namespaces, HTTP API on 127.0.0.1."""
        self.loop = asyncio.get_running_loop()
        if not self.netem:
            self.relays = RelayPool(self.hosts, self.node_addresses(), self.relay_port, self.token)
            # Started from a thread: the relays' start-up answers are waited for without the loop.
            await self.loop.run_in_executor(None, self.relays.start)
            for ns, t in self.route_delays().items():
                self._set_delays(ns, t)
            # Non-TCP packets: the same delay table, timed in this process.
            self.timers = TimerQueue(self.loop)
            self.delayline = DelayLine(self.loop, self.timers, self.delays.lookup)
            for h in self.hosts:
                try:
                    self.delayline.attach(h["ns"], Namespace(h["ns"]))
                except OSError as exc:
                    # The queue rule has --queue-bypass: this node's ICMP/UDP then passes undelayed.
                    print(f"nbox agent: no NFQUEUE delay line in {h['ns']}: {exc}", file=sys.stderr, flush=True)
        httpd = _Server(("127.0.0.1", port), self.handler())
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True, name="nbox-agent-http").start()
        info = {"pid": os.getpid(), "port": httpd.server_address[1], "url": f"http://127.0.0.1:{httpd.server_address[1]}",
                "started": time.time()}
        st = ClusterState(self.name)
        tmp = st.dir / f".agent.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, st.dir / "agent.json")
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, stop.set)
        supervisor = asyncio.create_task(self.supervise())
        await stop.wait()
        supervisor.cancel()
        # No httpd.shutdown(): it waits out serve_forever's 0.5 s poll; the thread is a daemon.
        httpd.server_close()
        if self.delayline is not None:
            self.delayline.close()
            self.timers.close()
        if self.relays is not None:
            self.relays.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the agent process."""
    ap = argparse.ArgumentParser(prog="nbox-agent")
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token", default="")  # only there so that `down` can find this process by its command line
    args = ap.parse_args(argv)
    asyncio.run(Agent(args.name, args.token).run(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
