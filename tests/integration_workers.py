"""Rank functions for the framework integrations (Lightning, the HF Trainer): each framework's own
DDP path and the Poseidon one, on the same seeds and data, run in the test cluster's ranks as if
launched by torchrun (the environment variables frameworks read are set here)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def launched_as(rank: int, world_size: int) -> None:
    """What torchrun sets for a rank (the process group exists already: frameworks reuse it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      NODE_RANK="0", GROUP_RANK="0")


def lightning_fit(rank: int, world_size: int, wrapper: str, server: bool, clip: float | None, accumulate: int,
                  root: str) -> dict:
    """``Trainer.fit`` of a small regressor with ``strategy="ddp"`` or ``PoseidonStrategy`` (optionally a
    ServerOptimizer from ``server_optimizer``); the final parameters and losses."""
    launched_as(rank, world_size)
    import lightning.pytorch as pl

    from poseidon_torch.integrations.lightning import PoseidonStrategy, server_optimizer

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
            self.losses: list[float] = []

        def training_step(self, batch, index):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            if server:
                return server_optimizer(self, torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    strategy = PoseidonStrategy(timeout=60, hybrid=False) if wrapper == "poseidon" else "ddp"
    model = Regressor()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy, max_steps=5,
                         gradient_clip_val=clip, accumulate_grad_batches=accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root)
    trainer.fit(model, loader)
    unwrapped = trainer.strategy.model is model  # teardown closed and unwrapped PoseidonDDP
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": model.losses,
            "unwrapped": unwrapped}


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


def token_dataset(rows: int = 48, length: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (rows, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def hf_train(rank: int, world_size: int, wrapper: str, server: bool, root: str, steps: int = 4,
             save_every: int = 0, stop_at: int = 0, resume: bool = False) -> dict:
    """``Trainer.train`` of a tiny GPT-2 (tied embeddings) with accelerate's DDP or ``PoseidonTrainer``
    (optionally with the ServerOptimizer); gradient accumulation 2, clipping at 1.0. ``save_every``:
    checkpoint every so many steps; ``stop_at``: stop after that step (an interrupted run); ``resume``:
    continue from the last checkpoint in the output directory."""
    launched_as(rank, world_size)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from poseidon_torch.integrations.hf import PoseidonTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    out_dir = os.path.join(root, f"{wrapper}-{int(server)}")
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, use_cpu=True,
                             report_to=[], logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0,
                             # eps 1e-4: GPT-2's key bias has an exactly zero gradient (softmax ignores it), and
                             # AdamW with a tiny eps turns its rounding noise, which any two sum orders (P = 3)
                             # make differently, into full-size steps
                             optim="adamw_torch", adam_epsilon=1e-4, disable_tqdm=True,
                             save_strategy="steps" if save_every else "no",
                             save_steps=save_every or 500, lr_scheduler_type="linear")
    model = tiny_gpt2()
    callbacks = [StopAt()] if stop_at else []
    if wrapper == "poseidon":
        trainer = PoseidonTrainer(model=model, args=args, train_dataset=token_dataset(), server_optimizer=server,
                                  poseidon_options={"timeout": 60}, callbacks=callbacks)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    if wrapper == "poseidon" and trainer._wrapper is not None:
        trainer._wrapper.synchronize()
        trainer._wrapper.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}
