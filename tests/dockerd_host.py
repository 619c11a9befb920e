"""What a dockerd changes in the host's network, recorded before the tests start one and put back after it stops.

dockerd (20.10, Debian's) sets FORWARD's policy to DROP, adds its DOCKER* chains and the rules that
jump to them (filter and nat), makes the bridge docker0 (br-<id> for each network of its own), turns
on net.ipv4.ip_forward and the bridge's netfilter calls, and leaves all of it behind when it stops.
``restore`` takes back only what was not there before and is dockerd's (its chains, rules that name
them or its bridges, its bridges themselves), so rules and links made meanwhile by others stay.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

TABLES = ("filter", "nat")
SYSCTLS = ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables")
# docker0 and a user-defined network's bridge (br- and the network id's first 12 hex digits).
_BRIDGE = re.compile(r"^(docker0|br-[0-9a-f]{12})$")
_DOCKERS = re.compile(r"DOCKER|docker0|br-[0-9a-f]{12}")


@dataclass
class HostNet:
    """The host's network as dockerd finds it: links, iptables (``-S`` lines per table), sysctls."""

    links: set[str] = field(default_factory=set)
    rules: dict[str, list[str]] = field(default_factory=dict)
    sysctls: dict[str, str | None] = field(default_factory=dict)


def _iptables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True)


def snapshot() -> HostNet:
    """The host's links, its iptables rules of the tables dockerd writes, and the sysctls it sets."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    rules = {t: _iptables("-t", t, "-S").stdout.splitlines() for t in TABLES}
    sysctls = {}
    for name in SYSCTLS:
        p = Path("/proc/sys") / name
        sysctls[name] = p.read_text().strip() if p.exists() else None
    return HostNet({ln.split(":")[1].strip().split("@")[0] for ln in links}, rules, sysctls)


def differences(before: HostNet, after: HostNet) -> list[str]:
    """What of dockerd's kind differs between two snapshots (empty: the host is as it was)."""
    out = [f"link {n} {'added' if n in after.links else 'removed'}"
           for n in sorted(before.links ^ after.links) if _BRIDGE.match(n)]
    for t in TABLES:
        b, a = before.rules.get(t, []), after.rules.get(t, [])
        out += [f"{t}: {ln!r} added" for ln in a if ln not in b and (_DOCKERS.search(ln) or ln.startswith("-P"))]
        out += [f"{t}: {ln!r} removed" for ln in b if ln not in a and (_DOCKERS.search(ln) or ln.startswith("-P"))]
    out += [f"{k} {before.sysctls.get(k)} -> {v}" for k, v in after.sysctls.items()
            if before.sysctls.get(k) is not None and v != before.sysctls.get(k)]
    return out


def restore(before: HostNet) -> list[str]:
    """Take back what a dockerd added since ``before`` (its bridges, chains, rules, policy, sysctls); what was undone."""
    now = snapshot()
    done: list[str] = []
    for name in sorted(now.links - before.links):
        if _BRIDGE.match(name):
            subprocess.run(["ip", "link", "delete", name], capture_output=True)
            done.append(f"deleted link {name}")
    for t in TABLES:
        had = set(before.rules.get(t, []))
        lines = now.rules.get(t, [])
        # Rules first (those that jump to a chain go before the chain), then the chains, then the policies.
        for ln in reversed([ln for ln in lines if ln.startswith("-A ") and ln not in had and _DOCKERS.search(ln)]):
            if _iptables("-t", t, "-D", *shlex.split(ln)[1:]).returncode == 0:
                done.append(f"{t}: removed {ln}")
        for ln in lines:
            if ln.startswith("-N ") and ln not in had and _DOCKERS.search(ln):
                chain = ln.split()[1]
                _iptables("-t", t, "-F", chain)
                if _iptables("-t", t, "-X", chain).returncode == 0:
                    done.append(f"{t}: removed chain {chain}")
        for ln in before.rules.get(t, []):
            if ln.startswith("-P ") and ln not in lines:
                _, chain, policy = ln.split()
                _iptables("-t", t, "-P", chain, policy)
                done.append(f"{t}: policy of {chain} back to {policy}")
    for name, value in before.sysctls.items():
        p = Path("/proc/sys") / name
        if value is not None and p.exists() and p.read_text().strip() != value:
            p.write_text(value)
            done.append(f"{name} back to {value}")
    return done
