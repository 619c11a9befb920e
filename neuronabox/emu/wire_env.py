"""How wire mode is switched on and tuned: its environment variables, the stall timeout, where the stubs are.

The launcher sets ``NBOX_WIRE`` and ``NBOX_CLUSTER`` for ``nbox run --cluster NAME --mode wire``
and registers, with ``use_stubs``, how the cluster's stubs are found: the emulator is handed
where the stubs are instead of importing the cluster (``neuronabox.cluster`` and
``neuronabox.emu`` are independent siblings). ``NBOX_WIRE_TIMEOUT`` bounds every wait of the
real rank (``stall_timeout``).
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["ENV_WIRE", "ENV_CLUSTER", "ENV_TIMEOUT", "DEFAULT_TIMEOUT", "stall_timeout", "StubLocator", "use_stubs",
           "stub_locator"]

# node -> {"control": Unix socket path, "port": data port, "address": the node's address} of that
# node's stub, started if it is not. The cluster side provides it (neuronabox.cluster.stub.stub_locator),
# registered by the process's start-up (neuronabox.launcher.child) with ``use_stubs``: the
# emulator is given where the stubs are rather than importing the cluster.
StubLocator = Callable[[str], dict]
_locator_factory: "Callable[[str], StubLocator] | None" = None


def use_stubs(factory: "Callable[[str], StubLocator]") -> None:
    """Register how a cluster's stubs are found: ``factory(cluster)`` returns a ``StubLocator``."""
    global _locator_factory
    _locator_factory = factory


def stub_locator(cluster: str) -> StubLocator:
    """The registered locator of ``cluster``'s stubs (RuntimeError when this process was not started by nbox run)."""
    if _locator_factory is None:
        raise RuntimeError("nbox wire: NBOX_WIRE is set but this process was not started by nbox run "
                           "(no stub locator registered)")
    return _locator_factory(cluster)


ENV_WIRE = "NBOX_WIRE"
ENV_CLUSTER = "NBOX_CLUSTER"
ENV_TIMEOUT = "NBOX_WIRE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0  # s past an op's modeled end before a silent stub counts as stalled


def stall_timeout() -> float:
    """Seconds past an op's modeled end before the wire gives up (``NBOX_WIRE_TIMEOUT``, default 60)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from ..errors import InputError

        raise InputError(f"{ENV_TIMEOUT}: expected a positive number of seconds, got {raw!r}")
    return value

