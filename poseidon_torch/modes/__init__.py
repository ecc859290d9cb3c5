"""The consistency models, one module each, and the one place a wrapper's mode is chosen.

- :mod:`.base`: the protocol (:class:`Mode`): the named points the engine calls;
- :mod:`.bsp`: BSP gradient averaging, the default (``PoseidonDDP(model)``);
- :mod:`.pipe_sgd`: Pipe-SGD on gradients (``PoseidonDDP(model, delay=k)``);
- :mod:`.server`: the parameter-server modes (``ServerOptimizer(model, ...)``, with ``delay=k``: Pipe-SGD
  on the servers);
- :mod:`.ssp`: SSP and asynchronous SGD on the servers (``ServerOptimizer(..., staleness=s)``);
- :mod:`.periodic`: local SGD and DiLoCo, the parameters synced every H steps
  (``PoseidonDDP(model, sync_every=H, outer=...)``).

:func:`resolve` chooses the mode once, from the wrapper's options and the request of a ``ServerOptimizer``
built on it, when the engine starts (its first grad-enabled forward); nothing changes it afterwards. A
new mode is its module and one line in :func:`resolve`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..paths import default_name, path_class
from .base import INITIAL_FUSION_BYTES, Engine, Mode
from .bsp import BSP
from .periodic import DILOCO_OUTER, DiLoCo, LocalSGD, PeriodicOptions, check_periodic, periodic_option
from .pipe_sgd import PipeSGD, delay_option
from .server import PipeServer, ServerMode, ServerRequest
from .ssp import SSP


def resolve(delay: int, request: ServerRequest | None, periodic: PeriodicOptions | None = None) -> Mode:
    """The mode of a wrapper with ``PoseidonDDP(delay=..., sync_every=..., outer=...)`` (``periodic``: the
    last two, checked) and, if one was built on it, a ``ServerOptimizer``'s ``request`` (:func:`check_request`
    accepted it)."""
    if periodic is not None:
        return DiLoCo(periodic) if periodic.outer_class is not None else LocalSGD(periodic)
    if request is None:
        return PipeSGD(delay) if delay else BSP()
    if request.staleness != 0:
        return SSP(request)
    return PipeServer(request) if request.delay else ServerMode(request)


def sync_nice(delay: int) -> int:
    """The nice value of the threads a wrapper starts before its mode is resolved (its private process
    groups' transport threads): Pipe-SGD's when ``PoseidonDDP(delay=k)`` chose it (no ServerOptimizer
    runs with it), else the training thread's."""
    return PipeSGD.sync_nice if delay else BSP.sync_nice


def check_request(delay: int, periodic: PeriodicOptions | None, overrides: Mapping[str, str], devices: Iterable[str],
                  request: ServerRequest, compression: Mapping[str, object] | None = None) -> None:
    """Refuse, when the ``ServerOptimizer`` is built, what its mode could not run: a wrapper that delays
    its gradients already, or syncs only every H steps, a lossy path with a staleness bound or a delay
    (compressed pushes run on the BSP shards only: the SSP server threads push exact gradients), overrides
    that need every rank at the same step under a staleness bound, parameters off the CPU for the SSP
    server threads."""
    if periodic is not None:
        raise RuntimeError(f"PoseidonDDP(sync_every={periodic.sync_every}) steps the user's optimizer on each rank and "
                           "syncs the parameters every H steps; a ServerOptimizer updates them at the shards every "
                           "step: drop sync_every, or use a torch optimizer")
    lossy = sorted(set(compression or {}) | {path for path in overrides.values() if not path_class(path).exact})
    if lossy and (request.delay or request.staleness != 0):
        raise NotImplementedError(f"a ServerOptimizer(delay={request.delay}, staleness={request.staleness}) on a "
                                  f"PoseidonDDP with lossy paths {lossy} (compression= or overrides=) is not supported: "
                                  "compressed pushes run with the BSP parameter server only (delay=0, staleness=0)")
    if delay:
        raise RuntimeError(f"PoseidonDDP(delay={delay}) delays the averaged gradients of the default mode; a "
                           "ServerOptimizer on it is not supported yet")
    if request.staleness == 0:
        return
    forced = sorted(name for name, path in overrides.items() if path != default_name())
    if forced:
        raise ValueError(f"overrides force {sorted(set(overrides[name] for name in forced))} on {forced}, which "
                         f"needs every rank at the same step; a ServerOptimizer with staleness runs every layer on "
                         f"the {default_name()} path")
    off_cpu = sorted(set(devices) - {"cpu"})
    if off_cpu:
        raise NotImplementedError(f"ServerOptimizer(staleness={request.staleness}) runs on CPU parameters only for "
                                  f"now (the model has {off_cpu} ones): its server threads exchange host tensors")


__all__ = ["Mode", "Engine", "INITIAL_FUSION_BYTES", "BSP", "PipeSGD", "ServerMode", "PipeServer", "SSP", "LocalSGD",
           "DiLoCo", "ServerRequest", "PeriodicOptions", "DILOCO_OUTER", "resolve", "sync_nice", "check_request",
           "check_periodic", "delay_option", "periodic_option"]
