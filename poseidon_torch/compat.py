"""torch DDP's constructor arguments, and what each one means for PoseidonDDP.

Code and frameworks (Lightning, accelerate) construct ``DistributedDataParallel(module, device_ids=...,
find_unused_parameters=..., **kwargs)``; swapping the class name must work. Every argument of torch
2.13's DDP is taken, in DDP's positional order, and resolved here once:
- *honoured* where PoseidonDDP has the same notion: ``broadcast_buffers`` / ``forward_sync_buffers``
  (buffers follow rank 0 at every synced forward), ``init_sync`` (rank 0's state at construction),
  ``process_group`` / ``device_mesh`` (the ranks to train over), ``bucket_cap_mb`` (the fusion cap, and
  where a compiled graph is cut), ``device_ids`` / ``output_device`` (checked against the module's
  device, as DDP does);
- *accepted with a one-time note* where PoseidonDDP needs no flag (``find_unused_parameters=True``,
  ``static_graph``, ``gradient_as_bucket_view``, ...): the behaviour they ask for is PoseidonDDP's own;
- *refused* with a ``ValueError`` naming the argument where PoseidonDDP has nothing equivalent
  (``delay_all_reduce_named_params``, ``mixed_precision``).
Invariant: resolution is local and deterministic, so every rank resolves the same arguments the same
way before any collective.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024 * 1024

#: argument -> why PoseidonDDP needs no such flag (said once per process, on the group's rank 0)
NOT_NEEDED = {
    "find_unused_parameters": "PoseidonDDP finds the parameters no rank used in every pass by itself",
    "static_graph": "PoseidonDDP learns its buckets from the first backward and supports reentrant backwards "
                    "and activation checkpointing without it",
    "gradient_as_bucket_view": ".grad is not a view of the sync buffers (the engine copies into them, as DDP "
                               "does without this flag): it saves no memory here",
    "skip_all_reduce_unused_params": "PoseidonDDP sends zeros for a parameter a rank did not use, as DDP does "
                                     "by default; the flag has no effect",
    "batched_grad_copy": "PoseidonDDP copies each bucket's gradients in one pass already",
    "check_reduction": "deprecated in torch DDP; no effect",
}
_noted: set[str] = set()


@dataclass(frozen=True)
class DDPArguments:
    """torch DDP's constructor arguments as given (defaults are DDP's)."""

    device_ids: Any = None
    output_device: Any = None
    dim: int = 0
    broadcast_buffers: bool | None = None
    init_sync: bool = True
    process_group: Any = None
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    delay_all_reduce_named_params: Any = None
    param_to_hook_all_reduce: Any = None
    mixed_precision: Any = None
    device_mesh: Any = None
    skip_all_reduce_unused_params: bool = False
    bucket_cap_mb_list: Any = None
    batched_grad_copy: bool = False
    forward_sync_buffers: bool | None = None

    def __post_init__(self) -> None:
        for name in ("delay_all_reduce_named_params", "param_to_hook_all_reduce"):
            if getattr(self, name) is not None:
                raise ValueError(f"PoseidonDDP does not support {name} (torch DDP's delayed all-reduce of chosen "
                                 "parameters): every parameter syncs as soon as its bucket is ready")
        if self.mixed_precision is not None:
            raise ValueError("PoseidonDDP does not support mixed_precision (torch DDP's experimental reduced-precision "
                             "parameter copies); keep half-precision parameters in the module, or use torch.autocast")
        if self.device_mesh is not None and self.process_group is not None:
            raise ValueError("pass either process_group or device_mesh, not both (as torch DDP)")
        if self.device_mesh is not None and self.device_mesh.ndim != 1:
            raise ValueError(f"PoseidonDDP needs a 1-D device_mesh, got {self.device_mesh.ndim} dimensions")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"dim must be an int, got {self.dim!r}")
        for name in ("bucket_cap_mb",):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a number of MiB >= 0, got {value!r}")

    @property
    def fusion_bytes(self) -> int | None:
        """The fusion cap, from ``bucket_cap_mb`` (or the largest of ``bucket_cap_mb_list``)."""
        if self.bucket_cap_mb_list:
            return int(max(self.bucket_cap_mb_list) * MIB)
        return None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * MIB)

    @property
    def buffers_follow_rank0(self) -> bool:
        """DDP 2.13: ``forward_sync_buffers`` wins, then the deprecated ``broadcast_buffers``, then True."""
        if self.forward_sync_buffers is not None:
            return self.forward_sync_buffers
        return True if self.broadcast_buffers is None else self.broadcast_buffers

    @property
    def group(self) -> Any:
        if self.device_mesh is not None:
            return self.device_mesh.get_group()
        return self.process_group

    def check_device(self, device: torch.device) -> None:
        """As torch DDP: ``device_ids`` and ``output_device`` only for a single-device CUDA module, and then
        naming that device."""
        if device.type != "cuda":
            if self.device_ids or self.output_device is not None:
                raise ValueError(f"device_ids and output_device only work with CUDA modules (as torch DDP); the module "
                                 f"is on {device}, got device_ids={self.device_ids}, output_device={self.output_device}")
            return
        if self.device_ids is not None:
            ids = [torch.device("cuda", i) if isinstance(i, int) else torch.device(i) for i in self.device_ids]
            if ids != [device]:
                raise ValueError(f"device_ids={list(self.device_ids)} but the module's parameters are on {device}: "
                                 "PoseidonDDP trains one device per process (move the module, or pass "
                                 f"device_ids=[{device.index}])")
        if self.output_device is not None:
            out = torch.device("cuda", self.output_device) if isinstance(self.output_device, int) else \
                torch.device(self.output_device)
            if out != device:
                raise ValueError(f"output_device={self.output_device!r} but the module is on {device}: outputs stay on "
                                 "the module's device")

    def note_unneeded(self, rank: int) -> None:
        """Say once per process (on the group's rank 0) which given flags PoseidonDDP needs not."""
        given = [name for name in NOT_NEEDED if getattr(self, name)]
        for name in given:
            if rank == 0 and name not in _noted:
                _noted.add(name)
                warnings.warn(f"PoseidonDDP: {name}={getattr(self, name)!r} accepted: {NOT_NEEDED[name]}", stacklevel=4)
