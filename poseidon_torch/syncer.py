"""Syncers: the unit of wait-free backprop, one per layer, small adjacent layers fused.

A *layer* is a module that directly owns trainable parameters. Layers are taken in reverse registration
order (the usual backward order), and adjacent small layers are fused into one syncer up to
``fusion_bytes`` so biases and norms do not each pay a network round trip; a layer larger than the
threshold is a syncer of its own so its sync can start as soon as its gradient is ready.

Invariants:
- every trainable parameter belongs to exactly one syncer (a parameter shared by several modules goes to
  the first module that registers it);
- all parameters of a syncer share one dtype and device, so they fit one flat buffer;
- the flat buffer holds the gradients back to back, then one *used flag* per parameter (1 where this rank
  produced a gradient this iteration). After averaging, a flag > 0 means some rank used the parameter; a
  parameter no rank used keeps its ``.grad`` untouched, as with torch DDP.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Layer:
    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]  # (qualified name, parameter)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params)


@dataclass
class Syncer:
    index: int
    layers: list[Layer]
    params: list[nn.Parameter] = field(init=False)
    param_names: list[str] = field(init=False)
    offsets: list[int] = field(init=False)
    grad_numel: int = field(init=False)

    def __post_init__(self) -> None:
        named = [np for layer in self.layers for np in layer.params]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.grad_numel = offset

    @property
    def name(self) -> str:
        return "+".join(layer.name for layer in self.layers)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer: the gradients and one used flag per parameter."""
        return self.grad_numel + len(self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def new_flat_buffer(self, pin_memory: bool) -> torch.Tensor:
        device = torch.device("cpu") if pin_memory else self.device
        return torch.zeros(self.numel, dtype=self.dtype, device=device, pin_memory=pin_memory)

    def gather_grads(self, flat: torch.Tensor, used: list[bool]) -> None:
        """Copy this rank's gradients (zeros where unused) and the used flags into ``flat``."""
        for p, offset, is_used in zip(self.params, self.offsets, used):
            piece = flat[offset:offset + p.numel()]
            if is_used and p.grad is not None:
                piece.copy_(p.grad.reshape(-1), non_blocking=True)
            else:
                piece.zero_()
        flags = torch.tensor([1.0 if u else 0.0 for u in used], dtype=flat.dtype)
        flat[self.grad_numel:].copy_(flags, non_blocking=True)

    def scatter_grads(self, flat: torch.Tensor) -> None:
        """Write the averaged gradients back into ``.grad`` of every parameter some rank used."""
        used_anywhere = (flat[self.grad_numel:] > 0).tolist()
        for p, offset, used in zip(self.params, self.offsets, used_anywhere):
            if not used:
                continue
            averaged = flat[offset:offset + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(averaged, non_blocking=True)


def find_layers(module: nn.Module) -> list[Layer]:
    """Modules owning trainable parameters directly, in registration order, each parameter once."""
    seen: set[int] = set()
    layers = []
    for mod_name, mod in module.named_modules():
        params = []
        for p_name, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((f"{mod_name}.{p_name}" if mod_name else p_name, p))
        if params:
            layers += _split_by_dtype_and_device(mod_name or "<root>", mod, params)
    return layers


def _split_by_dtype_and_device(name: str, module: nn.Module,
                               params: list[tuple[str, nn.Parameter]]) -> Iterator[Layer]:
    kinds: dict[tuple, list] = {}
    for np in params:
        kinds.setdefault((np[1].dtype, np[1].device), []).append(np)
    for group in kinds.values():
        yield Layer(name, module, group)


def build_syncers(module: nn.Module, fusion_bytes: int) -> list[Syncer]:
    """Syncers in expected backward order; adjacent small layers fused up to ``fusion_bytes``."""
    groups: list[list[Layer]] = []
    for layer in reversed(find_layers(module)):
        last = groups[-1] if groups else None
        if last is not None and _can_fuse(last, layer, fusion_bytes):
            last.append(layer)
        else:
            groups.append([layer])
    return [Syncer(i, layers) for i, layers in enumerate(groups)]


def _can_fuse(group: list[Layer], layer: Layer, fusion_bytes: int) -> bool:
    head = group[0].params[0][1]
    new = layer.params[0][1]
    same_kind = (head.dtype, head.device) == (new.dtype, new.device)
    return same_kind and sum(g.nbytes for g in group) + layer.nbytes <= fusion_bytes
