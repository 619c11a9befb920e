"""Stub peers: light processes that stand in for the emulated neighbours of a real rank (wire mode).

One process per node (``python -m neuronabox.cluster.stub``), inside that node's namespace,
started by ``nbox up`` for the ring neighbours of the topology's real ranks, or on demand by
a real rank that needs another node (a sub-group's neighbours). Each is recorded in the
state file before it starts, so ``nbox down`` ends it. A stub imports neither torch nor any
model: the real rank tells it, per collective, which bytes to send and when (the protocol is
described in ``neuronabox.wireproto``). It serves any number of real-rank sessions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from ..errors import InputError, RunFailed
from ..wireproto import FRAME, HELLO, KIND_FROM_STUB, KIND_TO_STUB, MAGIC, STUB_PORT, recv_exact, recv_msg, send_msg
from .state import ClusterState

__all__ = ["neighbour_nodes", "start_stubs", "ensure_stub", "stub_locator", "stub_files", "main"]


def stub_files(st: ClusterState, node: str) -> tuple[Path, Path]:
    """The control socket and the info file of the stub of ``node``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node)
    return st.dir / f"stub-{safe}.sock", st.dir / f"stub-{safe}.json"


def neighbour_nodes(topo, real_ranks=None) -> list[str]:
    """Nodes of the previous and next rank of every real rank (default: the topology's) in the world ring."""
    # A node's ranks are consecutive and nodes come in rank order: the ring (alpha-beta's, by
    # node then rank) is rank order itself, so a rank's neighbours are r - 1 and r + 1.
    n = topo.world_size
    out: list[str] = []
    if n < 2:
        return out
    for r in topo.emulation.real_ranks if real_ranks is None else real_ranks:
        if not 0 <= r < n:
            continue
        for nb in ((r - 1) % n, (r + 1) % n):
            name = topo.node_of(nb).name
            if name not in out:
                out.append(name)
    return out


def _info(st: ClusterState, node: str) -> dict | None:
    try:
        return json.loads(stub_files(st, node)[1].read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _stub_preexec(ns: str | None, index: int | None):
    """Enter the node's namespace and, in one, its CPU: the stub stands in for the rank pinned there (steering.node_cpu)."""
    from .namespace import Namespace
    from .steering import node_cpu

    if not ns:
        return None
    enter, cpu = Namespace(ns).preexec(), node_cpu(index or 0)

    def pre() -> None:
        enter()
        os.sched_setaffinity(0, {cpu})

    return pre


def start_stubs(st: ClusterState, nodes: list[str], timeout: float = 10.0) -> dict[str, dict]:
    """Start the stubs of ``nodes`` (recorded in the state first); returns node -> {pid, port, control}."""
    import psutil

    hosts = {h["node"]: h for h in (st.get("plan") or {}).get("hosts", [])}
    procs: dict[str, subprocess.Popen] = {}
    tokens: dict[str, str] = {}
    for node in nodes:
        if node not in hosts:
            raise ValueError(f"cluster {st.name!r} has no node {node!r}")
        tokens[node] = f"nbox-stub-{st.name}-{uuid.uuid4().hex[:12]}"
    # In a namespace the stub port is free; on loopback (`local` runtime) clusters share the
    # addresses, so the kernel picks the port and the info file tells it.
    cmds = {node: [sys.executable, "-m", "neuronabox.cluster.stub", "--name", st.name, "--node", node,
                   "--address", hosts[node]["address"], "--port", str(STUB_PORT if hosts[node].get("ns") else 0),
                   "--token", tokens[node]] for node in nodes}
    st.record("processes", [{"role": "stub", "node": node, "token": tokens[node], "cmd": cmds[node]} for node in nodes])
    # A real rank may start a stub: leave its nbox settings behind, or the stub's interpreter would
    # run nbox run's sitecustomize and import torch.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
    env["NBOX_STATE_DIR"] = str(st.dir.parent)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p and not p.rstrip("/").endswith("launcher/autostart"))
    for node in nodes:
        ctl, info = stub_files(st, node)
        for p in (ctl, info):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        ns = hosts[node].get("ns")
        log = open(st.dir / f"stub-{node}.log", "ab")
        procs[node] = subprocess.Popen(cmds[node], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True, env=env,
                                       preexec_fn=_stub_preexec(ns, hosts[node].get("index")))
        log.close()
    for node, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            st.update_process(tokens[node], pid=proc.pid, create_time=psutil.Process(proc.pid).create_time())
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    for node, proc in procs.items():
        while True:
            info = _info(st, node)
            if info and info.get("pid") == proc.pid:
                out[node] = info
                break
            if proc.poll() is not None:
                lines = (st.dir / f"stub-{node}.log").read_text(errors="replace").strip().splitlines()
                tail = lines[-1:] or ["(no output)"]
                raise RunFailed(f"the stub of {node} exited with {proc.returncode}: {tail[0]}")
            if time.monotonic() > deadline:
                raise RunFailed(f"the stub of {node} did not start within {timeout:.0f} s")
            time.sleep(0.01)
    return out


def ensure_stub(cluster: str, node: str) -> dict:
    """The running stub of ``node`` in ``cluster`` ({pid, port, control}), started if it is not."""
    from .netns_cluster import process_alive

    st = ClusterState(cluster)
    with st.locked():
        if not st.path.exists():
            raise InputError(f"nbox wire: no cluster named {cluster!r}")
        info = _info(st, node)
        if info:
            rec = next((p for p in st["processes"]
                        if p.get("role") == "stub" and p.get("node") == node and p.get("pid") == info.get("pid")), None)
            if rec is not None and process_alive(rec):
                return info
        return start_stubs(st, [node])[node]


def stub_locator(cluster: str):
    """For a real rank in wire mode: node -> its stub's {pid, port, control, address}, started if it is not.

    The plan's hosts are read now (InputError when ``cluster`` has no state), the stubs on first use.
    """
    st = ClusterState.load(cluster)
    hosts = {h["node"]: h for h in (st.get("plan") or {}).get("hosts", [])}

    def locate(node: str) -> dict:
        info = ensure_stub(cluster, node)
        return {**info, "address": hosts[node]["address"]}

    return locate


def revive_stubs(cluster: str) -> list[str]:
    """Start again the stubs of ``cluster`` that died (the agent's supervisor); the nodes restarted.

    Nothing while ``up`` or ``down`` holds the cluster's lock: ``up`` is still starting them, and
    ``down`` is ending them on purpose.
    """
    from .netns_cluster import process_alive

    st = ClusterState(cluster)
    try:
        with st.locked(blocking=False):
            if not st.path.exists() or st.get("phase") != "up":
                return []
            latest = {p.get("node"): p for p in st["processes"] if p.get("role") == "stub"}
            dead = sorted(n for n, p in latest.items() if not process_alive(p))
            if dead:
                start_stubs(st, dead)
            return dead
    except BlockingIOError:
        return []


# ---- the stub process ----------------------------------------------------------------------
class _Session:
    """One real rank's state at this stub: arena, data connections, the frames it still has to send."""

    def __init__(self, sid: int):
        self.sid = sid
        self.cond = threading.Condition()
        self.arena: mmap.mmap | None = None
        self.jobs: collections.deque = collections.deque()
        self.received = (0, -1)  # the last (seq, step) read from the real rank
        self.out: socket.socket | None = None
        self.closed = False
        self.sent = 0
        self.recv_bytes = 0


class Stub:
    """The server: control on a Unix socket, data on TCP at the node's address."""

    def __init__(self, address: str, port: int, control: Path):
        self.sessions: dict[int, _Session] = {}
        self.lock = threading.Lock()
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((address, port))
        self.tcp.listen(64)
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
        self.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl.bind(str(control))
        self.ctl.listen(64)
        self.control = control

    def serve(self) -> None:
        """Accept connections on both planes (returns when the sockets close)."""
        threading.Thread(target=self._accept, args=(self.ctl, self._control), daemon=True, name="stub-ctl").start()
        self._accept(self.tcp, self._data)

    def _accept(self, srv: socket.socket, handler) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._guard, args=(handler, conn), daemon=True).start()

    def _guard(self, handler, conn: socket.socket) -> None:
        try:
            handler(conn)
        except (OSError, ConnectionError, ValueError) as exc:
            print(f"nbox stub: {handler.__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            conn.close()

    def _control(self, conn: socket.socket) -> None:
        s: _Session | None = None
        try:
            while True:
                msg, fds = recv_msg(conn)
                if msg is None or msg.get("t") == "bye":
                    return
                t = msg.get("t")
                if t == "hello":
                    s = _Session(int(msg["session"]))
                    with self.lock:
                        self.sessions[s.sid] = s
                    send_msg(conn, {"t": "ok", "pid": os.getpid(), "clock": time.perf_counter()})
                elif t == "arena" and s is not None:
                    with s.cond:
                        # Earlier frames may still read the old mapping; it is closed when unreferenced.
                        s.arena = mmap.mmap(fds[0], int(msg["size"]), prot=mmap.PROT_READ)
                    for fd in fds:
                        os.close(fd)
                elif t == "op" and s is not None:
                    with s.cond:
                        seq = int(msg["seq"])
                        s.jobs.extend((float(x[0]), seq, int(x[1]), int(x[2]), int(x[3]), int(x[4]))
                                      for x in msg["sends"])
                        s.cond.notify_all()
                else:
                    for fd in fds:
                        os.close(fd)
        finally:
            if s is not None:
                with s.cond:
                    s.closed = True
                    s.cond.notify_all()
                with self.lock:
                    self.sessions.pop(s.sid, None)

    def _data(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = recv_exact(conn, HELLO.size)
        if head is None:
            return
        magic, sid, kind = HELLO.unpack(head)
        if magic != MAGIC:
            raise ValueError("not an nbox wire connection")
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            raise ValueError(f"unknown session {sid}")
        if kind == KIND_TO_STUB:
            self._read(s, conn)
        elif kind == KIND_FROM_STUB:
            self._send(s, conn)

    def _read(self, s: _Session, conn: socket.socket) -> None:
        # The real rank's frames: the next rank would reduce or store them; a stub counts and drops them.
        scratch = memoryview(bytearray(1 << 20))
        while True:
            head = recv_exact(conn, FRAME.size)
            if head is None:
                return
            seq, step, n = FRAME.unpack(head)
            left = n
            while left:
                k = conn.recv_into(scratch[: min(left, len(scratch))])
                if not k:
                    raise ConnectionError("closed inside a frame")
                left -= k
            with s.cond:
                s.received = (seq, step)
                s.recv_bytes += n
                s.cond.notify_all()

    def _send(self, s: _Session, conn: socket.socket) -> None:
        while True:
            with s.cond:
                while not s.jobs and not s.closed:
                    s.cond.wait()
                if s.closed:
                    return
                t, seq, step, off, length, dep = s.jobs.popleft()
                while dep >= 0 and s.received < (seq, dep) and not s.closed:
                    s.cond.wait()
                arena = s.arena
            delay = t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            conn.sendall(FRAME.pack(seq, step, length))
            if length:
                conn.sendall(memoryview(arena)[off : off + length])
            s.sent += length


def main(argv: list[str] | None = None) -> int:
    """Entry point of a stub process."""
    ap = argparse.ArgumentParser(prog="nbox-stub")
    ap.add_argument("--name", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--port", type=int, default=STUB_PORT)
    ap.add_argument("--token", default="")  # only there so that `down` can find this process by its command line
    args = ap.parse_args(argv)
    with contextlib.suppress(OSError):
        # Sleeps end within a few microseconds of the send time instead of the default 50 us slack.
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)
    st = ClusterState(args.name)
    control, info = stub_files(st, args.node)
    stub = Stub(args.address, args.port, control)

    def stop(*_):
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    tmp = info.with_name(f"{info.stem}.{os.getpid()}.tmp.json")  # *.json: `down` removes it even if left
    tmp.write_text(json.dumps({"pid": os.getpid(), "port": stub.tcp.getsockname()[1], "control": str(control),
                               "node": args.node, "address": args.address}))
    os.replace(tmp, info)
    stub.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
