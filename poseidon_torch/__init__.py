"""poseidon-torch: the Poseidon communication architecture (USENIX ATC 2017) for PyTorch.

Module map (one per concept of the paper):
- ``ddp``: ``PoseidonDDP``, the drop-in wrapper for torch DDP;
- ``wfbp``: the wait-free backprop engine (hooks, dispatch, barrier wait);
- ``syncer``: layers and their fusion into syncers;
- ``kvstore``: the sharded parameter-server path;
- ``barrier``: the BSP counter barrier;
- ``pools``: sync threads (each with its own process groups) and CUDA streams;
- ``replicas``: start-up consistency checks and rank-0 broadcasts;
- ``sfb``: sufficient-factor broadcast for fully connected layers, and ``register_fc``;
- ``coordinator``: the per-layer cost model that picks PS or SFB;
- ``tracer`` / ``spans`` / ``tracefile`` / ``overlap`` / ``trace``: recording and reading traces.
"""
from .barrier import SyncError, SyncTimeout
from .coordinator import LinkModel, Plan
from .ddp import PoseidonDDP
from .replicas import ModelMismatchError
from .sfb import register_fc
from .wfbp import CommStats

__all__ = ["PoseidonDDP", "register_fc", "LinkModel", "Plan", "SyncError", "SyncTimeout",
           "ModelMismatchError", "CommStats"]
