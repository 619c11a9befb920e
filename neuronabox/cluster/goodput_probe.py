"""TCP goodput between two containers of a docker cluster: what a shaped link carries, measured inside.

tbf meters whole Ethernet frames while TCP delivers payload: with a 1500-byte MTU and timestamps,
1448 of every 1514 bytes (``TCP_PAYLOAD_SHARE``), so goodput is compared with that share of the rate.
The tests and ``benchmarks/docker_updown.py`` measure links with it.
"""

from __future__ import annotations

import subprocess
from typing import Any

__all__ = ["TCP_PAYLOAD_SHARE", "container_goodput"]

TCP_PAYLOAD_SHARE = (1500 - 20 - 20 - 12) / (1500 + 14)

# Runs with the container's python3; the server prints "ready", then the bytes per second it got
# after the first read (the first read carries the connection's start, not the link's rate).
_SCRIPT = r"""
import socket, sys, time
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5201)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); n = first = 0; t0 = None
    while True:
        b = c.recv(1 << 16)
        if not b: break
        if t0 is None: t0, first = time.perf_counter(), len(b)
        n += len(b)
    print((n - first) / (time.perf_counter() - t0))
else:
    c = socket.create_connection((sys.argv[2], 5201)); buf = b"\0" * (1 << 16); n = int(sys.argv[3]); sent = 0
    while sent < n: c.sendall(buf); sent += len(buf)
    c.close()
"""


def container_goodput(client: Any, sender: str, receiver: str, address: str, nbytes: int) -> float:
    """Bytes per second of TCP payload from container ``sender`` to ``receiver`` (at ``address``), ``nbytes`` sent."""
    for name in (sender, receiver):
        client.containers.get(name).exec_run(["sh", "-c", f"cat > /tmp/nbox-goodput.py << 'EOF'\n{_SCRIPT}\nEOF"])
    # The server's "ready" must be read before the sender starts: a streamed exec, here the CLI's.
    srv = subprocess.Popen(["docker", "exec", receiver, "python3", "/tmp/nbox-goodput.py", "serve"],
                           stdout=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"goodput server in {receiver} did not start")
        client.containers.get(sender).exec_run(["python3", "/tmp/nbox-goodput.py", "send", address, str(nbytes)])
        return float(srv.stdout.read().strip())
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(10)
