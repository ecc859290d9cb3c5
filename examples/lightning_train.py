"""Lightning on PoseidonDDP: one strategy argument.

    torchrun --nproc_per_node 2 examples/lightning_train.py [--server] [--steps 40] [--timeout 120]

A small regressor on synthetic data, gradient clipping and accumulation as Lightning does them. With
--server the optimizer is a ServerOptimizer (the shards hold AdamW's state and clip at the owners with
the Trainer's gradient_clip_val). --timeout (seconds) is both the process group's and PoseidonDDP's.
Rank 0 prints the first and last losses.
"""
from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from poseidon_torch.integrations.lightning import PoseidonStrategy, server_optimizer


class Regressor(pl.LightningModule):
    def __init__(self, server: bool) -> None:
        super().__init__()
        self.server = server
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
        self.losses: list[float] = []

    def training_step(self, batch, index):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        if self.server:  # on the strategy's PoseidonDDP; max_grad_norm from gradient_clip_val
            return server_optimizer(self, torch.optim.AdamW, lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="store_true", help="ServerOptimizer: the shards apply the update")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    y = (x[:, :8].sum(1, keepdim=True) - x[:, 8:16].sum(1, keepdim=True)) / 4  # learnable
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = Regressor(args.server)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # as torchrun launched it
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // per_node,
                         strategy=PoseidonStrategy(timeout=args.timeout), max_steps=args.steps,
                         gradient_clip_val=1.0, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        print(f"loss: {model.losses[0]:.4f} at the first micro-batch, {model.losses[-1]:.4f} at the last "
              f"({args.steps} steps, {'ServerOptimizer' if args.server else 'AdamW'})")


if __name__ == "__main__":
    main()
