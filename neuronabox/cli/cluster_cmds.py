"""Verbs about the emulation cluster: up, down, status, exec, doctor, shape."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError, NboxError
from . import app, console

NAME = typer.Option(None, "--name", "-n", help="Cluster name (default: the only cluster that exists).")


def _pick(name: Optional[str]) -> str:
    """The cluster a verb acts on: the one named, or the only one there is."""
    from ..cluster.state import list_clusters, valid_name

    if name:
        return valid_name(name)
    names = list_clusters()
    if len(names) == 1:
        return names[0]
    if not names:
        raise InputError("no cluster is up (nbox up TOPOLOGY)")
    raise InputError(f"several clusters are up ({', '.join(names)}): say which with --name")


@app.command("up")
def up_cmd(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    runtime: str = typer.Option("auto", "--runtime", "-r", help="local, netns, docker or auto."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Cluster name (default: the topology's)."),
    subnet: str = typer.Option("10.77.0.0/16", "--subnet", help="Private range for the nodes' addresses."),
    no_shape: bool = typer.Option(False, "--no-shape", help="Do not apply the topology's link parameters."),
    rate_qdisc: str = typer.Option("tbf", "--rate-qdisc", help="tbf or htb."),
) -> None:
    """Bring an emulation cluster up (safe to repeat)."""
    from ..cluster.runtime import up

    res = up(topology, runtime=runtime, name=name, subnet=subnet, shape=not no_shape, rate_kind=rate_qdisc,
             progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    for note in res.notes:
        console.print(note)
    state = "already up" if res.already_up else f"up in {res.seconds:.2f} s"
    console.print(f"cluster [bold]{res.name}[/bold] ({res.runtime}): {len(res.nodes)} nodes, {len(res.links)} links, {state}")
    if res.agent_url:
        console.print(f"shaping agent: {res.agent_url}  (metrics: {res.agent_url}/metrics)")
    if res.nodes:
        # A launcher in each node needs node 0's address (--rdzv-endpoint, MASTER_ADDR).
        shown = ", ".join(f"{h['node']} {h['address']}" for h in res.nodes[:6])
        more = f", … ({len(res.nodes) - 6} more: nbox status --nodes)" if len(res.nodes) > 6 else ""
        console.print(f"node addresses: {shown}{more}", highlight=False)
    _print_mechanisms(res.links)


def _print_nodes(cluster: str, hosts: list[dict]) -> None:
    from rich.table import Table

    t = Table(title=f"nodes of {cluster}", title_justify="left")
    for col in ("node", "index", "address", "namespace", "service"):
        t.add_column(col)
    for h in hosts:
        t.add_row(h["node"], str(h["index"]), h["address"], h.get("ns") or "-", h.get("service") or "-")
    console.print(t)


def _print_mechanisms(links: list[dict]) -> None:
    from rich.table import Table

    from ..units import format_bandwidth, format_duration

    if not links:
        return
    t = Table(title="links", title_justify="left")
    for col in ("link", "rate", "delay", "loss", "rate by", "delay by", "loss by"):
        t.add_column(col)
    for lk in links[:40]:
        # A netns link shows its a->b direction; a docker node's link (its eth0 egress) has one shape.
        ab, m = lk.get("ab") or lk["shape"], lk["mechanisms"]
        t.add_row(lk["name"], format_bandwidth(ab["rate"]) if ab["rate"] else "-", format_duration(ab["delay"]) if ab["delay"] else "-",
                  f"{ab['loss']:.3%}" if ab["loss"] else "-", m["rate"], m["delay"], m["loss"])
    console.print(t)
    if len(links) > 40:
        console.print(f"… and {len(links) - 40} more (nbox status --links)")


@app.command("down")
def down_cmd(name: Optional[str] = typer.Argument(None, help="Cluster name (default: the only one)."),
             all_: bool = typer.Option(False, "--all", help="Remove every cluster.")) -> None:
    """Remove a cluster and everything it made (also after a crash of `up`)."""
    from ..cluster.runtime import down
    from ..cluster.state import list_clusters

    for n in (list_clusters() if all_ else [_pick(name)]):
        r = down(n, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
        if "containers" in r:  # the docker runtime's objects
            console.print(f"cluster {n}: removed {r['containers']} containers, {r['networks']} networks, "
                          f"{r['namespaces']} namespaces, ended {r['processes']} processes")
        else:
            console.print(f"cluster {n}: removed {r['namespaces']} namespaces, ended {r['processes']} processes")


@app.command("status")
def status_cmd(name: Optional[str] = NAME, as_json: bool = typer.Option(False, "--json", help="Print JSON."),
               links: bool = typer.Option(False, "--links", help="Also list the links and their mechanisms."),
               nodes: bool = typer.Option(False, "--nodes", help="Also list the nodes: address, namespace or service.")) -> None:
    """Show the clusters that are up."""
    from rich.table import Table

    from ..cluster.netns_cluster import up_result
    from ..cluster.runtime import status
    from ..cluster.state import ClusterState

    rows = status(name)
    if nodes:
        for r in rows:
            r["hosts"] = (ClusterState.load(r["name"]).get("plan") or {}).get("hosts", [])
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        console.print("no cluster is up")
        return
    t = Table(title="clusters", title_justify="left")
    cols = ("name", "runtime", "phase", "nodes", "links", "namespaces", "agent", "healthy")
    for col in cols:
        t.add_column(col)
    for r in rows:
        t.add_row(*("-" if r[c] is None else str(r[c]) for c in cols))  # a local cluster has no agent
    console.print(t)
    for r in rows:
        if r.get("problem"):
            console.print(f"[red]cluster {r['name']}: {r['problem']}[/red]", highlight=False)
    if nodes:
        for r in rows:
            _print_nodes(r["name"], r["hosts"])
    if links:
        for r in rows:
            _print_mechanisms(up_result(ClusterState.load(r["name"])).links)


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_cmd(
    node: str = typer.Argument(..., help="Node name (node3) or index."),
    cmd: List[str] = typer.Argument(..., help="The command, after --."),
    name: Optional[str] = NAME,
) -> None:
    """Run a command inside a node of the cluster: nbox exec NODE -- CMD ..."""
    from ..cluster.runtime import exec_in

    r = exec_in(_pick(name), node, list(cmd))
    raise typer.Exit(r.returncode)


@app.command("doctor")
def doctor_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """What this host can do for `nbox up`: privileges, namespaces, qdiscs, iptables, Docker, GPU."""
    from rich.table import Table

    from ..cluster.runtime import doctor

    rows = doctor()
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    t = Table(title="nbox doctor", title_justify="left")
    for col in ("check", "", "detail"):
        t.add_column(col)
    marks = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "[yellow]?[/yellow]"}
    for r in rows:
        t.add_row(r["check"], marks[r["ok"]], r["detail"])
    console.print(t)


@app.command("shape")
def shape_cmd(
    link: str = typer.Argument(..., help="Link name (node0:0--switch, see nbox status --links) or l<id>."),
    rate: Optional[str] = typer.Option(None, "--rate", help="e.g. 10Gbps, 100Mbit/s; 0 removes the limit."),
    delay: Optional[str] = typer.Option(None, "--delay", help="One-way delay, e.g. 2ms."),
    jitter: Optional[str] = typer.Option(None, "--jitter", help="e.g. 100us."),
    loss: Optional[str] = typer.Option(None, "--loss", help="e.g. 0.1%."),
    direction: str = typer.Option("both", "--direction", help="both, ab or ba."),
    name: Optional[str] = NAME,
) -> None:
    """Change a link of a running cluster (through its shaping agent)."""
    from ..cluster.agent import parse_shape_changes
    from ..cluster.state import ClusterState

    body = {k: v for k, v in (("rate", rate), ("delay", delay), ("jitter", jitter), ("loss", loss)) if v is not None}
    if not body:
        raise InputError("shape: give at least one of --rate, --delay, --jitter, --loss")
    try:
        parse_shape_changes({**body, "direction": direction})  # the agent's own checks, with a local one-line error
    except InputError as exc:
        raise InputError(f"shape {link}: {exc}") from None
    body["direction"] = direction
    st = ClusterState.load(_pick(name))
    url = (st.get("agent") or {}).get("url")
    if not url:
        raise InputError(f"cluster {st.name!r} has no shaping agent (runtime {st.get('runtime')})")
    req = urllib.request.Request(f"{url}/links/{urllib.request.quote(link, safe='')}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            view = json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            detail = str(json.loads(exc.read() or b"{}").get("error", exc.reason))
        except (ValueError, AttributeError):
            detail = str(exc.reason)
        if exc.code == 404:  # the agent speaks to HTTP clients; here the CLI's listing helps
            detail = detail.replace("(GET /links lists them)", "(nbox status --links lists them)")
        if exc.code >= 500:  # the kernel refused a valid change: not the user's input (exit 1)
            raise NboxError(f"shape {link}: {detail}") from None
        raise InputError(f"shape {link}: {detail}") from None
    except urllib.error.URLError as exc:
        raise InputError(f"shape: the shaping agent at {url} does not answer ({exc.reason})") from None
    _print_mechanisms([view])
