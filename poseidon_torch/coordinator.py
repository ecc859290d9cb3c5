"""Per-layer choice between the sharded parameter-server path (PS) and sufficient-factor broadcasting.

Job: predict, for every syncer (one layer or a fused group of parameters), the bytes this rank sends
per iteration and the seconds that costs on each eligible path, and pick the cheaper path
(:func:`plan_layers`). The link is an alpha-beta model (:class:`LinkModel`) measured with all-reduce
(:func:`probe_link`) or set by hand; SFB also pays its rebuild GEMM at the measured matmul rate
(:func:`probe_gemm_flops`). The paper's own Table 1 traffic formulas and decision rule are kept
separately (``paper_*``) for comparison: they do not describe what this implementation sends.

Invariants:
- Byte counts are those of our implementation, per rank and iteration: :func:`ps_bytes_per_rank` for
  the PS path, :func:`sfb_bytes_per_rank` (the ring all-gather of :func:`~poseidon_torch.sfb.gather_factors`)
  for SFB.
- SFB is only ever chosen, or forced, for an FC-eligible layer whose K is known.
- Every rank computes the same plan from the same inputs: :func:`probe_link` and
  :func:`probe_gemm_flops` reduce their measurements over the group (the slowest rank's), so all ranks
  see identical numbers; the caller must pass the same K on every rank.
- At world size 1 nothing is sent: unless forced, every layer is PS with zero bytes and zero seconds.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .sfb import fc_spec, sfb_bytes_per_rank

PS = "PS"
SFB = "SFB"
PATHS = (PS, SFB)
BANDWIDTH_ENV = "POSEIDON_BANDWIDTH_GBPS"
LATENCY_ENV = "POSEIDON_LATENCY_US"
DEFAULT_PROBE_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of one rank's link: ``seconds = alpha * messages + beta * bytes``."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_gbps(cls, bandwidth_gbps: float, latency_us: float = 0.0) -> LinkModel:
        """From a bandwidth in Gbit/s (as Ethernet is rated) and a per-message latency in µs."""
        return cls(latency_us * 1e-6, 8.0 / (bandwidth_gbps * 1e9))

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return self.alpha_s * messages + self.beta_s_per_byte * nbytes

    def __str__(self) -> str:
        bandwidth = "inf" if self.beta_s_per_byte == 0 else f"{8.0 / self.beta_s_per_byte / 1e9:.3g}"
        return f"alpha {self.alpha_s * 1e6:.3g} us, bandwidth {bandwidth} Gbit/s"


def fit_link(sizes: Sequence[int], seconds: Sequence[float], world_size: int) -> LinkModel:
    """Fit a :class:`LinkModel` to all-reduce timings of float32 tensors of ``sizes`` bytes.

    A ring all-reduce of S bytes over P ranks takes 2(P-1) steps and sends 2(P-1)/P * S bytes per rank,
    so ``t(S) = a + b S`` with ``a = 2(P-1) alpha`` and ``b = 2(P-1)/P * beta``. (a, b) is the
    least-squares fit, clipped to non-negative; world size 1 sends nothing and gives a zero model."""
    if world_size == 1:
        return LinkModel(0.0, 0.0)
    design = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=float), rcond=None)
    steps = 2 * (world_size - 1)
    return LinkModel(max(float(a), 0.0) / steps, max(float(b), 0.0) * world_size / steps)


_LINK_CACHE: dict[tuple[object, str], LinkModel] = {}


def probe_link(
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int] = DEFAULT_PROBE_SIZES,
    repeats: int = 3,
    *,
    device: str | torch.device = "cpu",
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
) -> LinkModel:
    """The link model of ``group``, measured once per (group, device) and cached.

    Times ``dist.all_reduce`` of a float32 tensor on ``device`` at each size (one warm-up, then the
    median of ``repeats``), takes each size's maximum over the ranks and fits with :func:`fit_link`.
    A bandwidth override (argument, else ``POSEIDON_BANDWIDTH_GBPS``) skips probing and needs no
    process group; a latency override (argument, else ``POSEIDON_LATENCY_US``, default 0 when the
    bandwidth is overridden) replaces the measured alpha. Collective: every rank must call it."""
    bandwidth = _override(bandwidth_gbps, BANDWIDTH_ENV)
    latency = _override(latency_us, LATENCY_ENV)
    if bandwidth is not None:
        return LinkModel.from_gbps(bandwidth, latency or 0.0)
    key = (_group_key(group), str(torch.device(device)))
    if key not in _LINK_CACHE:
        _LINK_CACHE[key] = _measure_link(group, sizes, repeats, torch.device(device))
    model = _LINK_CACHE[key]
    return model if latency is None else replace(model, alpha_s=latency * 1e-6)


def _group_key(group: dist.ProcessGroup | None) -> object:
    """Cache key of a process group: its ranks and backend (the network they share), so groups created
    again over the same ranks reuse a probe."""
    if not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group)), dist.get_backend(group)


def _override(value: float | None, env: str) -> float | None:
    if value is not None:
        return value
    text = os.environ.get(env, "").strip()
    return float(text) if text else None


def _measure_link(
    group: dist.ProcessGroup | None, sizes: Sequence[int], repeats: int, device: torch.device
) -> LinkModel:
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return LinkModel(0.0, 0.0)
    medians = [_median_all_reduce_seconds(size, repeats, device, group) for size in sizes]
    return fit_link(sizes, _agree(medians, dist.ReduceOp.MAX, group, device), world_size)


def _agree(
    values: list[float], op: dist.ReduceOp, group: dist.ProcessGroup | None, device: torch.device
) -> list[float]:
    """``values`` reduced element-wise with ``op`` over ``group``, so every rank holds the same numbers
    (unchanged when torch.distributed is not initialized)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def _median_all_reduce_seconds(
    nbytes: int, repeats: int, device: torch.device, group: dist.ProcessGroup | None
) -> float:
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(buffer, group=group)  # warm-up: connection setup, allocator
    return statistics.median(_timed(lambda: dist.all_reduce(buffer, group=group), device)
                             for _ in range(repeats))


def _timed(work: Callable[[], object], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    work()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_GEMM_CACHE: dict[tuple[str, object], float] = {}


def probe_gemm_flops(
    device: str | torch.device = "cpu", group: dist.ProcessGroup | None = None
) -> float:
    """Measured float32 matmul rate of ``device`` in FLOP/s (median over a few 256^3..512^3 products),
    cached per (device, group). When torch.distributed is initialized this is collective: the result is
    the slowest rank's rate over ``group``, so every rank plans with the same number."""
    device = torch.device(device)
    key = (str(device), _group_key(group))
    if key not in _GEMM_CACHE:
        (_GEMM_CACHE[key],) = _agree([_measure_gemm_flops(device)], dist.ReduceOp.MIN, group, device)
    return _GEMM_CACHE[key]


def _measure_gemm_flops(device: torch.device) -> float:
    rates = []
    for size in (256, 384, 512):
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        a @ b  # warm-up
        rates += [2.0 * size**3 / _timed(lambda: a @ b, device) for _ in range(3)]
    return statistics.median(rates)


def ps_bytes_per_rank(nbytes: int, world_size: int) -> float:
    """Mean bytes one rank sends on the PS path for a flat gradient of ``nbytes`` bytes.

    The buffer is cut into chunks, each owned by one rank, owners balanced: a rank pushes the (P-1)/P
    of the buffer it does not own once, and sends its own 1/P aggregate to each of the P-1 peers:
    ``2 (P-1)/P * nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def _ps_messages(world_size: int) -> int:
    """Latency rounds of the PS path: push, then pull, each in P - 1 staggered rounds."""
    return 2 * (world_size - 1)


def _sfb_messages(world_size: int) -> int:
    """Sequential ring steps of SFB's one all-gather (the K's travel in the per-iteration exchange)."""
    return world_size - 1


def paper_ps_traffic(m: int, n: int, p_workers: int, p_servers: int) -> float:
    """Paper, Table 1: values per iteration sent and received by a machine that is both server and
    worker, for an M x N layer: ``2 M N (P1 + P2 - 2) / P2``."""
    return 2.0 * m * n * (p_workers + p_servers - 2) / p_servers


def paper_sfb_traffic(k: int, m: int, n: int, p_workers: int) -> int:
    """Paper, Table 1: SFB values per iteration per worker: ``2 K (M + N) (P1 - 1)``."""
    return 2 * k * (m + n) * (p_workers - 1)


def paper_best_scheme(k: int, m: int, n: int, p_workers: int, p_servers: int) -> str:
    """The paper's BestScheme for an FC layer: SFB iff its traffic is at most the PS traffic.
    (Non-FC layers always use PS.)"""
    sfb = paper_sfb_traffic(k, m, n, p_workers)
    return SFB if sfb <= paper_ps_traffic(m, n, p_workers, p_servers) else PS


@dataclass(frozen=True)
class LayerInfo:
    """What the coordinator knows about one syncer: ``numel`` elements of ``element_size`` bytes in its
    flat gradient; for an FC-eligible layer also K (samples per iteration on one rank, None if not yet
    known), M (outputs) and N (inputs)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    numel: int
    fc_eligible: bool = False
    k: int | None = None
    m: int | None = None
    n: int | None = None
    element_size: int = 4

    @classmethod
    def of_module(cls, name: str, module: nn.Module, k: int | None = None) -> LayerInfo:
        """Describe a layer from its own (non-recursive) parameters, FC-eligible per
        :func:`~poseidon_torch.sfb.fc_spec`; ``shape`` is that of its first parameter."""
        params = list(module.parameters(recurse=False))
        if not params:
            raise ValueError(f"layer {name!r} ({type(module).__name__}) has no parameters of its own")
        spec = fc_spec(module)
        return cls(
            name=name,
            kind=type(module).__name__,
            shape=tuple(params[0].shape),
            numel=sum(p.numel() for p in params),
            fc_eligible=spec is not None,
            k=k,
            m=spec.out_features(module) if spec else None,
            n=spec.in_features(module) if spec else None,
            element_size=params[0].element_size(),
        )

    @classmethod
    def of_syncer(cls, syncer, fc=None) -> LayerInfo:
        """Describe a syncer (its flat buffer, used flags included); FC-eligible when ``fc`` (its
        :class:`~poseidon_torch.sfb.SFBLayer`) is given."""
        layers = syncer.layers
        kind = type(layers[0].module).__name__ if len(layers) == 1 else f"fused x{len(layers)}"
        return cls(name=syncer.name, kind=kind, shape=tuple(syncer.params[0].shape), numel=syncer.numel,
                   fc_eligible=fc is not None, m=fc.m if fc else None, n=fc.n if fc else None,
                   element_size=syncer.params[0].element_size())

    @property
    def sfb_possible(self) -> bool:
        return self.fc_eligible and self.k is not None


@dataclass(frozen=True)
class LayerPlan:
    """The chosen path of one layer and the predictions behind it (SFB fields None if not eligible)."""

    layer: LayerInfo
    path: str
    forced: bool
    ps_bytes: float
    ps_seconds: float
    sfb_bytes: int | None
    sfb_seconds: float | None
    reason: str


@dataclass(frozen=True)
class Plan:
    """One :class:`LayerPlan` per layer, in the order given, and the inputs of the cost model."""

    layers: list[LayerPlan]
    world_size: int
    link: LinkModel
    gemm_flops: float

    def paths_by_layer(self) -> dict[str, str]:
        return {plan.layer.name: plan.path for plan in self.layers}

    def path_of(self, name: str) -> str:
        """The chosen path of layer ``name``; KeyError if the plan has no such layer."""
        for plan in self.layers:
            if plan.layer.name == name:
                return plan.path
        raise KeyError(name)

    def __str__(self) -> str:
        header = ("layer", "type", "shape", "K", "path", "PS bytes", "PS time", "SFB bytes", "SFB time")
        rows = [header] + [_row(plan) for plan in self.layers]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        lines.append(f"P={self.world_size}; link: {self.link}; GEMM {self.gemm_flops / 1e9:.3g} GFLOP/s;"
                     " * = forced by override")
        return "\n".join(lines)


def _row(plan: LayerPlan) -> tuple[str, ...]:
    layer = plan.layer
    sfb_eligible = plan.sfb_bytes is not None
    return (
        layer.name,
        layer.kind,
        "x".join(map(str, layer.shape)),
        "-" if layer.k is None else str(layer.k),
        plan.path + ("*" if plan.forced else ""),
        _format_bytes(plan.ps_bytes),
        _format_seconds(plan.ps_seconds),
        _format_bytes(plan.sfb_bytes) if sfb_eligible else "-",
        _format_seconds(plan.sfb_seconds) if sfb_eligible else "-",
    )


def _format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-6:.1f} us"


def plan_layers(
    layers: Iterable[LayerInfo],
    world_size: int,
    link: LinkModel,
    gemm_flops: float,
    overrides: dict[str, str] | None = None,
) -> Plan:
    """Choose PS or SFB for every layer by predicted seconds per iteration, on this implementation's
    traffic: PS ``link.seconds(ps_bytes, 2(P-1) staggered rounds)``; SFB ``link.seconds(sfb_bytes, P-1 ring steps)``
    plus the rebuild GEMM ``2 M (P K) N / gemm_flops``. SFB only for FC-eligible layers with known K
    and only if strictly cheaper. ``overrides`` maps layer names to a forced path; duplicate layer
    names, an unknown name or path, or SFB forced on a layer that cannot use it raise ValueError."""
    layers = list(layers)
    overrides = dict(overrides or {})
    _check_names(layers, overrides)
    plans = [_plan_layer(layer, world_size, link, gemm_flops, overrides.get(layer.name))
             for layer in layers]
    return Plan(plans, world_size, link, gemm_flops)


def _check_names(layers: list[LayerInfo], overrides: dict[str, str]) -> None:
    by_name = {layer.name: layer for layer in layers}
    if len(by_name) != len(layers):
        raise ValueError("layer names must be unique")
    _check_override_targets(layers, overrides)
    for name, path in overrides.items():
        if path == SFB and not by_name[name].sfb_possible:
            raise ValueError(f"cannot force SFB on layer {name!r}: its K is unknown")


def _plan_layer(
    layer: LayerInfo, world_size: int, link: LinkModel, gemm_flops: float, forced: str | None
) -> LayerPlan:
    ps_bytes = ps_bytes_per_rank(layer.numel * layer.element_size, world_size)
    ps_seconds = link.seconds(ps_bytes, _ps_messages(world_size))
    sfb_bytes = sfb_seconds = None
    if layer.sfb_possible:
        sfb_bytes = sfb_bytes_per_rank(layer.k, layer.m, layer.n, world_size, layer.element_size)
        rebuild_flops = 2.0 * layer.m * (world_size * layer.k) * layer.n
        sfb_seconds = link.seconds(sfb_bytes, _sfb_messages(world_size)) + rebuild_flops / gemm_flops
    path, reason = _choose(layer, ps_seconds, sfb_seconds, forced)
    return LayerPlan(layer, path, forced is not None, ps_bytes, ps_seconds, sfb_bytes, sfb_seconds,
                     reason)


def _choose(
    layer: LayerInfo, ps_seconds: float, sfb_seconds: float | None, forced: str | None
) -> tuple[str, str]:
    if forced is not None:
        return forced, "forced by override"
    if sfb_seconds is None:
        return PS, "K unknown" if layer.fc_eligible else f"not FC ({layer.kind})"
    comparison = f"SFB {_format_seconds(sfb_seconds)} vs PS {_format_seconds(ps_seconds)}"
    if sfb_seconds < ps_seconds:
        return SFB, f"SFB cheaper: {comparison}"
    return PS, f"PS not dearer: {comparison}"


class Coordinator:
    """Chooses every syncer's path for the coming backward, identically on all ranks.

    At each synced forward the ranks all-gather one K per FC syncer (one small collective per
    iteration for all FC layers together; -1 where that rank accumulated gradients under ``no_sync``,
    which only the PS path can average). The plan uses the largest K, the one SFB's padded all-gather
    pays for, and is recomputed only when the K's change (a smaller last batch)."""

    def __init__(self, layers: Sequence[LayerInfo], fc_indices: Sequence[int], world_size: int,
                 link: LinkModel, gemm_flops: float, overrides: dict[str, str] | None = None) -> None:
        self._layers = list(layers)
        self.fc_indices = list(fc_indices)
        self.world_size, self.link, self.gemm_flops = world_size, link, gemm_flops
        self.overrides = dict(overrides or {})
        _check_override_targets(self._layers, self.overrides)
        self.plan: Plan | None = None
        self.paths = [PS] * len(self._layers)  #: this iteration's paths (committed layers forced SFB)
        self.preferred = [PS] * len(self._layers)  #: what the cost model alone picks for these K's
        self.counts: dict[int, list[int]] = {}
        self._cache: dict[tuple, tuple[Plan, list[str]]] = {}

    def exchange_bytes(self) -> int:
        """Bytes this rank sends per iteration in the K exchange (ring all-gather of int64s)."""
        return (self.world_size - 1) * 8 * len(self.fc_indices)

    def plan_iteration(self, local_k: Sequence[int], group, committed: frozenset[int] | set[int] = frozenset()
                       ) -> None:
        """Collective over ``group``: exchange the K's and set ``paths``, ``counts`` and ``plan``.
        ``committed`` layers skipped their local weight gradient in this forward: SFB is forced."""
        mine = torch.tensor(list(local_k), dtype=torch.int64)
        everyone = torch.empty(self.world_size * len(mine), dtype=torch.int64)
        dist.all_gather_into_tensor(everyone, mine, group=group)
        per_layer = everyone.view(self.world_size, -1).t().tolist()
        self.counts = dict(zip(self.fc_indices, per_layer))
        k_max = tuple(max(c) if min(c) >= 0 else -1 for c in per_layer)
        key = (k_max, frozenset(committed))
        if key not in self._cache:
            by_layer = dict(zip(self.fc_indices, k_max))
            preferred = [p.path for p in self._plan_for(by_layer, frozenset()).layers]
            self._cache[key] = (self._plan_for(by_layer, key[1]), preferred)
        self.plan, self.preferred = self._cache[key]
        self.paths = [p.path for p in self.plan.layers]

    def _plan_for(self, k_max: dict[int, int], committed: frozenset[int]) -> Plan:
        layers, overrides = [], dict(self.overrides)
        for i, layer in enumerate(self._layers):
            k = k_max.get(i, -1)
            layers.append(replace(layer, k=k if k >= 0 else None))
            if i in k_max and k < 0 and i in committed:
                raise RuntimeError(f"layer {layer.name!r}: some rank accumulated gradients under no_sync "
                                   "and another did not; all ranks must use no_sync alike")
            if i in committed:
                overrides[layer.name] = SFB
            elif i in k_max and k < 0 and overrides.get(layer.name) == SFB:
                del overrides[layer.name]  # gradients accumulated under no_sync: PS this time
        return plan_layers(layers, self.world_size, self.link, self.gemm_flops, overrides)


def _check_override_targets(layers: list[LayerInfo], overrides: dict[str, str]) -> None:
    """Validate overrides before K is known: names, paths, and SFB only on FC layers."""
    by_name = {layer.name: layer for layer in layers}
    for name, path in overrides.items():
        if name not in by_name:
            raise ValueError(f"override names unknown layer {name!r}; layers: {sorted(by_name)}")
        if path not in PATHS:
            raise ValueError(f"override for layer {name!r} must be one of {PATHS}, got {path!r}")
        if path == SFB and not by_name[name].fc_eligible:
            raise ValueError(f"cannot force SFB on layer {name!r}: it is not an FC layer "
                             f"({by_name[name].kind}); see poseidon_torch.register_fc")
