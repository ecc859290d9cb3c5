"""``PoseidonDDP``: a drop-in for ``torch.nn.parallel.DistributedDataParallel`` on the Poseidon engine.

After ``torch.distributed.init_process_group``, wrap the model; the user's own loss, ``backward()`` and
optimizer stay as they are. When ``backward()`` returns, every trainable parameter's ``.grad`` holds the
average over all ranks (BSP). Invariants:
- construction checks that all ranks have the same parameters and protocol options, then copies rank 0's
  parameters and buffers to every rank; with ``broadcast_buffers`` each training forward does it again
  for buffers (BatchNorm statistics follow rank 0, as in DDP);
- ``state_dict()`` / ``load_state_dict()`` carry the ``module.`` prefix exactly as DDP's do;
- inside ``no_sync()`` gradients accumulate locally; the first backward after it syncs the sum.
"""
from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .barrier import SyncError
from .coordinator import Coordinator, LayerInfo, LinkModel, Plan, probe_gemm_flops, probe_link
from .pools import ChannelGroups
from .replicas import broadcast_from_rank0, check_same_model
from .sfb import SFBLayer, sfb_layers
from .syncer import build_syncers
from .tracer import Recorder, TraceConfig
from .wfbp import CommStats, WFBPEngine

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
DEFAULT_FUSION_BYTES = 256 * 1024
DEFAULT_NUM_CHANNELS = 2


def _from_env(value: int | None, name: str, default: int) -> int:
    """An option given in code wins; else ``POSEIDON_<NAME>`` from the environment; else the default."""
    if value is not None:
        return value
    text = os.environ.get(f"POSEIDON_{name}", "").strip()
    return int(text) if text else default



class PoseidonDDP(nn.Module):
    """Wrap ``module`` for data-parallel training with wait-free backprop and a sharded PS.

    Args:
        module: the model, already on its device (CPU, or one CUDA device per process).
        chunk_bytes: size of the pieces the gradient space is cut into for the KV store shards
            (default 2 MiB, or ``POSEIDON_CHUNK_BYTES``).
        fusion_bytes: adjacent layers smaller than this together are synced as one job (default
            256 KiB, or ``POSEIDON_FUSION_BYTES``).
        num_channels: sync threads, each with its own process groups (default 2, or
            ``POSEIDON_NUM_CHANNELS``).
        timeout: seconds any wait may take before the step fails (dead or stuck peer).
        broadcast_buffers: copy rank 0's buffers to every rank at each training forward, as DDP does.
        process_group: the group to train over (default: the world).
        hybrid: let the coordinator send fully connected layers through SFB where that is cheaper;
            False sends every layer through the PS path.
        overrides: force a path per layer, e.g. ``{"classifier.0": "SFB", "fc2": "PS"}``.
        link: the network's alpha-beta model for the cost model (default: probed at start-up, or
            ``POSEIDON_BANDWIDTH_GBPS`` / ``POSEIDON_LATENCY_US``).
        trace_dir, trace_skip, trace_iters: switch the tracer on (see ``poseidon_torch.tracer``).
    """

    def __init__(self, module: nn.Module, *, chunk_bytes: int | None = None,
                 fusion_bytes: int | None = None, num_channels: int | None = None,
                 timeout: float = 300.0, broadcast_buffers: bool = True,
                 process_group: Any = None, hybrid: bool = True,
                 overrides: dict[str, str] | None = None, link: LinkModel | None = None,
                 trace_dir: str | None = None, trace_skip: int | None = None,
                 trace_iters: int | None = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("PoseidonDDP needs torch.distributed.init_process_group() to be called first")
        chunk_bytes = _from_env(chunk_bytes, "CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
        fusion_bytes = _from_env(fusion_bytes, "FUSION_BYTES", DEFAULT_FUSION_BYTES)
        num_channels = _from_env(num_channels, "NUM_CHANNELS", DEFAULT_NUM_CHANNELS)
        if num_channels < 1 or timeout <= 0 or chunk_bytes <= 0 or fusion_bytes < 0:
            raise ValueError(f"invalid options: num_channels={num_channels}, timeout={timeout}, "
                             f"chunk_bytes={chunk_bytes}, fusion_bytes={fusion_bytes}")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._require_sync = True
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.rank, self.world_size = ranks.index(dist.get_rank()), len(ranks)
        deadline = timedelta(seconds=timeout)
        self._control = dist.new_group(ranks, timeout=deadline, backend="gloo")
        trace = TraceConfig.resolve(trace_dir, trace_skip, trace_iters)
        if overrides and not hybrid:
            raise ValueError("per-layer path overrides need hybrid=True")
        options = {"chunk_bytes": chunk_bytes, "fusion_bytes": fusion_bytes, "num_channels": num_channels,
                   "broadcast_buffers": broadcast_buffers, "trace": trace is not None, "hybrid": hybrid,
                   "overrides": sorted((overrides or {}).items()), "link": link}
        check_same_model(module, options, self._control)
        device = _single_device(module)
        backend = dist.get_backend(process_group)
        self._staged = device.type == "cuda" and backend == "gloo"
        self._data = dist.new_group(ranks, timeout=deadline, backend=backend)
        broadcast_from_rank0(list(module.parameters()) + list(module.buffers()), self._data, self._staged)
        channel_groups = [ChannelGroups.create(ranks, backend, deadline) for _ in range(num_channels)]
        self.recorder = Recorder(trace, self.rank, self.world_size, self._control)
        self.syncers = build_syncers(module, fusion_bytes)
        fc_layers = sfb_layers(self.syncers, module) if hybrid and self.world_size > 1 else {}
        coordinator = self._coordinator(fc_layers, overrides, link, device) if fc_layers else None
        if overrides and coordinator is None:
            raise ValueError(f"overrides {overrides} given, but no layer can take the SFB path")
        self._engine = WFBPEngine(self.syncers, channel_groups, self.rank, self.world_size, chunk_bytes,
                                  timeout, self._staged, self.recorder, fc_layers, coordinator)

    def _coordinator(self, fc_layers: dict[int, SFBLayer], overrides: dict[str, str] | None,
                     link: LinkModel | None, device: torch.device) -> Coordinator:
        wire_device = "cpu" if self._staged else device
        link = link or probe_link(self._data, device=wire_device)
        gemm = probe_gemm_flops(device, self._data)
        layers = [LayerInfo.of_syncer(s, fc_layers.get(s.index)) for s in self.syncers]
        return Coordinator(layers, sorted(fc_layers), self.world_size, link, gemm, overrides)

    @property
    def plan(self) -> Plan | None:
        """Per layer: type, shape, K, chosen path, predicted bytes and time of each path (``print`` it).
        None until the first forward, or when no layer can take the SFB path."""
        coordinator = self._engine.coordinator
        return coordinator.plan if coordinator is not None else None

    @property
    def comm_stats(self) -> CommStats:
        return self._engine.stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        failure = self._engine.barrier.failure
        if failure is not None:
            raise SyncError(f"PoseidonDDP cannot continue after a failed sync: {failure}") from failure
        armed = torch.is_grad_enabled() and self._require_sync
        self._engine.begin_forward(armed)
        if armed:
            self.recorder.start_iteration()
        start = time.monotonic_ns()
        if self.broadcast_buffers and self.module.training and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_from_rank0(buffers, self._data, self._staged)
        try:
            output = self.module(*args, **kwargs)
        finally:
            self._engine.end_forward()
        if armed:
            self._engine.plan_iteration(self._control)
        if self.recorder.active:
            self.recorder.add("forward", "forward", "compute", start, time.monotonic_ns())
            _on_first_grad(output, self._engine.mark_backward_start)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally in this context; the next backward outside it syncs them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def close(self) -> None:
        """Stop the sync threads and finish writing a trace (also done when the process exits)."""
        self._engine.close()
        self.recorder.flush()


def _single_device(module: nn.Module) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"PoseidonDDP needs all parameters on one device, found {sorted(map(str, devices))}")
    return devices.pop()


def _on_first_grad(output: Any, callback) -> None:
    """Call ``callback`` when backward produces the gradient of the first tensor output that needs one."""
    tensors = output if isinstance(output, (tuple, list)) else [output]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: callback())
            return
