"""Lightning: ``Trainer(strategy=PoseidonStrategy(...))``, or ``strategy="poseidon"`` once this module is
imported.

``PoseidonStrategy`` is Lightning's ``DDPStrategy`` with :class:`~poseidon_torch.PoseidonDDP` as the
wrapper: DDP-style keyword arguments (``find_unused_parameters``, ``bucket_cap_mb``, ...) and PoseidonDDP's
own options (``hybrid``, ``timeout``, ``trace_dir``, ...) pass through to it. Invariants:
- gradient accumulation (``accumulate_grad_batches``) runs its micro-batches under ``no_sync()``, as
  Lightning does for DDP;
- at teardown the wrapper is closed (hooks and threads gone) and the LightningModule unwrapped;
- with a :class:`~poseidon_torch.ServerOptimizer` (build it in ``configure_optimizers`` with
  :func:`server_optimizer`), ``Trainer(gradient_clip_val=c)`` becomes ``max_grad_norm=c`` at the owners
  (clipping ``.grad`` after backward could not act: the update already ran); a ServerOptimizer whose
  ``max_grad_norm`` differs from ``gradient_clip_val`` is refused at set-up.
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from ..ddp import PoseidonDDP
from ..optimizer import ServerOptimizer


class PoseidonStrategy(DDPStrategy):
    """Lightning's DDP strategy on PoseidonDDP."""

    strategy_name = "poseidon"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(name) is not None:
                raise ValueError(f"PoseidonStrategy does not take {name} (torch DDP's communication hooks); "
                                 "PoseidonDDP's paths replace them")
        super().__init__(*args, **kwargs)

    def _setup_model(self, model: Any) -> PoseidonDDP:
        return PoseidonDDP(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def configure_ddp(self) -> None:
        self.model = self._setup_model(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, PoseidonDDP):
            with self.model.no_sync():
                yield
        else:
            yield

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if isinstance(optimizer, ServerOptimizer):
                _check_clipping(optimizer, trainer)

    def teardown(self) -> None:
        if isinstance(self.model, PoseidonDDP):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("poseidon", "popen"), ("poseidon_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"PoseidonDDP with start_method '{start_method}'",
                                       start_method=start_method, override=True)


def server_optimizer(module: pl.LightningModule, optimizer_class: type, params: Any = None,
                     **kwargs: Any) -> ServerOptimizer:
    """For ``configure_optimizers``: a :class:`~poseidon_torch.ServerOptimizer` on the strategy's
    PoseidonDDP, clipping at the owners with the Trainer's ``gradient_clip_val`` (unless
    ``max_grad_norm`` is given)."""
    trainer = module.trainer
    wrapper = trainer.strategy.model
    if not isinstance(wrapper, PoseidonDDP):
        raise RuntimeError("server_optimizer needs Trainer(strategy=PoseidonStrategy()) (or strategy='poseidon')")
    if trainer.gradient_clip_val and "max_grad_norm" not in kwargs:
        kwargs["max_grad_norm"] = float(trainer.gradient_clip_val)
    return ServerOptimizer(wrapper, optimizer_class, params, **kwargs)


def _check_clipping(optimizer: ServerOptimizer, trainer: pl.Trainer) -> None:
    clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    if not clip:
        return
    if algorithm not in (None, "norm"):
        raise ValueError(f"gradient_clip_algorithm={algorithm!r} is not supported with a ServerOptimizer (the "
                         "update runs at the owners during backward); use the default 'norm'")
    if optimizer.max_grad_norm != float(clip):
        raise ValueError(f"Trainer(gradient_clip_val={clip}) cannot clip a ServerOptimizer's update (it ran during "
                         f"backward), and this ServerOptimizer has max_grad_norm={optimizer.max_grad_norm}: build it "
                         "with poseidon_torch.integrations.lightning.server_optimizer(self, ...), or pass "
                         f"max_grad_norm={clip}")


PoseidonStrategy.register_strategies(StrategyRegistry)
