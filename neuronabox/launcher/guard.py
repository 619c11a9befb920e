"""The real ranks die with ``nbox run``: even a ``kill -9`` of it leaves no training script behind.

Each process ``nbox run`` starts asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) for
SIGKILL when its parent goes; nothing of the parent has to run for that, so it holds under
SIGKILL of the parent too. The single real rank sets it between fork and exec
(``die_with_parent`` as a preexec_fn); workers of torch's elastic agent set it first thing in
the autostart ``sitecustomize``. The signal is tied to the *thread* that forked the child: both
are started from nbox's main thread, which lives as long as the process. A process the real
rank itself starts (a data loader worker) is its own business: torch's workers watch their parent.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent", "ENV_PARENT"]

ENV_PARENT = "NBOX_PARENT_PID"  # nbox run's pid, for the elastic workers it does not fork itself
PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: die_with_parent runs between fork and exec, where loading a
# library (dlopen takes the loader's lock, which another thread may have held at the fork) could hang.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(parent: int | None = None) -> None:
    """Ask for SIGKILL when the parent (``parent``: its pid, checked after asking) dies; exit now if it already has."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not Linux, or refused: the process lives as before
    # The parent may have died between the fork and the prctl: then nothing would ever signal.
    if parent is not None and os.getppid() != parent:
        os._exit(1)
