"""The Hugging Face ``Trainer`` on PoseidonDDP: ``PoseidonTrainer(model=..., args=..., ...)``.

A ``transformers.Trainer`` whose accelerator is :class:`~poseidon_torch.integrations.accelerate.PoseidonAccelerator`,
so the Trainer prepares the model as it does for DDP and gets PoseidonDDP: ``bf16`` / ``fp16`` autocast,
``torch_compile``, and ``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb`` (the fusion cap),
``ddp_broadcast_buffers`` reach it as they reach torch DDP; ``args.ddp_timeout`` is PoseidonDDP's
``timeout`` too (unless ``poseidon_options`` gives one). ``poseidon_options``: PoseidonDDP's own keyword
arguments (``hybrid``, ``plan``, ``delay``, ...). Gradient accumulation runs the Trainer's micro-batches
under ``no_sync()``, as it does for DDP. With ``delay=k`` checkpoints carry the in-flight Pipe-SGD state
(``poseidon_consistency.pt`` next to ``optimizer.pt``), so ``resume_from_checkpoint`` continues the
uninterrupted run.

``server_optimizer=True`` (or a dict of :class:`~poseidon_torch.ServerOptimizer` options: ``lazy_pull``,
``delay``, ``staleness``, ``push_every``, ``fetch_every``): the optimizer the Trainer builds
(``args.optim``, its param groups, learning rate and weight decay) runs on the parameter-server shards
(``ServerOptimizer.from_optimizer``):
- ``args.max_grad_norm`` becomes the shards' ``max_grad_norm`` (the Trainer's own clipping of ``.grad``
  after backward could not act: the update already ran); without clipping the owners still compute the
  norm, so the logged ``grad_norm`` is always the averaged gradients' (as DDP's). SSP and asynchronous
  training (``staleness``) have no averaged gradient: no norm is logged, and clipping is refused;
- checkpoints gather the sharded state on the main process first (``consolidate_state_dict``, on every
  rank), so ``optimizer.pt`` is torch's format and resuming works as usual;
- ``finish()`` runs when training ends, so every rank holds the owners' newest values.
A ServerOptimizer built by hand cannot be passed in ``optimizers=``: it needs the PoseidonDDP that the
Trainer builds, so it is refused with that advice.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import transformers.trainer
from transformers import Trainer

from ..ddp import PoseidonDDP
from ..optimizer import ServerOptimizer
from . import swapped
from .accelerate import PoseidonAccelerator, wrapper_of
from .resume import FILE_NAME, in_flight_state, restore_in_flight_state


class PoseidonTrainer(Trainer):
    """``transformers.Trainer`` with PoseidonDDP (and optionally a ServerOptimizer)."""

    def __init__(self, *args: Any, poseidon_options: Mapping[str, Any] | None = None,
                 server_optimizer: bool | Mapping[str, Any] = False, **kwargs: Any) -> None:
        self._poseidon_options = dict(poseidon_options or {})
        self._server_request = server_optimizer
        super().__init__(*args, **kwargs)
        if isinstance(self.optimizer, ServerOptimizer):
            raise ValueError("PoseidonTrainer builds the PoseidonDDP a ServerOptimizer runs on, so it cannot take one in "
                             "optimizers=: pass server_optimizer=True (or a dict of its options, e.g. {'staleness': 2}) "
                             "and the Trainer's optimizer (args.optim, or a torch optimizer in optimizers=) runs on the shards")

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer builds ``Accelerator(**args)`` in here: ours instead, with the same arguments."""
        options = {"timeout": self.args.ddp_timeout, **self._poseidon_options}
        build = partial(PoseidonAccelerator, poseidon_options=options, server_optimizer=self._server_options())
        with swapped(transformers.trainer, "Accelerator", build):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, PoseidonAccelerator):
            raise RuntimeError("this transformers version builds its Accelerator outside create_accelerator_and_postprocess; "
                               "PoseidonTrainer cannot put PoseidonDDP in place of DDP")

    def _server_options(self) -> dict | bool:
        """``server_optimizer`` with the Trainer's clipping: ``max_grad_norm`` at the owners (``inf``: the
        norm for the log, no clipping), refused where the mode has no global norm."""
        request = self._server_request
        if request is False or request is None:
            return False
        options = {} if request is True else dict(request)
        if "max_grad_norm" in options:
            raise ValueError("PoseidonTrainer sets the ServerOptimizer's max_grad_norm from TrainingArguments(max_grad_norm=...)"
                             ": give it there")
        clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        if options.get("staleness", 0) != 0:
            if clip is not None:
                raise ValueError(f"ServerOptimizer(staleness={options['staleness']}) cannot clip by the global norm (ranks "
                                 "run on their own clocks, no averaged gradient exists): set "
                                 f"TrainingArguments(max_grad_norm=0) (it is {clip})")
            return options
        return {**options, "max_grad_norm": clip if clip is not None else math.inf}

    @property
    def poseidon_model(self) -> PoseidonDDP | None:
        """The PoseidonDDP training the model (None before ``train()`` or in a single process)."""
        return wrapper_of(self.model_wrapped)

    def _server_optimizer(self) -> ServerOptimizer | None:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return inner if isinstance(inner, ServerOptimizer) else None

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        server = self._server_optimizer()
        if server is not None:
            server.finish()  # every rank: the owners' newest values (SSP: collective)
        return super()._finalize_training(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        server = self._server_optimizer()
        if server is not None:  # every rank: a collective, before the main process writes optimizer.pt
            server.consolidate_state_dict(to=0)
        super()._save_optimizer_and_scheduler(output_dir)
        wrapper = self.poseidon_model
        state = in_flight_state(wrapper) if wrapper is not None else None  # every rank: it waits for the last sync
        if state is not None and self.args.should_save:
            torch.save(state, os.path.join(output_dir, FILE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        wrapper = self.poseidon_model
        if checkpoint is None or wrapper is None:
            return
        path = os.path.join(checkpoint, FILE_NAME)
        restore_in_flight_state(wrapper, torch.load(path, weights_only=True) if os.path.isfile(path) else None)
