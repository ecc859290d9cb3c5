"""The Hugging Face ``Trainer`` on PoseidonDDP: ``PoseidonTrainer(model=..., args=..., ...)``.

A ``transformers.Trainer`` whose distributed wrapper is :class:`~poseidon_torch.PoseidonDDP` instead of
the DDP that accelerate would build (``poseidon_options``: PoseidonDDP's keyword arguments). With
``server_optimizer=True`` the optimizer the Trainer builds (``args.optim``, its param groups, learning
rate and weight decay) runs on the parameter-server shards (:meth:`ServerOptimizer.from_optimizer`):
- ``args.max_grad_norm`` becomes the shards' ``max_grad_norm`` (the Trainer's own ``clip_grad_norm_`` on
  ``.grad`` after backward could not act: the update already ran), and the norm the Trainer logs is the
  one the owners computed;
- checkpoints gather the sharded state on the main process first (``consolidate_state_dict``, on every
  rank), so ``optimizer.pt`` is torch's format and resuming works as usual.
Gradient accumulation runs the Trainer's micro-batches under ``no_sync()``, as it does for DDP.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from ..ddp import PoseidonDDP
from ..optimizer import ServerOptimizer


class PoseidonTrainer(Trainer):
    """``transformers.Trainer`` with PoseidonDDP (and optionally a ServerOptimizer)."""

    def __init__(self, *args: Any, poseidon_options: dict | None = None, server_optimizer: bool = False,
                 lazy_pull: bool = False, **kwargs: Any) -> None:
        self._poseidon_options = dict(poseidon_options or {})
        self._server = server_optimizer
        self._lazy_pull = lazy_pull
        self._wrapper: PoseidonDDP | None = None
        super().__init__(*args, **kwargs)

    def _poseidon(self, model: torch.nn.Module) -> PoseidonDDP:
        if self._wrapper is None or self._wrapper.module is not model:
            self._wrapper = PoseidonDDP(model, **self._poseidon_options)
        return self._wrapper

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if isinstance(model, PoseidonDDP):
            return model
        if training and self._distributed():
            return self._poseidon(model)
        return super()._wrap_model(model, training, dataloader)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if not self._server or self.optimizer is not None or not self._distributed():
            return super().create_optimizer(model)
        plain = super().create_optimizer(model)
        clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        self.optimizer = ServerOptimizer.from_optimizer(self._poseidon(self.model), plain, max_grad_norm=clip,
                                                        lazy_pull=self._lazy_pull)
        return self.optimizer

    def _server_optimizer(self) -> ServerOptimizer | None:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return inner if isinstance(inner, ServerOptimizer) else None

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        server = self._server_optimizer()
        if server is None:
            return super()._clip_grad_norm(model)
        return torch.tensor(server.last_grad_norm)  # clipped at the owners, during backward

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        server = self._server_optimizer()
        if server is not None:  # every rank: a collective, before the main process writes optimizer.pt
            server.consolidate_state_dict(to=0)
        super()._save_optimizer_and_scheduler(output_dir)
