"""Rank functions for the simulator's tests: a traced run whose byte counters the simulator must match."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models import ModelSpec, batch, build
from patterns import slow_link
from poseidon_torch import PoseidonDDP
from training import shard

STEPS, SKIP = 6, 3


def traced_delayed(rank: int, world_size: int, trace_dir: str) -> None:
    """A traced Pipe-SGD run (``delay=1``): its forward waits for the previous step's sync."""
    spec = ModelSpec(widths=(16,))
    wrapped = PoseidonDDP(build(spec, seed=0), timeout=60, trace_dir=trace_dir, trace_skip=1, trace_iters=2, delay=1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(4):  # the window's last pass (step 2) closes in step 3's forward
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    wrapped.close()


def traced_bytes(rank: int, world_size: int, trace_dir: str, hybrid: bool, compression: str | None = None,
                 rows: int = 3) -> dict:
    """An MLP of four FC layers, each in a bucket of its own, ``rows`` samples per rank, traced over its last
    iterations on ``slow_link()``, where SFB wins for the hidden layers (not the small head; with
    ``compression``, the lossy path may win instead): the last iteration's bytes (every path's) and each
    bucket's path."""
    torch.manual_seed(0)
    spec = ModelSpec(widths=(48, 40, 24), batchnorm=False)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, trace_dir=trace_dir, trace_skip=SKIP, trace_iters=STEPS - SKIP,
                          link=slow_link(), hybrid=hybrid, fusion_bytes=0,
                          compression={compression: {"start_iter": 1}} if compression == "powersgd" else compression)
    for step in range(STEPS):
        x, y = batch(spec, step, rows, world_size)
        F.mse_loss(wrapped(shard(x, rank, rows)), shard(y, rank, rows)).backward()
    stats = wrapped.comm_stats
    result = {"bytes": sum(sent for path, sent in stats.bytes_by_path.items() if path != "facts"),
              "outcomes": dict(stats.outcome_by_bucket),
              # what the coordinator timed its plans with (with compression=: its checkpoint state carries it)
              "ready_s": wrapped.consistency_state_dict().get("coordinator", {}).get("ready_s")}
    wrapped.close()  # waits for the trace files
    return result



class _DoubleHead(torch.nn.Module):
    """An fp32 layer, then an fp64 head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.body(x)).double())


def traced_mixed_dtypes(rank: int, world_size: int, trace_dir: str) -> None:
    """A traced model whose head is fp64 behind an fp32 layer (the trace's one element size is fp32's)."""
    torch.manual_seed(0)
    wrapped = PoseidonDDP(_DoubleHead(), timeout=60, trace_dir=trace_dir, trace_skip=1, trace_iters=2)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g, dtype=torch.float64)
        F.mse_loss(wrapped(x), y).backward()
    wrapped.close()
