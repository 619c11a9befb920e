"""Finding a model by name: the built-ins plus third-party models from the ``neuronabox.models`` entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Sequence

from ..collectives import Op
from ..errors import InputError, TopologyError
from ..topology import Topology
from ..topology.graph import ClusterGraph
from .base import Collective, CommModel, Estimate, Group

__all__ = ["ENTRY_POINT_GROUP", "available_models", "model_class", "create_model", "WhatIfModel"]

ENTRY_POINT_GROUP = "neuronabox.models"

# Built-ins are imported lazily so that a broken plugin or a slow import costs nothing unasked.
_BUILTINS = {
    "alpha-beta": "neuronabox.model.alphabeta:AlphaBetaModel",
    "nccl": "neuronabox.model.nccl:NcclModel",
    "flow": "neuronabox.model.flow:FlowModel",
    "ideal": "neuronabox.model.ideal:IdealModel",
    "calibrated": "neuronabox.model.calibrated:CalibratedModel",
}


def _load(target: str) -> type[CommModel]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_models() -> dict[str, str]:
    """Model name -> where it comes from (``built-in`` or the plugin's ``module:attr``)."""
    out = {name: "built-in" for name in _BUILTINS}
    for name, ep in _plugins().items():
        out.setdefault(name, ep.value)
    return out


def model_class(name: str, where: tuple[str, str] | None = None) -> type[CommModel]:
    """The class of model ``name``; ``where`` = (file, yaml path) names the source in errors."""
    if name in _BUILTINS:
        return _load(_BUILTINS[name])
    ep = _plugins().get(name)
    if ep is None:
        message = f"unknown model {name!r} (available: {', '.join(sorted(available_models()))})"
        raise TopologyError(where[0], where[1], message) if where else InputError(message)
    try:
        cls = ep.load()
    except Exception as exc:  # a plugin's import error must not look like ours
        raise InputError(f"model plugin {name!r} ({ep.value}) failed to load: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, CommModel)):
        raise InputError(f"model plugin {name!r} ({ep.value}) is not a neuronabox CommModel subclass")
    return cls


def create_model(
    topology: Topology,
    name: str | None = None,
    *,
    algorithm: str | None = None,
    protocol: str | None = None,
    graph: ClusterGraph | None = None,
    whatif: bool = True,
) -> CommModel:
    """Build the named model (default: the topology's) for a topology, with its what-if injections on top."""
    src = topology.source
    chosen = name if name is not None else topology.emulation.model
    cls = model_class(chosen, None if name is not None else (src, "emulation.model"))
    algo = _choice(cls, "algorithm", algorithm, topology.emulation.algorithm, src)
    proto = _choice(cls, "protocol", protocol, topology.emulation.protocol, src)
    model = cls(topology, graph, algorithm=algo, protocol=proto)
    if whatif and topology.whatif.inject:
        return WhatIfModel(model)
    return model


def _choice(cls: type[CommModel], kind: str, flag: str | None, from_file: str, src: str) -> str:
    """The flag's value or the file's, as the model takes it; errors name where it came from."""
    try:
        return cls.check_choice(kind, flag if flag is not None else from_file)
    except ValueError as exc:
        if flag is not None:
            raise InputError(f"--{kind}: {exc}") from None
        raise TopologyError(src, f"emulation.{kind}", str(exc)) from None


class WhatIfModel(CommModel):
    """Adds the topology's per-collective injected latency to another model's estimates."""

    def __init__(self, inner: CommModel):
        self.inner = inner
        self.topology = inner.topology
        self.graph = inner.graph
        self.algorithm = inner.algorithm
        self.protocol = inner.protocol
        self.name = inner.name
        self.inject: dict[Op, float] = dict(inner.topology.whatif.inject)

    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """The inner model's estimate plus the injected delay for ``op``."""
        est = self.inner.estimate(op, nbytes, group, root)
        extra = self.inject.get(op, 0.0)
        return est.shifted(extra, "+inject") if extra else est

    def estimate_concurrent(self, collectives: Sequence[Collective]) -> list[Estimate]:
        """The inner model's concurrent estimates plus the injected delays."""
        out = []
        for c, est in zip(collectives, self.inner.estimate_concurrent(collectives)):
            extra = self.inject.get(c.op, 0.0)
            out.append(est.shifted(extra, "+inject") if extra else est)
        return out
