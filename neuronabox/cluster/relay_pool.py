"""The agent's delay relays: one process per CPU that homes nodes, splitting each connection by direction.

A node's outgoing TCP connections are accepted by the relay of the node's CPU (``steering.
node_cpu``: node k's rank is pinned there, and its interfaces' receive work is steered
there). That relay copies what the node sends; the way back of each connection is handed,
both sockets duplicated over a Unix socket (SCM_RIGHTS), to the relay of the destination
node, which copies what that node sends. Two directions then move on two cores at once: one
relay for both tops out near 2.4 Gbit/s of all-reduce bus bandwidth here, two at 4.3-5.7
(2-rank gloo, 10 Gbit/s links; a 4 MiB all-reduce 13.8 -> 5.0-7.0 ms). ``NBOX_RELAY_PIN=1``
also pins each relay to its nodes' CPU, so that each node's sending costs its own core (see
``RelayPool``: measured, not the default).

The agent talks to each relay over a SOCK_SEQPACKET pair: JSON messages ``delays`` (one
namespace's table), ``ping`` (answered once everything before it is applied) and ``stats``.
A relay exits when the agent's end closes, and dies with it (PR_SET_PDEATHSIG); its command
line carries the agent's token, so ``nbox down`` finds it even after a crash.

Supervised: ``RelayPool.revive`` (called by the agent every half second) starts a relay that
died again, on the same inbox (the agent keeps its end, so the other relays' outboxes stay
valid) with a new control pair, and sends it every namespace's delay table. The connections
the dead one carried are lost; new ones are relayed as soon as it listens again.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import astuple

from .namespace import Namespace
from .relay import Delays, Peers, Relay
from .steering import node_home

__all__ = ["RelayPool", "main"]

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Worker:
    """The agent's handle on one relay process."""

    def __init__(self, index: int, cpu: int | None, namespaces: list[str]):
        self.index = index
        self.cpu = cpu
        self.namespaces = namespaces
        self.control, self.remote_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Other relays write to ``outbox``; this one reads ``inbox``.
        self.inbox, self.outbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def ask(self, msg: dict, timeout: float = 5.0) -> dict:
        """Send a request and wait for its answer."""
        with self.lock:
            self.control.settimeout(timeout)
            self.control.send(json.dumps(msg).encode())
            return json.loads(self.control.recv(1 << 16))

    def tell(self, msg: dict) -> None:
        """Send a message that has no answer."""
        with self.lock:
            self.control.settimeout(5.0)
            self.control.send(json.dumps(msg).encode())


class RelayPool:
    """The relays of one cluster: which namespaces each serves, their processes, one delay table."""

    def __init__(self, hosts: list[dict], addresses: dict[str, list[str]], port: int, token: str = "",
                 home=node_home):
        groups: dict[int | None, list[str]] = {}
        for h in hosts:
            groups.setdefault(home(h["ns"]), []).append(h["ns"])
        self.workers = [_Worker(i, cpu, nss) for i, (cpu, nss) in enumerate(sorted(groups.items(), key=lambda g: (g[0] is None, g[0] or 0)))]
        by_ns = {ns: w.index for w in self.workers for ns in w.namespaces}
        # A connection's way back goes to the relay of the node that owns the destination address.
        self.homes = {a: by_ns[h["ns"]] for h in hosts for a in addresses.get(h["node"], [])}
        self.port = port
        self.token = token
        # Pinned, each node's sending would cost exactly its own core; measured, that slowed wire
        # mode (its client threads and the relay then share the real rank's core: 100 Mbit/s CNN
        # +13 and +18 % against +0.8 % unpinned) and left model mode's error where it was. So the
        # relays float unless NBOX_RELAY_PIN=1; the work stays split by direction either way.
        self.pin = os.environ.get("NBOX_RELAY_PIN", "0") == "1"
        self.tables: dict[str, dict] = {}  # the last delays message per namespace, for a restarted relay
        self.restarts = 0
        self.starting: set[int] = set()  # restarted, not yet listening
        self.lock = threading.Lock()

    def _spawn(self, w: _Worker) -> None:
        outboxes = {o.index: o.outbox.fileno() for o in self.workers if o is not w}
        cfg = {"index": w.index, "cpu": w.cpu if self.pin else None, "namespaces": w.namespaces, "port": self.port,
               "homes": self.homes, "control": w.remote_control.fileno(), "inbox": w.inbox.fileno(),
               "outboxes": outboxes}
        fds = [w.remote_control.fileno(), w.inbox.fileno(), *outboxes.values()]
        cmd = [sys.executable, "-m", "neuronabox.cluster.relay_pool", "--config", json.dumps(cfg),
               "--parent", str(os.getpid()), "--token", self.token]
        w.proc = subprocess.Popen(cmd, pass_fds=fds)
        w.remote_control.close()  # the agent keeps its inbox end: a restarted relay gets the same one

    def _ready(self, w: _Worker, timeout: float) -> None:
        try:
            w.ask({"op": "ping"}, timeout)
        except (OSError, ValueError) as exc:
            code = w.proc.poll()
            raise RuntimeError(f"delay relay {w.index} (cpu {w.cpu}) did not start"
                               + (f": exited with {code}" if code is not None else f": {exc}")) from None

    def start(self, timeout: float = 10.0) -> None:
        """Start every relay and wait until each listens in all its namespaces."""
        for w in self.workers:
            self._spawn(w)
        for w in self.workers:
            self._ready(w, timeout)

    def dead(self) -> list[int]:
        """Indices of the relays that do not serve: the process ended, or it was restarted and listens not yet."""
        return [w.index for w in self.workers
                if w.index in self.starting or (w.proc is not None and w.proc.poll() is not None)]

    def revive(self, timeout: float = 10.0) -> list[int]:
        """Start again every relay that died, with the current delays; returns their indices."""
        revived = []
        with self.lock:
            for i in [w.index for w in self.workers if w.proc is not None and w.proc.poll() is not None]:
                w = self.workers[i]
                self.starting.add(i)
                with w.lock:  # not while an HTTP thread asks it for stats
                    w.control.close()
                    w.control, w.remote_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                _drop_handovers(w.inbox)
                self._spawn(w)
                self._ready(w, timeout)
                for msg in self.tables.values():
                    w.tell(msg)
                self.starting.discard(i)
                self.restarts += 1
                revived.append(i)
        return revived

    def set_delays(self, key: str, table: dict[str, Delays]) -> None:
        """Replace the delays of namespace ``key`` in every relay (each needs all: it runs ways back)."""
        msg = {"op": "delays", "key": key, "table": {a: astuple(d) for a, d in table.items()}}
        self.tables[key] = msg
        for w in self.workers:
            try:
                w.tell(msg)
            except OSError:  # a dead relay: revive() gives it the table when it starts it again
                pass

    def stats(self) -> dict:
        """Connections, bytes and errors summed over the relays, and each relay's own."""
        each = []
        for w in self.workers:
            mine = {"cpu": w.cpu, "pinned": self.pin, "pid": w.proc.pid}
            try:
                each.append({**mine, **w.ask({"op": "stats"}, 2.0)})
            except (OSError, ValueError):
                each.append({**mine, "alive": False, "connections": 0, "bytes": 0, "errors": 0})
        total = {k: sum(e.get(k, 0) for e in each) for k in ("connections", "bytes", "errors", "refused")}
        return {**total, "restarts": self.restarts, "relays": each}

    def close(self) -> None:
        """End every relay and wait for it."""
        for w in self.workers:
            w.control.close()  # the relay sees its control end close and exits
        for w in self.workers:
            w.outbox.close()
            w.inbox.close()
            if w.proc is not None:
                try:
                    w.proc.wait(5)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()


def _drop_handovers(inbox: socket.socket) -> None:
    """Close the connections handed to a relay that died before it read them: their other half is gone."""
    inbox.setblocking(False)
    try:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(inbox, 4096, 2)
            except (BlockingIOError, OSError):
                return
            for fd in fds:
                os.close(fd)
    finally:
        inbox.setblocking(True)


# ---- the relay process ----------------------------------------------------------------------
async def _serve(cfg: dict) -> None:
    loop = asyncio.get_running_loop()
    outboxes = {int(k): socket.socket(fileno=fd) for k, fd in cfg["outboxes"].items()}

    def hand_over(index: int, fds: list[int], meta: dict) -> None:
        socket.send_fds(outboxes[index], [json.dumps(meta).encode()], fds)

    relay = Relay(loop, port=cfg["port"], peers=Peers(cfg["index"], cfg["homes"], hand_over))
    for ns in cfg["namespaces"]:
        await relay.listen(ns, Namespace(ns))
    inbox = socket.socket(fileno=cfg["inbox"])
    inbox.setblocking(False)
    control = socket.socket(fileno=cfg["control"])
    control.setblocking(False)
    stop = asyncio.Event()

    def on_inbox() -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(inbox, 4096, 2)
            except BlockingIOError:
                return
            meta = json.loads(msg)
            loop.create_task(relay.adopt(fds, meta["key"], meta["dst"]))

    def on_control() -> None:
        while True:
            try:
                raw = control.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                raw = b""
            if not raw:  # the agent is gone
                stop.set()
                loop.remove_reader(control.fileno())
                return
            msg = json.loads(raw)
            if msg["op"] == "delays":
                relay.set_delays(msg["key"], {a: Delays(*v) for a, v in msg["table"].items()})
            elif msg["op"] == "ping":
                control.send(b'{"ok": true}')
            elif msg["op"] == "stats":
                control.send(json.dumps({"connections": relay.connections, "bytes": relay.bytes,
                                         "refused": relay.refused,
                                         "errors": relay.errors + relay.timers.errors}).encode())

    loop.add_reader(inbox.fileno(), on_inbox)
    loop.add_reader(control.fileno(), on_control)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    relay.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of one relay process (started by the agent)."""
    ap = argparse.ArgumentParser(prog="nbox-relay")
    ap.add_argument("--config", required=True)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--token", default="")  # the agent's: `nbox down` finds this process by it
    args = ap.parse_args(argv)
    # Die with the agent, even if it is killed outright: nothing outlives its cluster. (Checked
    # after arming: an agent that died before could not signal.)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if args.parent and os.getppid() != args.parent:
        return 1
    # Each connection holds descriptors: the soft limit (often 1,024) would cap a relay that
    # serves many nodes long before MAX_CONNECTIONS_PER_NODE does.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cfg = json.loads(args.config)
    if cfg["cpu"] is not None:
        os.sched_setaffinity(0, {cfg["cpu"]})
    asyncio.run(_serve(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
