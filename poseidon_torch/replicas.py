"""Replica consistency at start-up and for buffers: every rank trains the same model from rank 0's state.

Invariants:
- ``check_same_model`` raises the same :class:`ModelMismatchError` on every rank (all ranks see every
  rank's signature), so a mismatch never leaves one rank waiting in a collective;
- ``broadcast_from`` overwrites the given tensors with one rank's values, one collective per dtype;
  ``average_into`` with their average over the ranks (a periodic mode's buffers);
  ``BroadcastInFlight`` sends the values they have when it starts and never writes the sender's.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .pools import Collectives


class ModelMismatchError(RuntimeError):
    """Ranks disagree on the model (parameter names, shapes, dtypes) or on PoseidonDDP's options."""


def model_signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]


def check_same_model(module: nn.Module, options: object, control: Collectives) -> None:
    """Raise the same :class:`ModelMismatchError` on every rank if the ranks' models or options differ."""
    everyone = control.all_gather_objects((model_signature(module), options))
    for rank in range(1, control.size):
        problem = _first_difference(everyone[0], everyone[rank], rank)
        if problem:
            raise ModelMismatchError(f"PoseidonDDP: ranks 0 and {rank} disagree: {problem}")


def _first_difference(ref, other, rank: int) -> str | None:
    (ref_params, ref_opts), (params, opts) = ref, other
    for i, (a, b) in enumerate(zip(ref_params, params)):
        if a != b:
            return (f"parameter #{i} is {a[0]!r} {a[1]} {a[2]} on rank 0 "
                    f"but {b[0]!r} {b[1]} {b[2]} on rank {rank}")
    if len(ref_params) != len(params):
        longer, which = (ref_params, 0) if len(ref_params) > len(params) else (params, rank)
        extra = longer[min(len(ref_params), len(params))][0]
        return (f"rank 0 has {len(ref_params)} parameters, rank {rank} has {len(params)} "
                f"(first extra: {extra!r} on rank {which})")
    if ref_opts != opts:
        return f"PoseidonDDP options differ: {ref_opts} on rank 0 vs {opts} on rank {rank}"
    return None


def broadcast_from(tensors: Iterable[torch.Tensor], data: Collectives, staged: bool, src: int) -> None:
    """Overwrite ``tensors`` with the values of rank ``src``, one collective per dtype and device;
    ``staged`` sends device tensors through host memory."""
    tensors = list(tensors)
    BroadcastInFlight(tensors, data, staged, src).land(tensors)


def average_into(tensors: Sequence[torch.Tensor], collectives: Collectives) -> None:
    """Replace ``tensors`` by their average over the ranks, summed on the host (half precision in fp32), two
    collectives per dtype and device: every rank ends with the same values, and a value the same on every
    rank is kept bit for bit (rank 0's value plus the mean of the differences from it: a buffer that never
    changes, such as rotary frequencies, does not drift by the rounding of sum / P)."""
    with torch.no_grad():
        for kind_tensors in _by_kind(tensors).values():
            wide = torch.float32 if kind_tensors[0].element_size() < 4 else kind_tensors[0].dtype
            flat = torch.cat([t.detach().reshape(-1).to("cpu", wide) for t in kind_tensors])
            reference = flat.clone()
            collectives.broadcast(reference, 0)
            collectives.all_reduce(flat.sub_(reference))
            _unflatten_into(kind_tensors, flat.div_(collectives.size).add_(reference))


class BroadcastInFlight:
    """Rank ``src``'s values of ``tensors`` as they are now, sent (one collective per dtype and device)
    while the caller goes on; :meth:`land` waits for them and, on the other ranks, writes them into the
    tensors given then (a module may have replaced its buffers meanwhile), when those have the layout
    that was sent. Rank ``src``'s own tensors are never written."""

    def __init__(self, tensors: Iterable[torch.Tensor], data: Collectives, staged: bool, src: int) -> None:
        self._receives = data.rank != src
        self._parts = []
        with torch.no_grad():
            for kind_tensors in _by_kind(tensors).values():
                flat = torch.cat([t.detach().reshape(-1) for t in kind_tensors])
                wire = flat.cpu() if staged else flat
                self._parts.append((_layout(kind_tensors), wire, data.start_broadcast(wire, src)))

    def wait(self) -> None:
        """Wait for the values to be sent and received (nothing is written)."""
        for _, _, work in self._parts:
            work.wait()

    def land(self, into: Iterable[torch.Tensor]) -> None:
        """Wait for the values; write them into ``into`` unless this rank sent them, or ``into`` is laid
        out differently from what was sent (a buffer changed shape or dtype: nothing is written)."""
        self.wait()
        targets = list(_by_kind(into).values())
        if self._receives and [_layout(t) for t in targets] == [layout for layout, _, _ in self._parts]:
            for tensors, (_, wire, _) in zip(targets, self._parts):
                _unflatten_into(tensors, wire)


def _by_kind(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    return by_kind


def _layout(tensors: Sequence[torch.Tensor]) -> tuple:
    return tensors[0].dtype, tensors[0].device, tuple(t.shape for t in tensors)


def _unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
