"""accelerate on PoseidonDDP: ``PoseidonAccelerator(...)`` where a script builds ``accelerate.Accelerator(...)``.

accelerate's ``prepare(model)`` constructs ``torch.nn.parallel.DistributedDataParallel(model, ...)``
itself, so ``accelerator.prepare(PoseidonDDP(model))`` would put torch DDP around PoseidonDDP and sync
every gradient twice (PoseidonDDP refuses to run that way, ``ddp.py``). ``PoseidonAccelerator`` runs
accelerate's own ``prepare_model`` with PoseidonDDP built where torch DDP would be, with the same
arguments, so everything else accelerate does to a model stays: mixed-precision autocast
(``mixed_precision="bf16"``), device placement, ``torch.compile`` of the wrapper (the dynamo plugin),
and the ``DistributedDataParallelKwargs`` handler's arguments, which PoseidonDDP takes as torch DDP's
(``bucket_cap_mb`` is its fusion cap, ``broadcast_buffers``, ...); ``poseidon_options`` are PoseidonDDP's
own. Invariants:
- plain data parallelism only (one process per device): FSDP, DeepSpeed, Megatron-LM, XLA, a
  ``parallelism_config`` and torch DDP's communication hooks are refused at construction;
- ``server_optimizer`` (True, or ``ServerOptimizer``'s options as a dict): a torch optimizer prepared
  after its model runs on that model's shards (``ServerOptimizer.from_optimizer``); ``clip_grad_norm_``
  then returns the owners' norm of the averaged gradients and cannot clip anything else (the update ran
  during backward: clip with ``max_grad_norm`` in the options);
- ``save_state`` gathers a ServerOptimizer's state from the shards on every rank first (accelerate asks
  every rank's optimizer for its ``state_dict()``); ``load_state`` loads it back into the shards;
- ``unwrap_model`` takes PoseidonDDP off as accelerate takes DDP off (accelerate's free function
  ``extract_model_from_parallel`` does not know it: use the method).
While ``prepare_model`` runs, ``torch.nn.parallel.DistributedDataParallel`` names PoseidonDDP's builder
in this process (accelerate looks the class up by that name): construct no torch DDP on another thread
meanwhile.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedType

from ..ddp import PoseidonDDP
from ..optimizer import ServerOptimizer
from . import swapped

__all__ = ["PoseidonAccelerator", "wrapper_of"]

#: options of ServerOptimizer, not of PoseidonDDP (``delay`` is both's: with a ServerOptimizer it is the latter's)
SERVER_ONLY = ("staleness", "push_every", "fetch_every", "lazy_pull", "max_grad_norm")
REFUSED_TYPES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


def wrapper_of(model: torch.nn.Module) -> PoseidonDDP | None:
    """The PoseidonDDP of a prepared model (under ``torch.compile`` too), or None."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, PoseidonDDP) else None


class PoseidonAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose prepared models are PoseidonDDP instead of torch DDP."""

    def __init__(self, *args: Any, poseidon_options: Mapping[str, Any] | None = None,
                 server_optimizer: bool | Mapping[str, Any] = False, **kwargs: Any) -> None:
        self.poseidon_options = dict(poseidon_options or {})
        self.server_options = _server_options(server_optimizer, self.poseidon_options)
        self.wrappers: list[PoseidonDDP] = []  #: the PoseidonDDP of each prepared model, in order
        super().__init__(*args, **kwargs)
        self._check_supported()

    def _check_supported(self) -> None:
        if self.distributed_type in REFUSED_TYPES or self.parallelism_config is not None:
            what = "a parallelism_config" if self.parallelism_config is not None else self.distributed_type.value
            raise ValueError(f"PoseidonAccelerator replaces torch DDP (one process per device); {what} is not "
                             "supported: use accelerate.Accelerator for it")
        if self.ddp_handler is not None and self.ddp_handler.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError(f"PoseidonAccelerator does not take DistributedDataParallelKwargs(comm_hook="
                             f"{self.ddp_handler.comm_hook.value!r}) (torch DDP's communication hooks); PoseidonDDP's "
                             "paths replace them")

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if wrapper_of(model) is not None and not getattr(model, "_is_accelerate_prepared", False):
            raise ValueError("PoseidonAccelerator wraps the model in PoseidonDDP itself: prepare the plain model")
        with swapped(torch.nn.parallel, "DistributedDataParallel", self._poseidon_ddp):
            return super().prepare_model(model, device_placement, evaluation_mode)

    def _poseidon_ddp(self, module: torch.nn.Module, *args: Any, **ddp_kwargs: Any) -> PoseidonDDP:
        """Where accelerate constructs torch DDP: its arguments, and ``poseidon_options``."""
        both = sorted(set(ddp_kwargs) & set(self.poseidon_options))
        if both:
            raise ValueError(f"{both} given both as torch DDP arguments (DistributedDataParallelKwargs) and in "
                             "poseidon_options: give each once")
        wrapper = PoseidonDDP(module, *args, **ddp_kwargs, **self.poseidon_options)
        self.wrappers.append(wrapper)
        return wrapper

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if self.server_options is not None and not isinstance(optimizer, ServerOptimizer) \
                and not getattr(optimizer, "_is_accelerate_prepared", False):
            wrapper = self._wrapper_of_optimizer(optimizer)
            if wrapper is not None:
                optimizer = ServerOptimizer.from_optimizer(wrapper, optimizer, **self.server_options)
        return super().prepare_optimizer(optimizer, device_placement)

    def _wrapper_of_optimizer(self, optimizer: torch.optim.Optimizer) -> PoseidonDDP | None:
        """The prepared PoseidonDDP whose module holds ``optimizer``'s parameters (None in a single
        process, where nothing is wrapped)."""
        first = next(p for group in optimizer.param_groups for p in group["params"])
        for wrapper in self.wrappers:
            if any(p is first for p in wrapper.module.parameters()):
                return wrapper
        if self.num_processes > 1:
            raise ValueError("server_optimizer: prepare the model before its optimizer (prepare(model, optimizer), in "
                             "that order): the optimizer runs on the model's PoseidonDDP")
        return None

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        with swapped(torch.nn.parallel, "DistributedDataParallel", PoseidonDDP):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        for server in self._server_optimizers():
            server.consolidate_state_dict(to=None)  # collective; accelerate's state_dict() runs on every rank
        return super().save_state(output_dir, safe_serialization, **kwargs)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        """As accelerate's; with a ServerOptimizer, the norm of the averaged gradients its owners computed
        before clipping (``max_norm`` must be its ``max_grad_norm``, or ``inf``: the norm alone; None under
        SSP/async, where no averaged gradient exists)."""
        parameters = list(parameters)
        server = self._server_optimizer_of(parameters)
        if server is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if norm_type != 2:
            raise ValueError(f"a ServerOptimizer's owners compute the 2-norm; clip_grad_norm_(norm_type={norm_type}) "
                             "cannot be given")
        if server.stale and max_norm == math.inf:
            return None
        if server.max_grad_norm is None or (max_norm != math.inf and float(max_norm) != server.max_grad_norm):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}) cannot act on a ServerOptimizer (its update ran at "
                             f"the owners during backward), which clips at max_grad_norm={server.max_grad_norm}: give it "
                             f"max_grad_norm={max_norm} (server_optimizer={{'max_grad_norm': {max_norm}}})")
        norm = server.last_grad_norm
        return None if norm is None else torch.tensor(norm)

    def _server_optimizer_of(self, parameters: list[torch.Tensor]) -> ServerOptimizer | None:
        if not parameters:
            return None
        return next((server for server in self._server_optimizers() if id(parameters[0]) in server.key_of), None)

    def _server_optimizers(self) -> list[ServerOptimizer]:
        inner = [getattr(prepared, "optimizer", prepared) for prepared in self._optimizers]  # accelerate wraps them
        return [optimizer for optimizer in inner if isinstance(optimizer, ServerOptimizer)]


def _server_options(server_optimizer: bool | Mapping[str, Any], poseidon_options: Mapping[str, Any]) -> dict | None:
    """``server_optimizer`` as ServerOptimizer's keyword arguments (None: no ServerOptimizer), and the
    options given to the wrong object refused."""
    if server_optimizer is False or server_optimizer is None:
        server = None
    elif server_optimizer is True:
        server = {}
    elif isinstance(server_optimizer, Mapping):
        server = dict(server_optimizer)
    else:
        raise TypeError(f"server_optimizer must be True, False or a dict of ServerOptimizer options, got {server_optimizer!r}")
    misplaced = [name for name in SERVER_ONLY if name in poseidon_options]
    if server is not None and "delay" in poseidon_options:
        misplaced.append("delay")
    if misplaced:
        example = ", ".join(f"{name!r}: {poseidon_options[name]!r}" for name in misplaced)
        raise ValueError(f"{misplaced} are options of the ServerOptimizer, not of PoseidonDDP: pass "
                         f"server_optimizer={{{example}}} instead of poseidon_options")
    return server
