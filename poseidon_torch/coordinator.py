"""The coordinator: per FC layer, PS or SFB for the next pass, from facts every rank shares.

At the end of every synced backward the ranks all-gather a small vector of *facts* (the pass's
aborted flag, which buckets got a gradient late, and per FC layer its rows K this round and its sticky
flags, see :mod:`~poseidon_torch.sfb`). From them every rank computes the same plan for the next pass:
an FC layer takes SFB when it has a bucket of its own, no rank raised a sticky flag, and the cost model
predicts SFB cheaper than PS at the largest K (or an override forces it). The first pass runs on PS
everywhere: it is when the sticky facts are learned.

Cost model: predicted seconds per pass on this implementation's traffic (one byte formula per path,
shared with the stats and the benchmark): PS ``link.seconds(ps_bytes_per_rank, 2(P-1) rounds)``; SFB
``link.seconds(sfb_bytes_per_rank, P-1 ring steps)`` plus its rebuild GEMM, ``2 M (P K) N`` flops at
the measured rate. The choice charges PS only its bytes (on PS a layer can share a bucket, and its
messages, with its neighbours; on SFB it is a job of its own). Invariant: SFB is only ever chosen for a
layer that can take it exactly.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .bucket import Bucket, find_layers
from .kvstore import ps_bytes_per_rank, ps_messages
from .link import LinkModel
from .sfb import STICKY_NAMES, FCLayer, fc_eligible, sfb_bytes_per_rank, sfb_messages

PS = "PS"
SFB = "SFB"
PATHS = (PS, SFB)


@dataclass(frozen=True)
class PassFacts:
    """What the end-of-pass exchange told every rank."""

    aborted_ranks: list[int]  #: the ranks whose backward was aborted (an exception on that rank)
    late: list[bool]         #: per bucket: some rank got a gradient after the bucket was submitted
    late_ranks: list[int]    #: the ranks that got a gradient after its bucket was submitted
    syncing: list[bool]      #: per bucket: its job was still running on some rank when backward ended

    @property
    def aborted(self) -> bool:
        """Some rank's backward was aborted: the pass averaged nothing."""
        return bool(self.aborted_ranks)


def predict_ps(nbytes: float, world_size: int, link: LinkModel) -> tuple[float, float]:
    """(bytes per rank, seconds) of one PS sync of a flat buffer of ``nbytes``."""
    sent = ps_bytes_per_rank(nbytes, world_size)
    return sent, link.seconds(sent, ps_messages(world_size))


def predict_sfb(k: int, m: int, n: int, element_size: int, world_size: int, link: LinkModel,
                gemm_flops: float) -> tuple[float, float]:
    """(bytes per rank, seconds) of one SFB sync at K rows per rank: the all-gather and the rebuild."""
    sent = sfb_bytes_per_rank(k, m, n, world_size, element_size)
    return sent, link.seconds(sent, sfb_messages(world_size)) + sfb_rebuild_seconds(k, m, n, world_size, gemm_flops)


def sfb_rebuild_seconds(k: int, m: int, n: int, world_size: int, gemm_flops: float) -> float:
    """SFB's rebuild of the gradient from every rank's factors: a GEMM of M x PK x N."""
    return 2.0 * m * (world_size * k) * n / gemm_flops


class Coordinator:
    """Owns the plan: which FC layers are committed to SFB, and each bucket's path this pass."""

    def __init__(self, fc: Mapping[str, FCLayer], world_size: int, link: LinkModel, gemm_flops: float | None,
                 overrides: Mapping[str, str] | None = None) -> None:
        self.fc = dict(sorted(fc.items()))
        self.world_size, self.link, self.gemm_flops = world_size, link, gemm_flops
        self.overrides = dict(overrides or {})
        self.k_max = {name: 0 for name in self.fc}
        #: per FC layer, its largest K in the last pass it was watched (alone in its bucket): what the
        #: trace's layout tells the simulator of layers later fused with others
        self.k_known: dict[str, int] = {}
        self.sticky = {name: 0 for name in self.fc}
        self.sfb: set[str] = set()   #: layers on SFB for the next pass
        self.solo: set[str] = set()  #: FC layers that have a bucket of their own
        self.learned = False         #: the buckets are learned (fixed from now on)
        self.passes = 0              #: synced passes observed
        #: parameter-server mode: an SFB layer's owners update it, and its new values are pulled
        self.pull_values = False
        self._warned: set[str] = set()

    def check_overrides(self, layer_names: Sequence[str], fc_names: Collection[str]) -> None:
        """Refuse overrides that name no layer, no path, or SFB for a layer that is not an FC layer of its
        own (``fc_names``: those that could take SFB, at any world size)."""
        for name, path in self.overrides.items():
            if name not in layer_names:
                raise ValueError(f"an override or plan names {name!r}, which is not a layer: layers are the modules that own "
                                 "trainable parameters (a parameter shared by several modules belongs to the first "
                                 f"that registers it); layers: {sorted(layer_names)}")
            if path not in PATHS:
                raise ValueError(f"override for layer {name!r} must be one of {PATHS}, got {path!r}")
            if path == SFB and name not in fc_names:
                raise ValueError(f"cannot force SFB on layer {name!r}: it is not an FC layer of its own "
                                 "(see poseidon_torch.register_fc)")
        if self.world_size == 1:  # nothing to gather: a script's SFB override for P ranks means PS here
            self.overrides = {name: PS if path == SFB else path for name, path in self.overrides.items()}

    def only_ps(self) -> None:
        """Every layer on the PS path from now on (ranks on their own clocks cannot all-gather factors)."""
        forced = sorted(name for name, path in self.overrides.items() if path == SFB)
        if forced:
            raise ValueError(f"overrides force SFB on {forced}, which needs every rank at the same step; "
                             "a ServerOptimizer with staleness runs every layer on the PS path")
        self.overrides.update({name: PS for name in self.fc})
        self.sfb = set()

    def buckets_changed(self, solo: set[str], learned: bool) -> None:
        """The engine installed new buckets: ``solo`` FC layers have one of their own."""
        self.solo, self.learned = solo, learned

    def wanted_solo(self) -> set[str]:
        """FC layers that should get a bucket of their own: on SFB, or forced onto it; before the first
        pass, every FC layer not forced onto PS, so each is watched (its K learned) before the buckets
        are learned (a layer fused with a neighbour from the start would never be considered for SFB)."""
        if not self.passes:
            return {n for n in self.fc if self.overrides.get(n) != PS}
        forced = {n for n, p in self.overrides.items() if p == SFB and not self.sticky[n]}
        return self.sfb | forced

    def commits(self, name: str) -> bool:
        """Whether the layer's calls in the next round are detached (it syncs through SFB)."""
        return name in self.sfb

    def path_of(self, bucket: Bucket, shadow: bool = False) -> str:
        """SFB for an FC layer on SFB whose round of forwards was committed to it (a retained graph
        from before the plan changed goes through PS). A joined rank's shadow pass ran no forward: it
        follows the plan, as the ranks that did commit their calls to it."""
        layer = bucket.fc
        if layer is None or layer.name not in self.sfb:
            return PS
        return SFB if shadow or layer.commit else PS

    def k_pad(self, bucket: Bucket) -> int:
        return self.k_max[bucket.fc.name]

    # ---- the end-of-pass exchange -----------------------------------------------------------------

    def facts(self, aborted: bool, late: Sequence[bool], syncing: Sequence[bool]) -> torch.Tensor:
        """This rank's facts: [aborted, late per bucket, syncing per bucket, (K, sticky) per FC layer]."""
        values = [int(aborted), *map(int, late), *map(int, syncing)]
        for layer in self.fc.values():
            values += [layer.k_round, layer.sticky]
        return torch.tensor(values, dtype=torch.int64)

    def observe(self, everyone: torch.Tensor, num_buckets: int) -> PassFacts:
        """Every rank's facts (one row per rank): update K, sticky flags and the plan."""
        rows = everyone.tolist()  # a few ints per bucket and layer: plain Python beats a torch op per value
        aborted_ranks = [r for r, row in enumerate(rows) if row[0]]
        columns = list(zip(*rows))
        late = [any(c) for c in columns[1:1 + num_buckets]]
        late_ranks = [r for r, row in enumerate(rows) if any(row[1:1 + num_buckets])]
        syncing = [any(c) for c in columns[1 + num_buckets:1 + 2 * num_buckets]]
        per_layer = columns[1 + 2 * num_buckets:]
        for i, name in enumerate(self.fc):
            self.k_max[name] = max(per_layer[2 * i])
            if self.k_max[name]:
                self.k_known[name] = self.k_max[name]
            for flags in per_layer[2 * i + 1]:
                self.sticky[name] |= flags
        if not aborted_ranks:
            self.passes += 1
            self.sfb = {name for name in self.fc if self._chooses_sfb(name)}
        return PassFacts(aborted_ranks, late, late_ranks, syncing)

    def _chooses_sfb(self, name: str) -> bool:
        forced = self.overrides.get(name)
        if self.sticky[name]:
            if forced == SFB and name not in self._warned:
                self._warned.add(name)
                reasons = ", ".join(text for bit, text in STICKY_NAMES.items() if self.sticky[name] & bit)
                warnings.warn(f"PoseidonDDP: layer {name!r} stays on the PS path despite overrides={{'{name}': "
                              f"'SFB'}}: SFB would not be exact ({reasons})", stacklevel=2)
            return False
        if name not in self.solo or forced == PS:
            return False
        if forced == SFB:
            return True
        layer = self.fc[name]
        nbytes = sum(p.numel() for p in layer.params) * layer.weight.element_size()
        # before the buckets are learned, a layer on PS may still join its neighbours' bucket and share
        # their messages: count only its bytes; once they are learned (fixed), a layer alone in its
        # bucket pays the latency on either path
        ps_bytes, ps_seconds = predict_ps(nbytes, self.world_size, self.link)
        if not self.learned:
            ps_seconds = self.link.beta_s_per_byte * ps_bytes
        _, sfb_seconds = self._predict_sfb(layer)
        return sfb_seconds < ps_seconds

    def _predict_sfb(self, layer: FCLayer) -> tuple[float, float]:
        """(bytes per rank, seconds) of the layer's SFB sync at last pass's K; in parameter-server mode
        with the pull of its new values (the pull half of a PS sync)."""
        sent, seconds = predict_sfb(self.k_max[layer.name], layer.m, layer.n, layer.weight.element_size(),
                                    self.world_size, self.link, self.gemm_flops)
        if self.pull_values:
            nbytes = sum(p.numel() for p in layer.params) * layer.weight.element_size()
            pulled = ps_bytes_per_rank(nbytes, self.world_size) / 2
            sent, seconds = sent + pulled, seconds + self.link.seconds(pulled, self.world_size - 1)
        return sent, seconds

    # ---- the printable plan ---------------------------------------------------------------------

    def plan(self, buckets: Sequence[Bucket]) -> Plan:
        """The plan for the next synced pass, one row per bucket."""
        return Plan([self._row(b) for b in buckets], self.world_size, self.link, self.gemm_flops)

    def _row(self, bucket: Bucket) -> PlanRow:
        ps_bytes, ps_seconds = predict_ps(bucket.nbytes, self.world_size, self.link)
        layer = bucket.fc
        kind = type(bucket.layers[0].module).__name__ if len(bucket.layers) == 1 else f"fused x{len(bucket.layers)}"
        planned = SFB if layer is not None and layer.name in self.sfb else PS
        layers = tuple(layer.name for layer in bucket.layers)
        row = PlanRow(bucket.name, kind, tuple(bucket.params[0].shape), None, planned,
                      bucket.name in self.overrides, ps_bytes, ps_seconds, None, None, layers)
        if layer is None:
            return row
        sfb_bytes, sfb_seconds = self._predict_sfb(layer)
        return PlanRow(row.name, row.kind, row.shape, self.k_max[layer.name], row.path, row.forced, ps_bytes, ps_seconds,
                       sfb_bytes, sfb_seconds, layers)


@dataclass(frozen=True)
class PlanRow:
    name: str
    kind: str
    shape: tuple[int, ...]
    k: int | None          #: the largest K of the last pass (FC layers of their own)
    path: str
    forced: bool
    ps_bytes: float
    ps_seconds: float
    sfb_bytes: float | None
    sfb_seconds: float | None
    layers: tuple[str, ...]  #: the bucket's layers, in sync order


#: what :meth:`Plan.save` writes, and :func:`recorded_paths` reads back
PLAN_FORMAT = "poseidon-plan/1"


@dataclass(frozen=True)
class Plan:
    """One row per bucket, in sync order, and the inputs of the cost model; ``print`` it. Given back
    to ``PoseidonDDP(plan=...)`` (itself, :meth:`layer_paths` or the file :meth:`save` wrote), it
    forces every layer onto the path it records."""

    rows: list[PlanRow]
    world_size: int
    link: LinkModel
    gemm_flops: float | None  #: None: not probed (no layer can take SFB)

    #: a fused bucket's name (its layers joined by "+") wraps onto lines of at most this many characters
    NAME_WIDTH = 48

    def paths(self) -> dict[str, str]:
        return {row.name: row.path for row in self.rows}

    def layer_paths(self) -> dict[str, str]:
        """Every layer's path (a fused bucket's layers share its path)."""
        return {layer: row.path for row in self.rows for layer in row.layers}

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`layer_paths` as JSON, for ``PoseidonDDP(plan=path)``."""
        record = {"format": PLAN_FORMAT, "world_size": self.world_size, "paths": self.layer_paths()}
        with open(path, "w") as file:
            json.dump(record, file, indent=1, sort_keys=True)

    def __str__(self) -> str:
        header = ("bucket", "type", "shape", "K", "path", "PS bytes", "PS time", "SFB bytes", "SFB time")
        rows = [(header,)] + [_wrapped(_cells(row), self.NAME_WIDTH) for row in self.rows]
        widths = [max(len(line[i]) for row in rows for line in row) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                 for row in rows for line in row]
        lines.insert(1, "  ".join("-" * width for width in widths))
        gemm = "not probed" if self.gemm_flops is None else f"{self.gemm_flops / 1e9:.3g} GFLOP/s"
        lines.append(f"P={self.world_size}; link: {self.link}; GEMM {gemm}; * = forced by override")
        return "\n".join(lines)


def recorded_paths(plan: Plan | Mapping[str, str] | str | os.PathLike, module: nn.Module) -> dict[str, str]:
    """The per-layer paths of a recorded plan (a :class:`Plan`, a ``{layer: path}`` dict, or a file
    :meth:`Plan.save` wrote), checked to name every layer of ``module`` that could take SFB: a layer
    it leaves out would be planned by the timing-dependent cost model. Which names are layers, and
    which paths they may take, the engine checks as it does for ``overrides``."""
    if isinstance(plan, Plan):
        paths = plan.layer_paths()
    elif isinstance(plan, Mapping):
        paths = dict(plan)
    elif isinstance(plan, (str, os.PathLike)):
        paths = _read_plan(plan)
    else:
        raise TypeError(f"PoseidonDDP option plan must be a Plan (model.plan), a dict {{layer: 'PS' or 'SFB'}} or the "
                        f"path of a file Plan.save() wrote, got {type(plan).__name__}")
    missing = sorted(layer.name for layer in fc_eligible(find_layers(module), module) if layer.name not in paths)
    if missing:
        raise ValueError(f"plan= gives no path for the layer(s) {missing}, which could take SFB: a plan must name every "
                         "such layer (record it from this model with model.plan.save(path), or add them)")
    return paths


def _read_plan(path: str | os.PathLike) -> dict[str, str]:
    with open(path) as file:
        record = json.load(file)
    if not (isinstance(record, dict) and record.get("format") == PLAN_FORMAT and isinstance(record.get("paths"), dict)):
        raise ValueError(f"{os.fspath(path)!r} is not a plan written by Plan.save() (format {PLAN_FORMAT!r})")
    return record["paths"]


def _wrapped(cells: tuple[str, ...], width: int) -> list[tuple[str, ...]]:
    """A row as lines: the bucket name (first cell) cut after a "+" so no line is wider than ``width``
    (a single layer name longer than that stays whole); the other cells on the first line."""
    pieces, line = [], ""
    for layer in cells[0].split("+"):
        joined = f"{line}+{layer}" if line else layer
        if line and len(joined) + 1 > width:
            pieces.append(line + "+")
            joined = layer
        line = joined
    pieces.append(line)
    blank = ("",) * (len(cells) - 1)
    return [(pieces[0], *cells[1:])] + [(piece, *blank) for piece in pieces[1:]]


def _cells(row: PlanRow) -> tuple[str, ...]:
    fc = row.sfb_bytes is not None
    return (row.name, row.kind, "x".join(map(str, row.shape)), "-" if row.k is None else str(row.k),
            row.path + ("*" if row.forced else ""), format_bytes(row.ps_bytes), format_seconds(row.ps_seconds),
            format_bytes(row.sfb_bytes) if fc else "-", format_seconds(row.sfb_seconds) if fc else "-")


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-6:.1f} us"
