"""Sufficient-factor broadcasting (SFB) for fully connected layers.

Job: for an FC layer ``y = x W^T + b`` (W is M x N) the weight gradient over a batch of K samples is
``dW = U^T V`` with U (K x M) the output gradients and V (K x N) the inputs, and ``db = U.sum(0)``.
This module declares which module classes are FC (:func:`register_fc`, :func:`fc_spec`), records each
rank's factors during forward/backward (:class:`FactorCapture`), all-gathers them
(:func:`gather_factors`) and rebuilds the exact rank-averaged gradient with one matrix product
(:func:`rebuild_gradients`).

Invariants:
- A module is FC only if its exact class is registered: a subclass of ``nn.Linear`` may override
  ``forward``, so it is not FC until someone registers it.
- Capture holds no memory beyond what autograd already keeps alive: the input is kept as a detached
  reference (autograd saves it anyway to compute dW) and only when the weight requires grad; the
  output gradient is the tensor autograd hands to the layer's backward. Reshaping to (K, N) / (K, M)
  happens lazily in :meth:`FactorCapture.local_factors`.
- Factors are released after use: the owner calls :meth:`FactorCapture.clear` once the factors are
  sent; after ``clear()`` the capture references no tensor.
- Every leading position of an input with more than two dimensions is a sample (K = product of the
  leading dimensions); every call of the module in one forward contributes its own samples.
- Activation checkpointing re-runs forward hooks during backward and is not supported.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .syncer import Syncer

@dataclass(frozen=True)
class FCSpec:
    """How to read an FC module: ``y = x W^T + b`` with W (M x N), or ``y = x W + b`` with W (N x M)
    when ``transposed``. ``bias`` is None when the module (or this instance) has no bias; the input is
    the positional forward argument ``input_arg``."""

    weight: str = "weight"
    bias: str | None = "bias"
    input_arg: int = 0
    transposed: bool = False

    def weight_of(self, module: nn.Module) -> Tensor:
        return getattr(module, self.weight)

    def out_features(self, module: nn.Module) -> int:
        """M, the number of outputs."""
        shape = self.weight_of(module).shape
        return shape[1] if self.transposed else shape[0]

    def in_features(self, module: nn.Module) -> int:
        """N, the number of inputs."""
        shape = self.weight_of(module).shape
        return shape[0] if self.transposed else shape[1]


_REGISTRY: dict[type[nn.Module], FCSpec] = {}


def register_fc(
    module_type: type[nn.Module],
    *,
    weight: str = "weight",
    bias: str | None = "bias",
    input_arg: int = 0,
    transposed: bool = False,
) -> None:
    """Declare ``module_type`` (exactly this class, not its subclasses) as a fully connected layer."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_fc expects an nn.Module subclass, got {module_type!r}")
    _REGISTRY[module_type] = FCSpec(weight, bias, input_arg, transposed)


def fc_spec(module: nn.Module) -> FCSpec | None:
    """The FC spec of ``module`` (exact type lookup), or None if it is not a registered FC layer.

    The returned spec has ``bias=None`` when this instance's bias attribute is None
    (e.g. ``nn.Linear(..., bias=False)``)."""
    spec = _REGISTRY.get(type(module))
    if spec is not None and spec.bias is not None and getattr(module, spec.bias, None) is None:
        return replace(spec, bias=None)
    return spec


register_fc(nn.Linear)


@dataclass
class _Use:
    """One call of the module: its input and, once backward reached it, its output gradient."""

    input: Tensor
    grad_output: Tensor | None = None


def _cat_rows(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class FactorCapture:
    """Records the sufficient factors (output gradients U, inputs V) of one FC module.

    A forward hook keeps the input of every call made with grad enabled whose output requires grad, and
    registers a hook on that output which stores its gradient when backward reaches it."""

    def __init__(self, module: nn.Module, spec: FCSpec) -> None:
        self._module = module
        self._spec = spec
        self._weight = spec.weight_of(module)  # the parameter itself, even while SFBLayer detaches it
        self._uses: list[_Use] = []
        self.enabled = True  #: off while gradients only accumulate locally (no_sync)
        self.on_complete: Callable[[], None] | None = None  #: called once every call has its U
        self._handle: RemovableHandle | None = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        # output.requires_grad implies grad mode; a frozen weight means autograd keeps no input for dW.
        if not self.enabled or not (isinstance(output, Tensor) and output.requires_grad):
            return
        if not self._weight.requires_grad:
            return
        if len(args) <= self._spec.input_arg:
            raise RuntimeError(
                f"{type(module).__name__}: FC input is positional argument {self._spec.input_arg}, "
                f"but forward got {len(args)} positional argument(s)"
            )
        x = args[self._spec.input_arg]
        m, n = self._spec.out_features(module), self._spec.in_features(module)
        if x.shape[-1] != n or output.shape[-1] != m:
            raise RuntimeError(
                f"{type(module).__name__} is registered as FC with M={m}, N={n}, but a call mapped "
                f"{tuple(x.shape)} to {tuple(output.shape)}"
            )
        use = _Use(x.detach())
        self._uses.append(use)
        output.register_hook(lambda grad: self._store(use, grad))

    def _store(self, use: _Use, grad: Tensor) -> None:
        use.grad_output = grad
        if self.on_complete is not None and all(u.grad_output is not None for u in self._uses):
            self.on_complete()

    @property
    def num_samples(self) -> int:
        """K recorded in forward, summed over the calls of the module."""
        n = self._spec.in_features(self._module)
        return sum(use.input.numel() // n for use in self._uses)

    def local_factors(self) -> tuple[Tensor, Tensor]:
        """(U, V): U (K x M) the output gradients, V (K x N) the inputs, concatenated over calls in
        forward order, in their promoted dtype. A call whose output got no gradient (not part of the
        loss) contributed nothing to dW and is left out. Call it once backward is past the layer."""
        m, n = self._spec.out_features(self._module), self._spec.in_features(self._module)
        reached = [use for use in self._uses if use.grad_output is not None]
        if not reached:
            weight = self._spec.weight_of(self._module)
            return weight.new_empty((0, m)), weight.new_empty((0, n))
        u = _cat_rows([use.grad_output.reshape(-1, m) for use in reached])
        v = _cat_rows([use.input.reshape(-1, n) for use in reached])
        dtype = torch.promote_types(u.dtype, v.dtype)
        return u.to(dtype), v.to(dtype)

    def clear(self) -> None:
        """Drop every recorded input and output gradient."""
        self._uses = []

    def remove(self) -> None:
        """Remove the forward hook and drop what was recorded."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.clear()


def rebuild_gradients(
    u_all: Tensor, v_all: Tensor, world_size: int, spec: FCSpec
) -> tuple[Tensor, Tensor | None]:
    """The rank-averaged gradient from all ranks' factors: ``grad_W = U^T V / P`` (M x N; its transpose
    N x M for transposed specs) with one matrix product, and ``grad_b = U.sum(0) / P`` if the spec has
    a bias, else None."""
    u_scaled = u_all / world_size
    grad_w = v_all.t() @ u_scaled if spec.transposed else u_scaled.t() @ v_all
    grad_b = u_scaled.sum(0) if spec.bias is not None else None
    return grad_w, grad_b


def sfb_bytes_per_rank(k: int, m: int, n: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in :func:`gather_factors`, K being the largest K over the ranks.

    A ring all-gather of P blocks sends P-1 blocks per rank; a block is K x (M + N) values, padded to
    the largest K: ``(P - 1) * K * (M + N) * element_size``. (The K's themselves travel once per
    iteration for all FC layers together, in the coordinator's exchange.)"""
    return (world_size - 1) * k * (m + n) * element_size


def gather_factors(
    u: Tensor, v: Tensor, counts: list[int], group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor, int]:
    """All-gather every rank's factors (U: K x M, V: K x N; rank r has ``counts[r]`` rows, known to
    every rank beforehand) as one padded packed tensor K_max x (M + N) per rank, in one collective.
    Returns (U_all, V_all, bytes sent by this rank), rows in rank order, padding stripped; the bytes
    follow :func:`sfb_bytes_per_rank`."""
    if u.shape[0] != v.shape[0] or u.dtype != v.dtype or u.device != v.device:
        raise ValueError(
            f"U and V must have the same rows, dtype and device: {tuple(u.shape)} {u.dtype} {u.device}"
            f" vs {tuple(v.shape)} {v.dtype} {v.device}"
        )
    world_size = dist.get_world_size(group)
    (k, m), n = u.shape, v.shape[1]
    if counts[dist.get_rank(group)] != k:
        raise ValueError(f"this rank has {k} factor rows but announced {counts[dist.get_rank(group)]}")
    k_max = max(counts)
    packed = u.new_zeros((k_max, m + n))
    packed[:k, :m] = u
    packed[:k, m:] = v
    blocks = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(blocks, packed, group=group)
    u_all = torch.cat([block[:count, :m] for block, count in zip(blocks, counts)])
    v_all = torch.cat([block[:count, m:] for block, count in zip(blocks, counts)])
    return u_all, v_all, sfb_bytes_per_rank(k_max, m, n, world_size, packed.element_size())



class SFBLayer:
    """The SFB path of one FC syncer: its factor capture and the sync job that replaces ``.grad`` by
    the rank average rebuilt from everyone's factors.

    ``.grad`` may already hold a value when backward accumulates into it (no ``zero_grad`` between
    iterations, or ``zero_grad(set_to_none=False)``); that value is the same on every rank, since it was
    synced. A gradient hook then keeps this backward's local contribution so the job can produce
    ``old + average(new)`` exactly as an all-reduce of the whole ``.grad`` would. Gradients accumulated
    under ``no_sync`` are NOT the same on every rank: the engine sends such a layer through the PS path.

    With ``detach_weight`` set (the layer is committed to SFB before its forward), the module sees its
    weight detached during its own calls, so autograd skips the local weight-gradient GEMM that the
    rebuild would overwrite anyway: the FC layer's gradient work is one GEMM over P K rows instead of K
    plus P K, and every rank still computes the same bits. The capture then tells the engine when the
    factors are complete (``capture.on_complete``), since no weight gradient will arrive.
    """

    def __init__(self, module: nn.Module, spec: FCSpec, params: list[nn.Parameter]) -> None:
        self.module, self.spec = module, spec
        self.weight = spec.weight_of(module)
        self.detach_weight = False
        self.capture = FactorCapture(module, spec)
        self.targets = [(p, role) for p, role in ((self.weight, "weight"),
                                                  (_bias_of(module, spec), "bias"))
                        if p is not None and any(p is q for q in params)]
        self._fresh: dict[str, Tensor] = {}  # this backward's local gradient, where .grad held a value
        self._fired: set[str] = set()  # roles that received a gradient in this backward
        self._hooks = [p.register_hook(self._keeper(p, role)) for p, role in self.targets]
        self._hooks += [module.register_forward_pre_hook(self._swap_in),
                        module.register_forward_hook(lambda *_: self.restore())]

    def _swap_in(self, module: nn.Module, args: tuple) -> None:
        if not self.detach_weight:
            return
        stand_in = self.weight.detach()
        x = args[self.spec.input_arg] if len(args) > self.spec.input_arg else None
        bias = _bias_of(module, self.spec)
        if not ((isinstance(x, Tensor) and x.requires_grad) or (bias is not None and bias.requires_grad)):
            # no other path into the graph: keep one, or the output would not get the gradient U
            stand_in.requires_grad_()
        module._parameters[self.spec.weight] = stand_in

    def restore(self) -> None:
        """Put the weight parameter back (after the module's call, or after a forward that raised)."""
        if self.module._parameters[self.spec.weight] is not self.weight:
            self.module._parameters[self.spec.weight] = self.weight

    @property
    def m(self) -> int:
        return self.spec.out_features(self.module)

    @property
    def n(self) -> int:
        return self.spec.in_features(self.module)

    def _keeper(self, param: nn.Parameter, role: str):
        def keep_if_accumulating(grad: Tensor) -> None:
            if not self.capture.enabled:
                return
            self._fired.add(role)
            if param.grad is not None:
                self._fresh[role] = grad
        return keep_if_accumulating

    def discard(self) -> None:
        """This iteration goes through the PS path: drop the factors."""
        self.capture.clear()
        self._fresh.clear()
        self._fired.clear()

    def exchange(self, counts: list[int], group, staged: bool) -> tuple[Tensor, Tensor, int]:
        """The network part: all-gather every rank's factors (U_all, V_all, bytes sent). ``counts`` are
        the K's announced at forward; a call whose output got no gradient has no factors and is sent
        as zero rows, which add nothing to U^T V or to the summed U."""
        u, v = self.capture.local_factors()
        self.capture.clear()
        missing = counts[dist.get_rank(group)] - u.shape[0]
        if missing > 0:
            u = torch.cat([u, u.new_zeros(missing, u.shape[1])])
            v = torch.cat([v, v.new_zeros(missing, v.shape[1])])
        if staged:
            u, v = u.cpu(), v.cpu()
        return gather_factors(u, v, counts, group)

    def rebuild(self, u_all: Tensor, v_all: Tensor, world_size: int) -> None:
        """The compute part: replace ``.grad`` by the rank average rebuilt from all factors."""
        if u_all.shape[0] > 0:  # else no rank used the layer: its gradients stay untouched, as in DDP
            grad_w, grad_b = rebuild_gradients(u_all, v_all, world_size, self.spec)
            averages = {"weight": grad_w, "bias": grad_b}
            for param, role in self.targets:
                self._write(param, averages[role].to(param.device), role)
        self.discard()

    def _write(self, param: nn.Parameter, average: Tensor, role: str) -> None:
        fresh = self._fresh.get(role)
        if fresh is not None:  # .grad = old + fresh: keep old, replace the local part by the average
            param.grad.sub_(fresh).add_(average)
        elif param.grad is None:
            param.grad = average.contiguous()
        elif role in self._fired:  # .grad is this backward's local gradient only
            param.grad.copy_(average)
        else:  # unused on this rank: .grad is the old, already synced value
            param.grad.add_(average)

    def remove(self) -> None:
        self.restore()
        self.capture.remove()
        for hook in self._hooks:
            hook.remove()


def _bias_of(module: nn.Module, spec: FCSpec) -> Tensor | None:
    return getattr(module, spec.bias) if spec.bias is not None else None


def sfb_layers(syncers: list[Syncer], model: nn.Module) -> dict[int, SFBLayer]:
    """The syncers that can take the SFB path, by syncer index: a syncer of exactly one registered FC
    module whose trainable weight (and bias) are all its parameters, and no other module shares them
    (a weight tied to another module gets gradient the factors do not see)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    eligible = {}
    for syncer in syncers:
        if len(syncer.layers) != 1:
            continue
        module = syncer.layers[0].module
        spec = fc_spec(module)
        if spec is None or not spec.weight_of(module).requires_grad:
            continue
        own = {id(spec.weight_of(module)), id(_bias_of(module, spec))}
        if all(id(p) in own and len(owners[id(p)]) == 1 for p in syncer.params):
            eligible[syncer.index] = SFBLayer(module, spec, syncer.params)
    return eligible
