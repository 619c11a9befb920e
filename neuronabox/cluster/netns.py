"""The netns runtime's network, built: a plan's namespaces, veth pairs, bridges, addresses and routes made real.

One small module per kernel concept, after Mininet's node.py/link.py: ``namespace.py``
(``Namespace``, a named network namespace), ``rtnetlink.py`` (``RtBatch``, a netlink socket
inside one namespace that sends many requests at once) and ``netplan.py`` (``NetworkPlan``,
what the topology becomes: namespaces, links, bridges, addresses, routes). This module builds
a plan (``build_network``), recording each piece in the cluster's state before it is made so
``nbox down`` can remove it, and waits for its links to come up (``wait_links_up``).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

from ..errors import InputError
from .namespace import Namespace
from .netplan import NetworkPlan
from .rtnetlink import RtBatch

__all__ = ["build_network", "wait_links_up"]


_SYSCTL_NODE = {
    "net.ipv4.ip_forward": "1",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    # A socket keeps its flow hash: rehashing after a loss probe moved a steered flow to another
    # CPU's backlog and reordered it (steering.py); a real NIC's RSS hash never changes either.
    "net.core.txrehash": "0",
}


def _taken_message(names: list[str]) -> str:
    """The one line for namespaces that exist already."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return (f"network namespace {names[0]}{more} exists already: a cluster of this name is up elsewhere "
            f"(another NBOX_STATE_DIR) or a crash left it; `ip netns delete {names[0]}` or pick another --name")


def build_network(plan: NetworkPlan, state, progress=None, adopt: dict[str, int] | None = None) -> None:
    """Create the plan's namespaces, links, bridges, addresses, routes and rules, recording each first.

    ``adopt``: namespace name -> pid of a process whose namespace becomes that one instead of a new
    one (a docker node's container); the others are created.
    """
    say = progress or (lambda msg: None)
    adopt = adopt or {}
    nss = {p.name: Namespace(p.name) for p in plan.namespaces}
    # A name already bound belongs to someone else (a cluster of the same name kept in another
    # state folder, or one whose state a crash lost): refuse before recording, so that this
    # `up`'s clean-up never deletes what it did not make.
    taken = [name for name, ns in nss.items() if ns.exists()]
    if taken:
        raise InputError(_taken_message(taken))
    state.record("namespaces", [{"name": p.name, "kind": p.kind, "vertex": p.vertex,
                                 **({"adopted": adopt[p.name]} if p.name in adopt else {})} for p in plan.namespaces])
    for i, p in enumerate(plan.namespaces):
        try:
            if p.name in adopt:
                nss[p.name].adopt(adopt[p.name])
            else:
                nss[p.name].create()
        except FileExistsError:
            # Bound by another process since the check: this one and the rest are not ours.
            ours = {q.name for q in plan.namespaces[:i]}
            state.data["namespaces"] = [r for r in state.data["namespaces"] if r["name"] in ours
                                        or r["name"] not in nss]
            state.save()
            raise InputError(_taken_message([p.name])) from None
        # IPv6 off before any interface exists: no DAD or router solicitations in the counters.
        nss[p.name].sysctl(_SYSCTL_NODE)
    say(f"{len(nss)} namespaces")
    batches = {name: RtBatch(ns) for name, ns in nss.items()}
    fds = {name: os.open(ns.path, os.O_RDONLY | os.O_CLOEXEC) for name, ns in nss.items()}
    try:
        for p in plan.namespaces:
            batches[p.name].up(1)
        state.record("bridges", [{"ns": ns, "ifname": "br0", "index": idx} for ns, idx in plan.bridges.items()])
        for ns, idx in plan.bridges.items():
            batches[ns].bridge("br0", idx)
        state.record("veths", [{"name": lk.name, "a": [lk.a.ns, lk.a.ifname], "b": [lk.b.ns, lk.b.ifname]} for lk in plan.links])
        for lk in plan.links:
            batches[lk.a.ns].veth(lk.a.ifname, lk.a.index, lk.b.ifname, lk.b.index, fds[lk.b.ns])
        # Links first, in every namespace, so that a peer exists before it is configured.
        for b in batches.values():
            b.commit()
        for ns, idx in plan.bridges.items():
            batches[ns].up(idx)
        for p in plan.namespaces:
            if p.kind == "host":
                batches[p.name].address(1, p.address, 32)
            elif p.address:
                batches[p.name].address(plan.bridges[p.name], p.address, p.prefix)
        for lk in plan.links:
            for e in (lk.a, lk.b):
                master = plan.bridges[e.ns] if e.bridged else None
                batches[e.ns].up(e.index, master)
                if e.addr and not e.bridged:
                    batches[e.ns].address(e.index, e.addr, e.prefix)
        for b in batches.values():
            b.commit()
        for ns, rules in plan.rules.items():
            for src, table, prio in rules:
                batches[ns].rule(src, table, prio)
        for ns, routes in plan.routes.items():
            for dst, gw, oif, prefsrc, table in routes:
                batches[ns].route(dst, gw, oif, prefsrc, table)
        for b in batches.values():
            b.commit()
        # Node names resolve inside the nodes (removed with each namespace, which the state records).
        for p in plan.hosts:
            nss[p.name].write_hosts(plan.node_addr)
        say(f"{len(plan.links)} links, {plan.route_count()} routes")
    finally:
        for b in batches.values():
            b.close()
        for fd in fds.values():
            os.close(fd)


def wait_links_up(plan: NetworkPlan, timeout: float = 5.0) -> float:
    """Wait until every veth end of the plan is operationally up; returns the seconds waited.

    A veth whose carrier came on may still be "down" for up to a second: the kernel's linkwatch
    batches the event unless it is urgent, and it takes a veth's event for urgent only when its
    ifindex differs from its peer's (ours often match: each namespace numbers from 2). Until then
    a switch's bridge port does not forward and a node's first packets (its ARP request) are
    lost: measured, the first connection after ``up`` took 1.02 s, later ones 0.1 ms. The plan
    gives peers different indexes, so this only confirms it.
    """
    t0 = time.monotonic()
    waiting: dict[str, set[int]] = defaultdict(set)
    for lk in plan.links:
        for e in (lk.a, lk.b):
            waiting[e.ns].add(e.index)
    iprs = {}
    try:
        while waiting:
            for ns in list(waiting):
                ipr = iprs.get(ns) or iprs.setdefault(ns, Namespace(ns).iproute())
                up = {m["index"] for m in ipr.get_links() if m.get_attr("IFLA_OPERSTATE") == "UP"}
                waiting[ns] -= up
                if not waiting[ns]:
                    del waiting[ns]
            if not waiting:
                break
            if time.monotonic() - t0 > timeout:
                ns, idx = next(iter(waiting.items()))
                raise OSError(f"links still down after {timeout:.0f} s: {ns} interface(s) {sorted(idx)}")
            time.sleep(0.02)
    finally:
        for ipr in iprs.values():
            ipr.close()
    return time.monotonic() - t0
