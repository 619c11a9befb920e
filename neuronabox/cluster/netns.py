"""The netns runtime's network: namespaces, veth pairs, bridges, addresses and routes.

One small class per kernel concept, after Mininet's node.py/link.py: ``Namespace`` (a named
network namespace), ``RtBatch`` (a netlink socket inside one namespace that sends many
requests at once), and ``NetworkPlan`` (what the topology becomes: namespaces, links,
bridges, addresses, routes), built by ``build_network``.

Design (how every node reaches every other along the topology's route):

- A node is a namespace; its *node address* (``10.77.0.1`` for node 0 by default) sits on
  ``lo`` as a /32, so it does not depend on which NIC a route uses.
- A switch is a namespace with a bridge ``br0``. Its ports towards NICs are bridge ports
  (one L2 segment per switch, like a ToR's VLAN), and ``br0`` has an address (its SVI).
  Switch-to-switch links and NIC-to-NIC links (rings, explicit links) are routed /30s.
  Single-switch clusters are therefore pure L2; fat-trees and rail fabrics route between
  switches, the way data-centre leaf/spine fabrics do.
- For every ordered pair of nodes (A, B) the topology's route between their first ranks
  (``ClusterGraph.route_vertices``, ECMP hash included) is walked and each L3 hop gets a
  ``B/32 via <next hop>`` entry. Where one namespace forwards traffic for the same
  destination to different next hops depending on the source (ECMP by pair), the majority
  goes in the main table and the others in a per-source table chosen by a ``from A``
  rule. Sources put their node address as ``src`` so those rules see it.

Speed: pyroute2's request path costs about 300 µs a message here, and a 64-node fat-tree
needs some 20 000 routes, so the bulk (links, addresses, routes, rules) is packed with
``struct`` and sent as one netlink batch per namespace; pyroute2 is used where messages are
few and rich (tc qdiscs, statistics). Nothing runs ``ip`` or ``tc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
import struct
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import InputError

__all__ = [
    "Namespace",
    "RtBatch",
    "NetworkPlan",
    "PlannedLink",
    "End",
    "plan_network",
    "build_network",
    "wait_links_up",
    "netns_dir",
    "list_namespaces",
    "ns_pids",
    "DEFAULT_SUBNET",
    "MAX_CLUSTER_NODES",
    "check_cluster_size",
]

DEFAULT_SUBNET = "10.77.0.0/16"
# A namespace per node and, in each, a route to every other node: the plan grows as nodes
# squared (1,024 nodes: 43 s and 0.95 GB to plan on the 2-core dev machine; 10,000 did not end).
MAX_CLUSTER_NODES = 1024
NETNS_DIR = "/run/netns"
# iproute2's convention: `ip netns exec NS` binds the files of /etc/netns/NS over /etc; so do we.
ETC_NETNS = "/etc/netns"
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_SHARED, MS_SLAVE = 4096, 16384, 1 << 20, 1 << 19
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_ns_lock = threading.RLock()


def netns_dir() -> str:
    """Where named namespaces are bound (iproute2's convention, so `ip netns` sees them)."""
    return NETNS_DIR


def list_namespaces() -> list[str]:
    """Names of every named network namespace on this host."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prepare_rundir() -> None:
    os.makedirs(NETNS_DIR, exist_ok=True)
    # As iproute2 does: the directory must be a shared mount point, or bind mounts made in
    # another mount namespace would not be seen by `ip netns` and friends.
    if _libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None) != 0:
        _check(_libc.mount(NETNS_DIR.encode(), NETNS_DIR.encode(), b"none", MS_BIND | MS_REC, None), "bind /run/netns")
        _check(_libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None), "share /run/netns")


class Namespace:
    """A named network namespace (``/run/netns/<name>``)."""

    _root_fd: int | None = None

    def __init__(self, name: str):
        self.name = name
        self.path = f"{NETNS_DIR}/{name}"

    @classmethod
    def root_fd(cls) -> int:
        """An fd of the namespace this process started in (to come back to)."""
        if cls._root_fd is None:
            cls._root_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return cls._root_fd

    def exists(self) -> bool:
        """Whether the namespace is bound."""
        return os.path.exists(self.path)

    def create(self) -> None:
        """Create the namespace and bind it to its path (no fork: unshare in this thread, then return)."""
        root = self.root_fd()
        with _ns_lock:
            _prepare_rundir()
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
            os.close(fd)
            try:
                # unshare(CLONE_NEWNET) moves only the calling thread, which is what lets
                # one process build hundreds of namespaces without forking.
                _check(_libc.unshare(CLONE_NEWNET), f"unshare for {self.name}")
                try:
                    tid = threading.get_native_id()
                    src = f"/proc/self/task/{tid}/ns/net".encode()
                    _check(_libc.mount(src, self.path.encode(), b"none", MS_BIND, None), f"bind {self.path}")
                finally:
                    _check(_libc.setns(root, CLONE_NEWNET), "setns back to the root namespace")
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                raise

    def adopt(self, pid: int) -> None:
        """Bind the network namespace of process ``pid`` (a container's) to this name, as `ip netns attach` does.

        The docker runtime's containers start with no network (Containernet's way); adopted, their
        namespaces take the same plan, veths, qdiscs and relays as namespaces this module creates,
        and ``delete`` unbinds them (the namespace then lives as long as the container does).
        """
        with _ns_lock:
            _prepare_rundir()
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
            os.close(fd)
            try:
                _check(_libc.mount(f"/proc/{pid}/ns/net".encode(), self.path.encode(), b"none", MS_BIND, None),
                       f"bind the namespace of pid {pid} to {self.path}")
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                raise

    @property
    def hosts_file(self) -> str:
        """The namespace's own /etc/hosts (``write_hosts``), bound over /etc/hosts for processes started in it."""
        return f"{ETC_NETNS}/{self.name}/hosts"

    def write_hosts(self, entries: dict[str, str]) -> None:
        """Write the namespace's hosts file: this host's /etc/hosts, then ``entries`` (name -> address)."""
        try:
            with open("/etc/hosts", encoding="utf-8") as f:
                base = f.read()
        except OSError:
            base = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
        lines = [base.rstrip("\n"), f"# nbox: the nodes of the cluster, for processes in {self.name}"]
        lines += [f"{addr}\t{name}" for name, addr in entries.items()]
        os.makedirs(os.path.dirname(self.hosts_file), exist_ok=True)
        with open(self.hosts_file, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def delete(self) -> bool:
        """Unbind and remove the namespace (and its hosts file); False when it did not exist."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.hosts_file)
        with contextlib.suppress(OSError):  # only when empty: a file someone else put there stays
            os.rmdir(os.path.dirname(self.hosts_file))
        if not os.path.exists(self.path):
            return False
        _libc.umount2(self.path.encode(), MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body with this thread inside the namespace (sockets made there stay there)."""
        root = self.root_fd()
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        with _ns_lock:
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), f"setns {self.name}")
                yield
            finally:
                os.close(fd)
                _check(_libc.setns(root, CLONE_NEWNET), "setns back to the root namespace")

    def socket(self, *args) -> socket.socket:
        """A socket that lives in this namespace."""
        with self.entered():
            return socket.socket(*args)

    def sysctl(self, values: dict[str, str]) -> None:
        """Set net sysctls inside the namespace (/proc/sys/net follows the thread's namespace)."""
        with self.entered():
            for key, value in values.items():
                with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                    f.write(value)

    def iproute(self):
        """A pyroute2 IPRoute whose socket lives in this namespace; use it only on the calling thread.

        pyroute2 opens a further socket for every other thread that uses the object, in that
        thread's namespace, so a hand-over would silently act on the wrong namespace.
        """
        from pyroute2 import IPRoute

        with self.entered():
            return IPRoute()

    def inode(self) -> int | None:
        """The namespace's inode (to find the processes inside it)."""
        try:
            return os.stat(self.path).st_ino
        except FileNotFoundError:
            return None

    def preexec(self):
        """A preexec_fn that moves a child process into the namespace."""
        path, hosts = self.path, self.hosts_file.encode()

        def enter() -> None:
            fd = os.open(path, os.O_RDONLY)
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                os._exit(127)
            os.close(fd)
            # As `ip netns exec`: a mount namespace of its own, in which the cluster's hosts file is
            # /etc/hosts, so node names resolve. Without it (no file, no CAP_SYS_ADMIN) the command
            # still runs, with addresses only: better than not running at all.
            if os.path.exists(hosts) and _libc.unshare(CLONE_NEWNS) == 0:
                _libc.mount(b"none", b"/", None, MS_SLAVE | MS_REC, None)  # our binds do not leak out
                _libc.mount(hosts, b"/etc/hosts", b"none", MS_BIND, None)

        return enter


def ns_pids(names: list[str]) -> dict[int, str]:
    """Processes whose network namespace is one of ``names`` (pid -> namespace name)."""
    inodes = {}
    for n in names:
        ino = Namespace(n).inode()
        if ino is not None:
            inodes[ino] = n
    found: dict[int, str] = {}
    if not inodes:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry}/ns/net").st_ino
        except OSError:
            continue
        if ino in inodes:
            found[int(entry)] = inodes[ino]
    return found


# ---- raw rtnetlink, batched ------------------------------------------------------------------
RTM_NEWLINK, RTM_NEWADDR, RTM_NEWROUTE, RTM_NEWRULE = 16, 20, 24, 32
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 1, 4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_MTU, IFLA_MASTER, IFLA_TXQLEN, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 4, 10, 13, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC, RTA_TABLE = 1, 4, 5, 7, 15
FRA_SRC, FRA_PRIORITY, FRA_TABLE = 2, 6, 15
IFF_UP = 1
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _ip(addr: str) -> bytes:
    return socket.inet_aton(addr)


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


class RtBatch:
    """Queue rtnetlink requests for one namespace and send them together, checking every ack."""

    CHUNK = 256

    def __init__(self, ns: Namespace):
        self.ns = ns
        self.sock = ns.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self._msgs: list[tuple[int, bytes, str]] = []
        self._seq = 0

    def close(self) -> None:
        """Close the netlink socket."""
        self.sock.close()

    def _add(self, mtype: int, flags: int, body: bytes, what: str) -> None:
        self._seq += 1
        hdr = struct.pack("=IHHII", 16 + len(body), mtype, flags | NLM_F_REQUEST | NLM_F_ACK, self._seq, 0)
        self._msgs.append((self._seq, hdr + body, what))

    # Requests ----------------------------------------------------------------------------
    def veth(self, name: str, index: int, peer: str, peer_index: int, peer_ns_fd: int, txqlen: int = 1000) -> None:
        """Create a veth pair: ``name`` here, ``peer`` in the namespace of ``peer_ns_fd``; fixed ifindexes."""
        peer_msg = _ifinfo(peer_index) + _attr(IFLA_IFNAME, peer.encode() + b"\0") + _attr(
            IFLA_NET_NS_FD, struct.pack("=I", peer_ns_fd)
        ) + _attr(IFLA_TXQLEN, struct.pack("=I", txqlen))
        info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer_msg))
        body = _ifinfo(index) + _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(
            IFLA_TXQLEN, struct.pack("=I", txqlen)
        ) + _attr(IFLA_LINKINFO, info)
        self._add(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"veth {name}<->{peer}")

    def bridge(self, name: str, index: int) -> None:
        """Create a bridge (STP off, the kernel's default, so ports forward at once)."""
        body = _ifinfo(index) + _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(
            IFLA_LINKINFO, _attr(IFLA_INFO_KIND, b"bridge\0")
        )
        self._add(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"bridge {name}")

    def up(self, index: int, master: int | None = None) -> None:
        """Set a link up (and enslave it to ``master``)."""
        body = _ifinfo(index, IFF_UP, IFF_UP)
        if master is not None:
            body += _attr(IFLA_MASTER, struct.pack("=I", master))
        self._add(RTM_NEWLINK, 0, body, f"link {index} up")

    def address(self, index: int, addr: str, prefix: int) -> None:
        """Add an IPv4 address to a link."""
        body = struct.pack("=BBBBI", socket.AF_INET, prefix, 0, 0, index) + _attr(IFA_LOCAL, _ip(addr)) + _attr(
            IFA_ADDRESS, _ip(addr)
        )
        self._add(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body, f"address {addr}/{prefix}")

    def route(self, dst: str, gateway: str, oif: int, prefsrc: str | None = None, table: int = RT_TABLE_MAIN) -> None:
        """Add ``dst/32 via gateway dev oif [src prefsrc] [table]``."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, table if table < 256 else 252, RTPROT_STATIC, 0, 1, 0)
        body += _attr(RTA_DST, _ip(dst)) + _attr(RTA_GATEWAY, _ip(gateway)) + _attr(RTA_OIF, struct.pack("=i", oif))
        if prefsrc:
            body += _attr(RTA_PREFSRC, _ip(prefsrc))
        if table >= 256:
            body += _attr(RTA_TABLE, struct.pack("=I", table))
        self._add(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body, f"route {dst} via {gateway} table {table}")

    def rule(self, src: str, table: int, priority: int) -> None:
        """Add ``from src/32 lookup table`` at ``priority``."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 32, 0, table if table < 256 else 252, 0, 0, 1, 0)
        body += _attr(FRA_SRC, _ip(src)) + _attr(FRA_PRIORITY, struct.pack("=I", priority))
        body += _attr(FRA_TABLE, struct.pack("=I", table))
        self._add(RTM_NEWRULE, NLM_F_CREATE | NLM_F_EXCL, body, f"rule from {src} lookup {table}")

    # Sending -------------------------------------------------------------------------------
    def commit(self) -> int:
        """Send every queued request (in chunks), raise OSError on the first failure; returns the count."""
        msgs, self._msgs = self._msgs, []
        for start in range(0, len(msgs), self.CHUNK):
            chunk = msgs[start : start + self.CHUNK]
            self.sock.send(b"".join(m[1] for m in chunk))
            pending = {m[0]: m[2] for m in chunk}
            while pending:
                data = self.sock.recv(1 << 20)
                off = 0
                while off + 16 <= len(data):
                    length, mtype, _flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
                    if mtype == NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, off + 16)
                        what = pending.pop(seq, None)
                        if code != 0 and what is not None:
                            raise OSError(-code, f"netlink {what} in {self.ns.name}: {os.strerror(-code)}")
                    off += (length + 3) & ~3
        return len(msgs)


# ---- the plan --------------------------------------------------------------------------------
@dataclass
class End:
    """One end of a link: an interface in a namespace."""

    ns: str
    ifname: str
    index: int
    vertex: str
    addr: str | None = None
    prefix: int = 32
    bridged: bool = False  # a bridge port: no address, switched rather than routed


@dataclass
class PlannedLink:
    """A physical network link of the topology, realised as one veth pair."""

    id: int
    name: str
    a: End
    b: End
    rate: float  # bytes/s, each direction
    delay_ab: float
    delay_ba: float
    jitter: float
    loss: float

    def as_dict(self) -> dict:
        """JSON-friendly form (state file, agent API)."""
        return {
            "id": self.id,
            "name": self.name,
            "a": vars(self.a),
            "b": vars(self.b),
            "rate": self.rate,
            "delay_ab": self.delay_ab,
            "delay_ba": self.delay_ba,
            "jitter": self.jitter,
            "loss": self.loss,
        }


@dataclass
class PlannedNs:
    """A namespace of the plan: a node (host) or a switch."""

    name: str
    kind: str  # "host" or "switch"
    vertex: str
    index: int
    address: str | None = None  # node address (hosts) or SVI (switches with a bridge)
    prefix: int = 32
    next_index: int = 2  # the next free ifindex (lo is 1)


@dataclass
class NetworkPlan:
    """Everything the netns runtime will create for one topology."""

    cluster: str
    subnet: str
    namespaces: list[PlannedNs]
    links: list[PlannedLink]
    bridges: dict[str, int]  # switch namespace -> ifindex of br0
    routes: dict[str, list[tuple[str, str, int, str | None, int]]]  # ns -> (dst, gw, oif, prefsrc, table)
    rules: dict[str, list[tuple[str, int, int]]]  # ns -> (src, table, priority)
    node_ns: dict[str, str] = field(default_factory=dict)  # node name -> namespace
    node_addr: dict[str, str] = field(default_factory=dict)  # node name -> node address
    paths: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (node, node) -> namespaces crossed at L3
    pair_links: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)  # (node, node) -> (link id, 0 a>b | 1 b>a)

    @property
    def hosts(self) -> list[PlannedNs]:
        """The node namespaces, in node order."""
        return [n for n in self.namespaces if n.kind == "host"]

    def route_count(self) -> int:
        """How many routes the plan installs."""
        return sum(len(v) for v in self.routes.values())


def ns_name(cluster: str, kind: str, index: int) -> str:
    """The namespace name of node (``h``) or switch (``s``) ``index`` of a cluster."""
    return f"nbx-{cluster}-{kind}{index}"


def ns_role(name: str) -> tuple[str, int] | None:
    """``("h", k)`` for node k's namespace, ``("s", j)`` for switch j's (the inverse of ``ns_name``); None for others."""
    head, sep, tail = name.rpartition("-")
    if not (sep and head.startswith("nbx-") and tail[:1] in ("h", "s") and tail[1:].isdigit()):
        return None
    return tail[0], int(tail[1:])


def link_name(u: str, v: str) -> str:
    """A URL- and shell-friendly link name: ``node0:0--switch`` (NIC 0 of node0 to switch)."""

    def vname(x: str) -> str:
        node, sep, nic = x.partition("/nic")
        return f"{node}:{nic}" if sep else x

    return f"{vname(u)}--{vname(v)}"


class _Allocator:
    """Aligned blocks out of the cluster subnet."""

    def __init__(self, subnet: str):
        try:
            self.net = ipaddress.IPv4Network(subnet, strict=False)
        except ValueError as exc:
            raise InputError(f"--subnet: {exc}") from None
        self.cursor = int(self.net.network_address)
        self.end = int(self.net.broadcast_address) + 1

    def block(self, size: int) -> ipaddress.IPv4Network:
        """The next free block that holds ``size`` addresses, aligned to its size."""
        bits = max(2, (size - 1).bit_length())
        size = 1 << bits
        start = (self.cursor + size - 1) // size * size
        if start + size > self.end:
            raise InputError(f"--subnet: {self.net} is too small for this topology's addresses")
        self.cursor = start + size
        return ipaddress.IPv4Network((start, 32 - bits))


def check_cluster_size(topo) -> None:
    """Refuse (InputError) a topology with more nodes than a cluster of namespaces or containers holds."""
    if len(topo.nodes) > MAX_CLUSTER_NODES:
        raise InputError(f"{topo.source}: cluster: {len(topo.nodes)} nodes; nbox up brings up at most "
                         f"{MAX_CLUSTER_NODES} (one namespace each; nbox run and show take up to the topology bounds)")


def plan_network(topo, cluster: str, subnet: str = DEFAULT_SUBNET) -> NetworkPlan:
    """Turn a topology into namespaces, links, addresses and routes (pure: creates nothing)."""
    from ..topology.graph import ClusterGraph

    check_cluster_size(topo)

    g = ClusterGraph(topo)
    g.materialize(ranks=False)  # every namespace is planned from its host and NICs; ranks need none
    gg = g.g
    alloc = _Allocator(subnet)
    namespaces: list[PlannedNs] = []
    vertex_ns: dict[str, PlannedNs] = {}
    ids = alloc.block(len(topo.nodes) + 2)
    node_addr: dict[str, str] = {}
    for node in topo.nodes:
        p = PlannedNs(ns_name(cluster, "h", node.index), "host", node.name, node.index, str(ids[node.index + 1]), 32)
        namespaces.append(p)
        vertex_ns[node.name] = p
        node_addr[node.name] = p.address
    for j, sw in enumerate(g.switches):
        p = PlannedNs(ns_name(cluster, "s", j), "switch", sw, j)
        namespaces.append(p)
        vertex_ns[sw] = p

    def owner(v: str) -> PlannedNs:
        d = gg.nodes[v]
        return vertex_ns[topo.nodes[d["node"]].name] if d["kind"] == "nic" else vertex_ns[v]

    net_links = [a for a in g.physical_links("net")]
    # Per NIC, how many links it has (a NIC with one link is `nicK`, else `nicK-m`).
    nic_links: dict[str, list[int]] = defaultdict(list)
    for li, a in enumerate(net_links):
        for v in (a.src, a.dst):
            if gg.nodes[v]["kind"] == "nic":
                nic_links[v].append(li)
    port_no: Counter = Counter()
    bridges: dict[str, int] = {}
    seg_members: dict[str, list[End]] = defaultdict(list)
    links: list[PlannedLink] = []
    vertex_end: dict[tuple[str, str], End] = {}  # (vertex, peer vertex) -> the vertex's end
    arc_link: dict[tuple[str, str], tuple[int, int]] = {}

    def make_end(v: str, peer: str, li: int) -> End:
        p = owner(v)
        kind = gg.nodes[v]["kind"]
        if kind == "nic":
            k = gg.nodes[v]["nic"]
            mine = nic_links[v]
            ifname = f"nic{k}" if len(mine) == 1 else f"nic{k}-{mine.index(li)}"
        else:
            ifname = f"p{port_no[v]}"
            port_no[v] += 1
        idx = p.next_index
        p.next_index += 1
        bridged = kind == "switch" and gg.nodes[peer]["kind"] == "nic"
        return End(p.name, ifname, idx, v, bridged=bridged)

    for li, arc in enumerate(net_links):
        u, v = arc.src, arc.dst
        ea, eb = make_end(u, v, li), make_end(v, u, li)
        if ea.index == eb.index:
            # Peers with one ifindex make the kernel batch their link-up event (wait_links_up).
            eb.index = owner(v).next_index
            owner(v).next_index += 1
        back = gg.edges[v, u]
        links.append(
            PlannedLink(li, link_name(u, v), ea, eb, arc.rate, arc.latency, back["latency"], arc.jitter, arc.loss)
        )
        vertex_end[(u, v)] = ea
        vertex_end[(v, u)] = eb
        arc_link[(u, v)] = (li, 0)
        arc_link[(v, u)] = (li, 1)
        for e, other in ((ea, eb), (eb, ea)):
            if e.bridged:
                seg_members[e.vertex].append(other)

    # Addresses: one segment per switch with NIC ports (its SVI first), a /30 per routed link.
    for sw in g.switches:
        members = seg_members.get(sw)
        if not members:
            continue
        p = vertex_ns[sw]
        block = alloc.block(len(members) + 3)
        hosts = list(block.hosts()) if block.prefixlen < 31 else list(block)
        p.address, p.prefix = str(hosts[0]), block.prefixlen
        bridges[p.name] = p.next_index
        p.next_index += 1
        for i, e in enumerate(members):
            e.addr, e.prefix = str(hosts[i + 1]), block.prefixlen
    for lk in links:
        if lk.a.bridged or lk.b.bridged:
            continue
        block = alloc.block(4)
        lk.a.addr, lk.a.prefix = str(block[1]), 30
        lk.b.addr, lk.b.prefix = str(block[2]), 30

    # Routes: walk each node pair's topology route and give every L3 hop a next hop.
    decisions: dict[tuple[str, str], dict[str, tuple[str, int]]] = defaultdict(dict)  # (ns, dst) -> src -> (gw, oif)
    paths: dict[tuple[str, str], list[str]] = {}
    pair_links: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for na in topo.nodes:
        for nb in topo.nodes:
            if na.index == nb.index:
                continue
            net = g.network_route(na.first_rank, nb.first_rank)
            src, dst = node_addr[na.name], node_addr[nb.name]
            pair_links[(na.name, nb.name)] = [arc_link[(x, y)] for x, y in zip(net, net[1:])]
            l3 = [owner(net[0]).name]
            i = 0
            while i < len(net) - 1:
                here, nxt = net[i], net[i + 1]
                out = vertex_end[(here, nxt)]
                into = vertex_end[(nxt, here)]
                if gg.nodes[here]["kind"] == "switch" and out.bridged:
                    # Leaving a switch towards a NIC: through br0 to the NIC's segment address.
                    decisions[(owner(here).name, dst)][src] = (into.addr, bridges[owner(here).name])
                    i += 1
                    l3.append(owner(nxt).name)
                    continue
                if into.bridged:
                    # Entering a switch's bridge: either crossing it at L2 to a NIC, or to its SVI.
                    after = net[i + 2]
                    sw_ns = owner(nxt)
                    if gg.nodes[after]["kind"] == "nic":
                        gw = vertex_end[(after, nxt)].addr
                        decisions[(owner(here).name, dst)][src] = (gw, out.index)
                        l3.append(owner(after).name)
                        i += 2
                        continue
                    decisions[(owner(here).name, dst)][src] = (sw_ns.address, out.index)
                    l3.append(sw_ns.name)
                    i += 1
                    continue
                decisions[(owner(here).name, dst)][src] = (into.addr, out.index)
                l3.append(owner(nxt).name)
                i += 1
            paths[(na.name, nb.name)] = l3

    routes: dict[str, list] = defaultdict(list)
    rules: dict[str, list] = defaultdict(list)
    host_by_addr = {p.address: p for p in namespaces if p.kind == "host"}
    for (ns, dst), by_src in decisions.items():
        own = next((p for p in namespaces if p.name == ns), None)
        own_addr = own.address if own is not None and own.kind == "host" else None
        counts = Counter(by_src.values())
        main = by_src[own_addr] if own_addr in by_src else counts.most_common(1)[0][0]
        routes[ns].append((dst, main[0], main[1], own_addr, RT_TABLE_MAIN))
        for src, choice in by_src.items():
            if choice != main:
                table = 1000 + host_by_addr[src].index
                routes[ns].append((dst, choice[0], choice[1], None, table))
                if (src, table, 1000 + host_by_addr[src].index) not in rules[ns]:
                    rules[ns].append((src, table, 1000 + host_by_addr[src].index))
    return NetworkPlan(
        cluster, str(alloc.net), namespaces, links, bridges, dict(routes), dict(rules),
        {n.name: vertex_ns[n.name].name for n in topo.nodes}, node_addr, paths, pair_links,
    )


# ---- building --------------------------------------------------------------------------------
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


def build_network(plan: NetworkPlan, state, progress=None, adopt: dict[str, int] | None = None) -> None:
    """Create the plan's namespaces, links, bridges, addresses, routes and rules, recording each first.

    ``adopt``: namespace name -> pid of a process whose namespace becomes that one instead of a new
    one (a docker node's container); the others are created.
    """
    say = progress or (lambda msg: None)
    adopt = adopt or {}
    state.record("namespaces", [{"name": p.name, "kind": p.kind, "vertex": p.vertex,
                                 **({"adopted": adopt[p.name]} if p.name in adopt else {})} for p in plan.namespaces])
    nss = {p.name: Namespace(p.name) for p in plan.namespaces}
    for p in plan.namespaces:
        if p.name in adopt:
            nss[p.name].adopt(adopt[p.name])
        else:
            nss[p.name].create()
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


def remove_namespaces(names: list[str]) -> int:
    """Delete the named namespaces that exist; returns how many were removed."""
    return sum(1 for n in names if Namespace(n).delete())
