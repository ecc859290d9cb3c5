"""Rank functions for the framework integrations (Lightning, the HF Trainer): each framework's own
DDP path and the Poseidon one, on the same seeds and data, run in the test cluster's ranks as if
launched by torchrun (the environment variables frameworks read are set here)."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def launched_as(rank: int, world_size: int) -> None:
    """What torchrun sets for a rank (the process group exists already: frameworks reuse it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      NODE_RANK="0", GROUP_RANK="0")


def _lightning(package: str):
    """``lightning.pytorch`` or ``pytorch_lightning``, and this package's PoseidonStrategy module for it."""
    import importlib

    pl = importlib.import_module(package)
    ours = importlib.import_module("poseidon_torch.integrations." + ("lightning" if package == "lightning.pytorch"
                                                                      else "pytorch_lightning"))
    return pl, ours


def _regressor(pl, optimizer, straggle_s: float = 0.0) -> object:
    """A small LightningModule (seeded) whose ``configure_optimizers`` is ``optimizer(module)``; each
    training step sleeps ``straggle_s`` first (a slow rank)."""

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
            self.losses: list[float] = []

        def training_step(self, batch, index):
            time.sleep(straggle_s)
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return optimizer(self)

    return Regressor()


def _regression_data(rows: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))


def _quiet_trainer(pl, world_size: int, root: str, **kwargs):
    defaults = dict(accelerator="cpu", devices=world_size, num_nodes=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    return pl.Trainer(**{**defaults, **kwargs})


def _params(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def lightning_fit(rank: int, world_size: int, wrapper: str, server: bool, clip: float | None, accumulate: int,
                  root: str, package: str = "lightning.pytorch") -> dict:
    """``Trainer.fit`` of a small regressor with ``strategy="ddp"``, ``PoseidonStrategy`` or, by its
    registered name, ``strategy="poseidon"`` (``wrapper``: "ddp", "poseidon", "poseidon-by-name"),
    optionally with a ServerOptimizer from ``server_optimizer``, under either Lightning package name;
    the final parameters and losses."""
    launched_as(rank, world_size)
    pl, ours = _lightning(package)

    def optimizer(module):
        if server:
            return ours.server_optimizer(module, torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
        return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.05)

    strategy = {"ddp": "ddp", "poseidon": ours.PoseidonStrategy(timeout=60, hybrid=False),
                "poseidon-by-name": "poseidon"}[wrapper]
    model = _regressor(pl, optimizer)
    trainer = _quiet_trainer(pl, world_size, root, strategy=strategy, max_steps=5, gradient_clip_val=clip,
                             accumulate_grad_batches=accumulate)
    trainer.fit(model, _regression_data())
    unwrapped = trainer.strategy.model is model  # teardown closed and unwrapped PoseidonDDP
    return {"params": _params(model), "losses": model.losses, "unwrapped": unwrapped,
            "strategy": type(trainer.strategy).__module__}


def lightning_server_lifecycle(rank: int, world_size: int, root: str) -> dict:
    """Issue 44 items 4, 6, 7 in one fit: ``PoseidonStrategy(timeout=60)`` (seconds) and a
    ``ServerOptimizer(staleness=2)``, rank 1 slower than rank 0 (so rank 0 runs ahead, as SSP lets it);
    what the wrapper and Lightning got as timeouts, every rank's parameters after ``fit``, and ``trainer.save_checkpoint`` after ``fit`` (its outcome, and on rank 0
    the optimizer state it wrote)."""
    launched_as(rank, world_size)
    pl, ours = _lightning("lightning.pytorch")
    seen = {}

    class Watch(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["poseidon timeout"] = trainer.strategy.model.options.timeout
            seen["process group timeout"] = trainer.strategy._timeout

    model = _regressor(pl, lambda m: ours.server_optimizer(m, torch.optim.AdamW, lr=1e-2, staleness=2),
                       straggle_s=0.05 * (rank > 0))
    initial = _params(model)
    trainer = _quiet_trainer(pl, world_size, root, strategy=ours.PoseidonStrategy(timeout=60), max_steps=6,
                             callbacks=[Watch()])
    trainer.fit(model, _regression_data())
    path = os.path.join(root, "after-fit.ckpt")
    try:
        trainer.save_checkpoint(path)
        saved = "saved"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts
        saved = f"{type(exc).__name__}: {exc}"
    state = None
    if rank == 0 and saved == "saved":
        checkpoint = torch.load(path, weights_only=False)
        state = {"optimizer": checkpoint["optimizer_states"][0], "params": checkpoint["state_dict"]}
    return {**seen, "initial": initial, "params": _params(model), "saved": saved, "checkpoint": state,
            "shapes": [tuple(p.shape) for p in model.parameters()]}


def lightning_pipe_sgd_resume(rank: int, world_size: int, root: str, phase: str) -> dict:
    """Issue 44 item 3: ``PoseidonStrategy(delay=1)`` for 2 epochs (``phase`` "whole"), or for 1 epoch with
    Lightning's ``ModelCheckpoint`` at its end ("first") or ``trainer.save_checkpoint`` after ``fit``
    ("first-saved-after-fit"), then resumed from that checkpoint for the second ("resume"; "resume-bsp": by a run with delay=0, which must
    refuse it, saying what to do). Also every
    rank's in-flight state as the first epoch ends (is it the same on every rank?)."""
    launched_as(rank, world_size)
    pl, ours = _lightning("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    in_flight = {}

    class Peek(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            if trainer.current_epoch == 0:
                in_flight.update(trainer.strategy.model.consistency_state_dict())

    model = _regressor(pl, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05))
    cut = os.path.join(root, "cut")
    callbacks = [Peek()] + ([ModelCheckpoint(dirpath=cut, filename="epoch-end")] if phase == "first" else [])
    delay = 0 if phase == "resume-bsp" else 1
    trainer = _quiet_trainer(pl, world_size, root, strategy=ours.PoseidonStrategy(timeout=60, hybrid=False, delay=delay),
                             max_epochs=1 if phase.startswith("first") else 2, callbacks=callbacks,
                             enable_checkpointing=phase == "first")
    resume_from = os.path.join(cut, "epoch-end.ckpt") if phase.startswith("resume") else None
    if phase == "resume-bsp":
        try:
            trainer.fit(model, _regression_data(48), ckpt_path=resume_from)
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    trainer.fit(model, _regression_data(48), ckpt_path=resume_from)
    if phase == "first-saved-after-fit":
        trainer.save_checkpoint(os.path.join(cut, "epoch-end.ckpt"))
    return {"params": _params(model), "in_flight": in_flight}


def lightning_refuses_mismatched_clipping(rank: int, world_size: int, root: str) -> str:
    """A ServerOptimizer built without max_grad_norm under Trainer(gradient_clip_val=...): refused."""
    launched_as(rank, world_size)
    import lightning.pytorch as pl

    from poseidon_torch import ServerOptimizer
    from poseidon_torch.integrations.lightning import PoseidonStrategy

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, index):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return ServerOptimizer(self.trainer.strategy.model, torch.optim.SGD, lr=0.1)

    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=PoseidonStrategy(timeout=60), max_steps=2,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    try:
        trainer.fit(Plain(), loader)
    except ValueError as exc:
        return str(exc)
    return "no error"


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))


class TinyLM(nn.Module):
    """A language model of a few modules, for the Trainer: dynamo traces it in a fraction of GPT-2's time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(96, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 96)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(self.body(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def token_dataset(rows: int = 48, length: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (rows, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def hf_train(rank: int, world_size: int, wrapper: str, server: bool | dict, root: str, steps: int = 4,
             save_every: int = 0, stop_at: int = 0, resume: bool = False, training: dict | None = None,
             poseidon: dict | None = None, network: str = "gpt2") -> dict:
    """``Trainer.train`` of a tiny GPT-2 (tied embeddings) with accelerate's DDP or ``PoseidonTrainer``
    (``server``: its ``server_optimizer``); gradient accumulation 2, clipping at 1.0. ``save_every``:
    checkpoint every so many steps; ``stop_at``: stop after that step (an interrupted run); ``resume``:
    continue from the last checkpoint in the output directory; ``training``: TrainingArguments to
    change; ``poseidon``: PoseidonTrainer's ``poseidon_options``; ``network``: "gpt2" or "tiny" (:class:`TinyLM`). Returns the parameters, the logged
    norms, the graphs dynamo compiled, the options the PoseidonDDP got and the syncs it counted."""
    launched_as(rank, world_size)
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from poseidon_torch.integrations.hf import PoseidonTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    out_dir = os.path.join(root, f"{wrapper}-{'server' if server else 'default'}")
    arguments = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
                     learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, use_cpu=True, report_to=[], logging_steps=1,
                     seed=0, data_seed=0, dataloader_num_workers=0,
                     # eps 1e-4: GPT-2's key bias has an exactly zero gradient (softmax ignores it), and AdamW with
                     # a tiny eps turns its rounding noise, which any two sum orders (P = 3) make differently, into
                     # full-size steps
                     optim="adamw_torch", adam_epsilon=1e-4, disable_tqdm=True,
                     save_strategy="steps" if save_every else "no", save_steps=save_every or 500,
                     lr_scheduler_type="linear")
    args = TrainingArguments(**{**arguments, **(training or {})})
    model = tiny_gpt2() if network == "gpt2" else TinyLM()
    callbacks = [StopAt()] if stop_at else []
    if wrapper == "poseidon":
        trainer = PoseidonTrainer(model=model, args=args, train_dataset=token_dataset(), server_optimizer=server,
                                  poseidon_options={"timeout": 60} if poseidon is None else poseidon, callbacks=callbacks)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    torch._dynamo.reset()
    counters.clear()
    trainer.train(resume_from_checkpoint=True if resume else None)
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    options, syncs = None, None
    if wrapper == "poseidon" and trainer.poseidon_model is not None:
        options, syncs = trainer.poseidon_model.options, trainer.poseidon_model.comm_stats.iterations
        trainer.poseidon_model.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "graphs": counters["stats"]["unique_graphs"], "options": options, "syncs": syncs,
            "files": sorted(os.listdir(os.path.join(out_dir, f"checkpoint-{save_every}"))) if save_every else []}


def hf_refusals(rank: int, world_size: int, root: str) -> dict[str, str]:
    """Issue 44 item 9: what PoseidonTrainer says to a ServerOptimizer option given to PoseidonDDP, to a
    ServerOptimizer built by hand, and to SSP with clipping."""
    launched_as(rank, world_size)
    from transformers import TrainingArguments

    from poseidon_torch import PoseidonDDP, ServerOptimizer
    from poseidon_torch.integrations.hf import PoseidonTrainer

    args = TrainingArguments(output_dir=root, use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True)
    model = tiny_gpt2()
    by_hand = ServerOptimizer(PoseidonDDP(model, timeout=60), torch.optim.AdamW, lr=1e-3)
    cases = {"staleness in poseidon_options": dict(poseidon_options={"staleness": 2}),
             "ServerOptimizer in optimizers=": dict(optimizers=(by_hand, None)),
             "staleness with clipping": dict(server_optimizer={"staleness": 2})}
    said = {}
    for case, kwargs in cases.items():
        try:
            PoseidonTrainer(model=model, args=args, train_dataset=token_dataset(), **kwargs)
            said[case] = "no error"
        except (TypeError, ValueError) as exc:
            said[case] = f"{type(exc).__name__}: {exc}"
    by_hand.model.close()
    return said


def accelerate_train(rank: int, world_size: int, how: str) -> dict:
    """Issue 44 item 2: a plain accelerate loop (AdamW, gradient accumulation 2 with ``accumulate``,
    ``clip_grad_norm_`` at 0.5) with ``Accelerator`` ("ddp"), ``PoseidonAccelerator`` ("poseidon"), or
    plain accelerate given a PoseidonDDP ("double": what the issue found, torch DDP around it; and what
    PoseidonAccelerator says to a PoseidonDDP)."""
    launched_as(rank, world_size)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from poseidon_torch import PoseidonDDP

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer runs before left their settings
    GradientState._reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    raw = model
    refused = None
    if how == "double":
        model = PoseidonDDP(model, timeout=60)
    if how != "ddp":
        from poseidon_torch.integrations.accelerate import PoseidonAccelerator
    if how == "poseidon":
        accelerator = PoseidonAccelerator(gradient_accumulation_steps=2, cpu=True, poseidon_options={"timeout": 60})
    else:
        if how == "double":  # ours refuses it before building anything
            try:
                PoseidonAccelerator(cpu=True).prepare(model)
            except ValueError as exc:
                refused = str(exc)
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    norms = []
    try:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
                opt.step()
                opt.zero_grad()
        outcome = "trained"
    except RuntimeError as exc:
        outcome = str(exc)
    unwrapped = accelerator.unwrap_model(model) is raw
    if how != "ddp":
        (model.module if how == "double" else model).close()
    return {"params": {n: p.detach().clone() for n, p in raw.named_parameters()}, "norms": norms,
            "outcome": outcome, "unwrapped": unwrapped, "wrapped in": type(model).__name__, "refused": refused}


def accelerate_server_save_state(rank: int, world_size: int, root: str) -> dict:
    """``PoseidonAccelerator(server_optimizer=True)``: 6 steps, ``accelerator.save_state``, 6 more; then a
    fresh accelerator and model, ``load_state`` and the same last 6 steps. The outcome of ``save_state``
    (accelerate calls the optimizer's ``state_dict()`` on every rank), the uninterrupted and the resumed
    parameters."""
    launched_as(rank, world_size)
    from accelerate.state import AcceleratorState, GradientState

    from poseidon_torch.integrations.accelerate import PoseidonAccelerator

    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(12)]

    def prepared() -> tuple:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()  # an earlier run's accumulation (sync_gradients False) would skip steps here
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        accelerator = PoseidonAccelerator(cpu=True, server_optimizer=True, poseidon_options={"timeout": 60, "hybrid": False})
        wrapped, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return accelerator, model, wrapped, opt

    def train(wrapped, opt, accelerator, part) -> None:
        for x, y in part:
            accelerator.backward(F.mse_loss(wrapped(x), y))
            opt.step()
            opt.zero_grad()

    accelerator, model, wrapped, opt = prepared()
    train(wrapped, opt, accelerator, batches[:6])
    try:
        accelerator.save_state(os.path.join(root, "state"))
        saved = "saved"
    except RuntimeError as exc:
        saved = f"{type(exc).__name__}: {exc}"
    train(wrapped, opt, accelerator, batches[6:])
    whole = _params(model)
    wrapped.close()
    resumed = None
    if saved == "saved":
        accelerator, model, wrapped, opt = prepared()
        accelerator.load_state(os.path.join(root, "state"))
        train(wrapped, opt, accelerator, batches[6:])
        resumed = _params(model)
        wrapped.close()
    return {"saved": saved, "whole": whole, "resumed": resumed}


def lightning_periodic(rank: int, world_size: int, root: str, accumulate: int, options: dict) -> dict:
    """``PoseidonStrategy(**options)`` (``sync_every`` and maybe ``delay``) for 6 optimizer steps of AdamW,
    ``accumulate`` batches each: the initial and final parameters, every batch this rank trained on, and
    the syncs counted after each batch (Lightning's closure runs the first forward inside the first
    ``step()``)."""
    launched_as(rank, world_size)
    pl, ours = _lightning("lightning.pytorch")
    batches, syncs = [], []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, index):
            batches.append([t.clone() for t in batch])

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            syncs.append(trainer.strategy.model.comm_stats.iterations)

    model = _regressor(pl, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05))
    initial = _params(model)
    trainer = _quiet_trainer(pl, world_size, root, strategy=ours.PoseidonStrategy(timeout=60, **options), max_steps=6,
                             accumulate_grad_batches=accumulate, callbacks=[Record()])
    trainer.fit(model, _regression_data())
    return {"initial": initial, "params": _params(model), "batches": batches, "syncs": syncs}
