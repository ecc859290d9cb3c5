"""Lightning's DDP strategy on PoseidonDDP, written once for both of Lightning's package names.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same classes twice, and each Trainer accepts
only strategies derived from its own ``Strategy``; so the behaviour lives in :class:`PoseidonStrategyMixin`,
which ``lightning.py`` and ``pytorch_lightning.py`` put in front of their package's ``DDPStrategy``.
It is ``DDPStrategy`` with :class:`~poseidon_torch.PoseidonDDP` as the wrapper: DDP-style keyword arguments
(``find_unused_parameters``, ``bucket_cap_mb``, ...) and PoseidonDDP's own options (``hybrid``,
``plan``, ``delay``, ``trace_dir``, ...) pass through to it. Invariants:
- ``timeout`` (seconds or a ``timedelta``) is both Lightning's process-group timeout and PoseidonDDP's;
  not given, each keeps its own default (Lightning's 30 min, PoseidonDDP's 300 s);
- gradient accumulation (``accumulate_grad_batches``) runs its micro-batches under ``no_sync()``, as
  Lightning does for DDP;
- checkpoints carry PoseidonDDP's in-flight Pipe-SGD state (``resume.py``), so a resumed ``delay=k``
  run continues the uninterrupted one; also ``trainer.save_checkpoint`` after ``fit`` (the state is
  taken before teardown closes the wrapper, and kept until the next fit wraps the model again);
- with a :class:`~poseidon_torch.ServerOptimizer` (build it in ``configure_optimizers`` with
  :func:`server_optimizer`), ``Trainer(gradient_clip_val=c)`` becomes ``max_grad_norm=c`` at the owners
  (clipping ``.grad`` after backward could not act: the update already ran); a ServerOptimizer whose
  ``max_grad_norm`` differs from ``gradient_clip_val`` is refused at set-up. A fit that ends (any
  ``on_train_end``: max steps, early stopping) calls its ``finish()``, so every rank holds the owners'
  newest values (SSP, async, ``delay``), and gathers its state on rank 0 before teardown closes the
  wrapper, so ``trainer.save_checkpoint`` works after ``fit``;
- at teardown the wrapper is closed (hooks and threads gone) and the LightningModule unwrapped; a fit
  that raised skips the collectives above (a peer may be gone).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any

from ..ddp import PoseidonDDP
from ..optimizer import ServerOptimizer
from .resume import CHECKPOINT_KEY, in_flight_state, restore_in_flight_state

COMM_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class PoseidonStrategyMixin:
    """The methods in which ``PoseidonStrategy`` differs from Lightning's ``DDPStrategy``."""

    strategy_name = "poseidon"

    def __init__(self, *args: Any, timeout: float | timedelta | None = None, **kwargs: Any) -> None:
        for name in COMM_HOOK_ARGUMENTS:
            if kwargs.get(name) is not None:
                raise ValueError(f"PoseidonStrategy does not take {name} (torch DDP's communication hooks); "
                                 "PoseidonDDP's paths replace them")
        if timeout is not None:
            kwargs["timeout"] = _as_timedelta(timeout)
        super().__init__(*args, **kwargs)
        if timeout is not None:
            self._ddp_kwargs["timeout"] = kwargs["timeout"]
        self._fit_raised = False
        self._in_flight_after_fit: dict | None = None

    def _setup_model(self, model: Any) -> PoseidonDDP:
        return PoseidonDDP(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def configure_ddp(self) -> None:
        self._in_flight_after_fit = None
        self.model = self._setup_model(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, PoseidonDDP):
            with self.model.no_sync():
                yield
        else:
            yield

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self._server_optimizers():
            _check_clipping(optimizer, trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank (Lightning calls it on every rank; the main one writes)."""
        state = in_flight_state(self.model) if isinstance(self.model, PoseidonDDP) else self._in_flight_after_fit
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning restores the training state here (fitting, wrapper built): the in-flight state too."""
        super().load_optimizer_state_dict(checkpoint)
        if isinstance(self.model, PoseidonDDP):
            restore_in_flight_state(self.model, checkpoint.get(CHECKPOINT_KEY))

    def on_train_end(self) -> None:
        super().on_train_end()
        for optimizer in self._server_optimizers():
            optimizer.finish()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._fit_raised = True

    def teardown(self) -> None:
        if isinstance(self.model, PoseidonDDP):
            if not self._fit_raised:  # what closes with the wrapper, for a checkpoint saved after fit
                for optimizer in self._server_optimizers():
                    optimizer.consolidate_state_dict(to=0)
                self._in_flight_after_fit = in_flight_state(self.model)
            self.model.close()
            self.model = self.lightning_module
        self._fit_raised = False
        super().teardown()

    def _server_optimizers(self) -> list[ServerOptimizer]:
        return [optimizer for optimizer in self.optimizers if isinstance(optimizer, ServerOptimizer)]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("poseidon", "popen"), ("poseidon_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"PoseidonDDP with start_method '{start_method}'",
                                       start_method=start_method, override=True)


def _as_timedelta(timeout: Any) -> timedelta:
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf:
        return timedelta(seconds=timeout)
    raise TypeError(f"PoseidonStrategy option timeout must be a finite number of seconds > 0 or a datetime.timedelta "
                    f"> 0, got {timeout!r}")


def server_optimizer(module: Any, optimizer_class: type, params: Any = None, **kwargs: Any) -> ServerOptimizer:
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


def _check_clipping(optimizer: ServerOptimizer, trainer: Any) -> None:
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
