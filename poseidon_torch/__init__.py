"""poseidon-torch: the Poseidon communication architecture (USENIX ATC 2017) for PyTorch.

Module map (one per concept of the paper):
- ``ddp``: ``PoseidonDDP``, the drop-in wrapper for torch DDP (options, forward, no_sync, join); it
  starts the engine with the mode resolved once;
- ``engine``: wait-free backprop: hooks -> ready -> channel -> a bucket's job -> barrier, and the
  per-iteration state machine; it names no mode and no path;
- ``modes/``: the consistency models, one module each (``bsp``, ``pipe_sgd``, ``server``, ``ssp``,
  ``periodic``: local SGD and DiLoCo), the named points the engine calls (``base``) and the one place a
  wrapper's mode is chosen (``resolve``);
- ``paths/``: the ways a bucket's gradient moves, one module each (``ps``: the sharded parameter-server
  path, the default; ``sfb``: sufficient-factor broadcasting), their registry, and ``update``: the
  parameter-server update composed with any path;
- ``bucket``: buckets (the syncers) and how layers are grouped into them;
- ``fc``: fully connected layers and their sufficient factors, ``register_fc``;
- ``server``: the shards: optimizer state and the update at the owner; ``stale``: SSP's server threads;
- ``optimizer``: ``ServerOptimizer``, the user's optimizer run by the shards;
- ``coordinator``: the per-layer choice of path and its cost model; ``link``: the probes it uses;
- ``stats``: bytes per path per iteration (``CommStats``);
- ``barrier``: the counter barrier; ``core``: the hot path (Python, or native in ``csrc/``);
- ``pools``: sync channels (one thread + its process groups each) and CUDA streams;
- ``replicas``: start-up consistency checks and broadcasts;
- ``trace``: the tracer (recording, files, summary, plot, CLI); ``simulate``: the scaling simulator;
- ``env``: the ``POSEIDON_*`` environment variables; ``extras``: what the optional extras bring;
- ``bench``: the benchmark harness (the ``[bench]`` extra).
"""
from .barrier import SyncError, SyncTimeout
from .coordinator import Plan
from .ddp import PoseidonDDP
from .stats import CommStats
from .link import LinkModel
from .replicas import ModelMismatchError
from .optimizer import ServerOptimizer
from .fc import register_fc
from .modes import DILOCO_OUTER

__all__ = ["PoseidonDDP", "ServerOptimizer", "register_fc", "LinkModel", "Plan", "SyncError", "SyncTimeout",
           "ModelMismatchError", "CommStats", "DILOCO_OUTER"]
