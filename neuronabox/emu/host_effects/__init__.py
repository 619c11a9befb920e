"""Host effects: what the real host does to an emulated op's timing, one module per mechanism.

A model times an op on an idle host. The real rank's host is not idle, and the emulated ranks
are not perfect clones; each mechanism measured to matter is one module here, one subclass of
``base.HostEffect`` (the hooks the timeline asks, and when), and one line of ``registry.EFFECTS``
(as toxiproxy's toxics: a new effect is a new file, not a branch in five). The emulator builds a
run's effects once (``registry.build``) and gives each new communicator's timeline what it needs.

- ``compute_skew``: slower ranks (what-if stragglers, slower nodes) and peer noise: the group's
  slowest rank arrives late, so the op starts late (``CallerArrival``: a caller's own hook instead);
- ``spin_stall``: gloo's I/O thread spins before an op issued after compute moves its bytes;
- ``host_coupling``: a CPU library's op progresses slower while the rank's process computes;
- ``footprint``: the CPU that gloo would spend, spent for real on a thread beside the training.

Not here: the load twin. ``nbox validate`` runs the real system's other ranks beside each
emulated run, each as its own model-mode ``nbox run`` pinned to that rank's core, so the emulated
rank shares the machine as the real one did. It shapes no op: it is processes that the launcher
side starts and stops (``fidelity/validate.py``, ``fidelity/real_system.twin_ranks``), and its only
part inside the training process is a meeting point at start-up (``emu/start_gate.py``, called
when the first group is created and at the first iteration mark). Beside a wire-mode run the twin
turns its footprint off (``NBOX_FOOTPRINT=0``): the stubs and the relay spend that CPU for real.
"""

from .base import HostEffect, RunContext
from .registry import EFFECTS, build

__all__ = ["HostEffect", "RunContext", "EFFECTS", "build"]
