"""poseidon-torch: the Poseidon communication architecture (USENIX ATC 2017) for PyTorch.

Module map (one per concept of the paper):
- ``ddp``: ``PoseidonDDP``, the drop-in wrapper for torch DDP (options, forward, no_sync, join);
- ``engine``: wait-free backprop: hooks -> ready -> channel -> ``path.sync(bucket)`` -> barrier, and
  the per-iteration state machine;
- ``bucket``: buckets (the syncers) and how layers are grouped into them;
- ``kvstore``: the sharded parameter-server path (``PSPath``);
- ``server``: the shards' side of it: optimizer state and the update at the owner (``ServerOptimizer``);
- ``sfb``: sufficient-factor broadcasting for fully connected layers (``SFBPath``), ``register_fc``;
- ``coordinator``: the per-layer choice of path and its cost model; ``link``: the probes it uses;
- ``barrier``: the BSP counter barrier;
- ``pools``: sync channels (one thread + its process groups each) and CUDA streams;
- ``replicas``: start-up consistency checks and broadcasts;
- ``trace``: the tracer (recording, files, summary, plot, CLI);
- ``env``: the ``POSEIDON_*`` environment variables.
"""
from .barrier import SyncError, SyncTimeout
from .coordinator import Plan
from .ddp import PoseidonDDP
from .engine import CommStats
from .link import LinkModel
from .replicas import ModelMismatchError
from .optimizer import ServerOptimizer
from .fc import register_fc

__all__ = ["PoseidonDDP", "ServerOptimizer", "register_fc", "LinkModel", "Plan", "SyncError", "SyncTimeout",
           "ModelMismatchError", "CommStats"]
