"""NeuronaBox: emulate distributed DNN training from one real node.

``neuronabox.init(topology)`` and ``neuronabox.step()`` are the notebook API
(``neuronabox.emu.api``); they are imported on first use so that ``import neuronabox``
does not import torch.
"""

__version__ = "0.1.0"

_API = ("init", "step", "recorder", "shutdown", "current")


def __getattr__(name: str):
    if name in _API:
        from .emu import api

        return getattr(api, name)
    raise AttributeError(f"module 'neuronabox' has no attribute {name!r}")
