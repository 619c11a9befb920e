"""The link delay a cluster can actually give, measured at ``nbox up`` when the kernel lacks netem.

Without netem the delay of a link is added in user space (the agent's TCP relay and its
NFQUEUE delay line, ``relay.py`` and ``nfqueue.py``), on a path that has a latency of its own:
a 50 µs link reads about 1 ms in ping. So ``nbox up`` measures what a node's traffic really
meets — the median round trip of a 1-byte TCP echo between the first two nodes, through the
relay as gloo's connections go — and says it beside the delay that was set.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

from .namespace import Namespace

__all__ = ["tcp_round_trip", "set_round_trip", "delay_note"]


def tcp_round_trip(ns_a: str, ns_b: str, addr_b: str, samples: int = 7, timeout: float = 5.0) -> float:
    """Median round trip (seconds) of a 1-byte TCP echo from namespace ``ns_a`` to ``addr_b`` in ``ns_b``."""
    srv = Namespace(ns_b).socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.settimeout(timeout)
    srv.bind((addr_b, 0))
    srv.listen(1)

    def echo() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(1):
                conn.sendall(data)

    server = threading.Thread(target=echo, name="nbox-delay-probe", daemon=True)
    server.start()
    cli = Namespace(ns_a).socket(socket.AF_INET, socket.SOCK_STREAM)
    times = []
    try:
        cli.settimeout(timeout)
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cli.connect((addr_b, srv.getsockname()[1]))
        for _ in range(samples + 1):  # the first exchange warms the relay's connection up: not counted
            t0 = time.perf_counter()
            cli.sendall(b"x")
            if cli.recv(1) != b"x":
                raise OSError("the echo did not come back")
            times.append(time.perf_counter() - t0)
    finally:
        cli.close()
        srv.close()
        server.join(timeout)
    return statistics.median(times[1:])


def set_round_trip(state: dict[str, Any], a: str, b: str) -> float:
    """The round trip (seconds) that the links' set delays add between nodes ``a`` and ``b``."""
    plan, shapes = state["plan"], state.get("shapes", {})
    hops = {(x, y): h for x, y, h in plan.get("pair_links", [])}

    def one_way(x: str, y: str) -> float:
        if (x, y) in hops:
            return sum(shapes[str(link)][way]["delay"] for link, way in hops[(x, y)])
        return sum(shapes[str(link)][1 - way]["delay"] for link, way in hops.get((y, x), []))

    return one_way(a, b) + one_way(b, a)


def delay_note(state: dict[str, Any]) -> str | None:
    """The line ``nbox up`` prints when delay is added in user space; None where netem gives it, or nothing is delayed."""
    plan = state["plan"]
    hosts = plan.get("hosts", [])
    if plan.get("netem") or len(hosts) < 2:
        return None
    a, b = hosts[0], hosts[1]
    try:
        wanted = set_round_trip(state, a["node"], b["node"])
    except (KeyError, TypeError, ValueError):  # a state from another version: say nothing rather than fail up
        return None
    if wanted <= 0:
        return None
    from ..units import format_duration

    head = ("no netem in this kernel: link delay is added in user space (TCP relay, NFQUEUE for ping/UDP), "
            "on a path with a latency of its own; ping, through the slower NFQUEUE line, reads more")
    try:
        got = tcp_round_trip(a["ns"], b["ns"], b["address"])
    except OSError as exc:
        return f"{head}; the round trip could not be measured ({exc})"
    return (f"{head}: {a['node']} <-> {b['node']} is set to a {format_duration(wanted)} round trip and gives "
            f"{format_duration(got)} (TCP echo, measured now; about {format_duration(got / 2)} one way)")
