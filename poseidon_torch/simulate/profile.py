"""A model's profile: what the simulator needs to replay one iteration on any number of machines.

A profile lists the layers in the order their gradients become ready (backward order), each with its
parameter bytes, its share of the backward compute in seconds, its parameter tensors' shapes (what
PowerSGD costs a layer by; optional) and, for an FC layer, its FC shape (M outputs, N inputs, K rows per
machine and iteration); the forward's seconds; the seconds between iterations
(optimizer step, data: ``other_s``); and the buckets of the traced run (neighbouring layers synced as one
job). Three sources:

- :func:`from_trace`: a trace the bundled tracer wrote (medians over the traced rank-iterations; the
  engine writes the model's layout into the trace's metadata). The trace times buckets, not layers: a
  bucket's backward time is split between its layers by parameter bytes;
- :meth:`Profile.from_dict` / :func:`load`: a JSON file of the same fields (a user's own measured
  per-layer times), which :meth:`Profile.to_dict` writes;
- :mod:`.paper`: layer shapes, with compute split by FLOPs.

Invariants: every time is finite and >= 0; every layer name is unique; ``buckets`` (when given)
partitions the layers into runs of neighbours, in order; a layer's ``shapes`` (when given) are one per
tensor and hold its bytes exactly.
"""
from __future__ import annotations

import json
import math
import reprlib
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

from ..trace.files import PathLike, load_metadata, load_spans
from ..trace.overlap import total_length
from ..trace.spans import Span


@dataclass(frozen=True)
class FCShape:
    """An FC layer y = W a + b with W of M x N, and K rows per machine and iteration (what SFB sends)."""

    m: int
    n: int
    k: int

    def __post_init__(self) -> None:
        if not all(_is_count(v, 1) for v in (self.m, self.n, self.k)):
            raise ValueError(f"an FC layer's m, n and k are ints > 0 (and < 2**63), got "
                             f"{reprlib.repr(self.m)}, {reprlib.repr(self.n)}, {reprlib.repr(self.k)}")


@dataclass(frozen=True)
class LayerProfile:
    name: str
    nbytes: int            #: parameter (and gradient) bytes
    backward_s: float      #: this layer's share of the backward compute
    fc: FCShape | None = None
    tensors: int = 1       #: parameter tensors (the PS path sends a flag per tensor)
    #: each parameter tensor's shape; () = unknown (a lossy path then sees the layer as one flat tensor,
    #: which PowerSGD does not compress)
    shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"a layer's name is a string, got {self.name!r}")
        if not (_is_count(self.nbytes, 0) and _is_count(self.tensors, 1)):
            raise ValueError(f"layer {self.name!r}: nbytes is an int >= 0 and tensors an int > 0 (both < 2**63), got "
                             f"{reprlib.repr(self.nbytes)}, {reprlib.repr(self.tensors)}")
        _check_time(f"layer {self.name!r} backward_s", self.backward_s)
        if not isinstance(self.shapes, tuple) or self.shapes and not (len(self.shapes) == self.tensors and all(
                isinstance(shape, tuple) and all(_is_count(size, 0) for size in shape) for shape in self.shapes)):
            raise ValueError(f"layer {self.name!r}: shapes is one tuple of sizes (ints >= 0) per tensor "
                             f"({self.tensors}), got {self.shapes!r}")

    @property
    def elements(self) -> int | None:
        """The elements its shapes hold (None: no shapes)."""
        return sum(math.prod(shape) for shape in self.shapes) if self.shapes else None


@dataclass(frozen=True)
class Profile:
    layers: tuple[LayerProfile, ...]  #: in the order their gradients become ready
    forward_s: float
    other_s: float = 0.0              #: between iterations: optimizer step, zero_grad, data
    buckets: tuple[tuple[str, ...], ...] = ()  #: layer names per sync job of the traced run; () = one per layer
    element_size: int = 4
    gemm_flops: float | None = None   #: the rate of SFB's rebuild GEMM (None: not measured)
    samples: int | None = None        #: samples per machine and iteration (for samples/s)
    source: str = ""
    link: dict | None = field(default=None, compare=False)  #: the traced run's link model, for reference
    #: what the traced run's syncs achieved: bytes sent over the time some sync was on the wire (per rank)
    traced_gbps: float | None = None
    #: the memory bandwidth a lossy path's compression compute is costed at (None: not measured, and no
    #: lossy path can be costed)
    memory_bps: float | None = None

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if not names:
            raise ValueError("a profile needs at least one layer")
        if len(set(names)) != len(names):
            raise ValueError("a profile's layer names must be unique")
        _check_time("forward_s", self.forward_s)
        _check_time("other_s", self.other_s)
        if not (math.isfinite(self.compute_s) and self.compute_s > 0):
            raise ValueError(f"a profile's iteration (forward + backward + other) must be finite and > 0, got "
                             f"{self.compute_s}")
        if self.buckets and [name for bucket in self.buckets for name in bucket] != names:
            raise ValueError("a profile's buckets must list every layer once, in the layers' order")
        if self.element_size not in (1, 2, 4, 8):
            raise ValueError(f"a profile's element_size is 1, 2, 4 or 8 bytes, got {self.element_size!r}")
        for layer in self.layers:
            if layer.shapes and layer.elements * self.element_size != layer.nbytes:
                raise ValueError(f"layer {layer.name!r}: its shapes hold {layer.elements} elements of "
                                 f"{self.element_size} bytes, not its {layer.nbytes} bytes")
        for name, value in (("gemm_flops", self.gemm_flops), ("traced_gbps", self.traced_gbps),
                            ("memory_bps", self.memory_bps)):
            if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"a profile's {name} is a finite number > 0 (or null), got {value!r}")
        if self.samples is not None and not _is_count(self.samples, 1):
            raise ValueError(f"a profile's samples is an int > 0 (or null), got {self.samples!r}")

    @property
    def compute_s(self) -> float:
        """One iteration without communication."""
        return self.forward_s + sum(layer.backward_s for layer in self.layers) + self.other_s

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def groups(self) -> list[list[LayerProfile]]:
        """The layers as the traced run's sync jobs (one per layer without buckets)."""
        if not self.buckets:
            return [[layer] for layer in self.layers]
        by_name = {layer.name: layer for layer in self.layers}
        return [[by_name[name] for name in bucket] for bucket in self.buckets]

    def scaled(self, factor: float) -> Profile:
        """Every compute time times ``factor`` (e.g. the CPU contention of more ranks per machine), SFB's
        rebuild GEMM and a lossy path's compression included (their rates divided by ``factor``)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a compute scale must be > 0, got {factor}")
        layers = tuple(replace(layer, backward_s=layer.backward_s * factor) for layer in self.layers)
        gemm = None if self.gemm_flops is None else self.gemm_flops / factor
        memory = None if self.memory_bps is None else self.memory_bps / factor
        return replace(self, layers=layers, forward_s=self.forward_s * factor, other_s=self.other_s * factor,
                       gemm_flops=gemm, memory_bps=memory)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """A profile from its JSON fields (:meth:`to_dict`); a missing or mistyped field is a ValueError."""
        try:
            layers = tuple(LayerProfile(layer["name"], layer["nbytes"], layer["backward_s"],
                                        FCShape(**layer["fc"]) if layer.get("fc") else None, layer.get("tensors", 1),
                                        _shapes(layer.get("shapes")))
                           for layer in data["layers"])
            return cls(layers, data["forward_s"], data.get("other_s", 0.0),
                       tuple(tuple(bucket) for bucket in data.get("buckets", ())), data.get("element_size", 4),
                       data.get("gemm_flops"), data.get("samples"), data.get("source", ""), data.get("link"),
                       data.get("traced_gbps"), data.get("memory_bps"))
        except KeyError as exc:
            raise ValueError(f"not a profile: the field {exc} is missing ({PROFILE_FIELDS})") from None
        except TypeError as exc:
            raise ValueError(f"not a profile: {exc} ({PROFILE_FIELDS})") from None


PROFILE_FIELDS = ("fields: layers [name, nbytes, backward_s, fc {m, n, k}, tensors, shapes], forward_s, other_s, buckets, "
                  "element_size, gemm_flops, samples, memory_bps")


def _shapes(value: object) -> tuple:
    """JSON's lists of sizes as the tuples a layer holds (what is not a list of lists stays as it is, for
    the layer's own check to name)."""
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(shape, list) for shape in value):
        return tuple(tuple(shape) for shape in value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object, minimum: int) -> bool:
    """An int from ``minimum`` up to what a tensor's size can be (below 2**63): a larger one would overflow
    the float arithmetic of the predictions."""
    return _is_int(value) and minimum <= value < 2**63


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_time(name: str, value: object) -> None:
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"a profile's {name} is a time in seconds, finite and >= 0, got {value!r}")


def load(path: PathLike) -> Profile:
    """A profile from a trace (``traceEvents``) or a profile JSON file (``layers``)."""
    try:
        with open(path, encoding="utf-8") as stream:
            document = json.load(stream)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if isinstance(document, dict) and "traceEvents" in document:
        return from_trace(path)
    if isinstance(document, dict) and "layers" in document:
        return replace(Profile.from_dict(document), source=str(path))
    raise ValueError(f"{path}: neither a poseidon-torch trace nor a profile (a JSON object with 'layers')")


def from_trace(path: PathLike) -> Profile:
    """The profile of a traced run: medians over its rank-iterations (see the module docstring)."""
    layouts = [meta["layout"] for meta in load_metadata(path).values() if "layout" in meta]
    if not layouts:
        raise ValueError(f"{path}: the trace has no model layout (written by poseidon-torch before the simulator: "
                         "record it again)")
    layout = layouts[0]
    if layout.get("forward_waits"):
        raise ValueError(f"{path}: traced in a mode whose forward or backward waits for the last step's sync (Pipe-SGD's "
                         "delay, lazy_pull, or a ServerOptimizer with staleness), so they are not compute alone; trace the same "
                         "model in the default mode (PoseidonDDP, or a ServerOptimizer without those options)")
    try:
        return _profile_of(path, layout, load_spans(path))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: the trace's model layout is malformed ({exc!r})") from None


def _profile_of(path: PathLike, layout: dict, ranks: dict[int, list[Span]]) -> Profile:
    backward = _median_by_name(ranks, "backward")
    if not backward:
        raise ValueError(f"{path}: the trace has no backward spans (record at least one synced iteration)")
    layers, buckets = [], []
    for bucket in layout["buckets"]:
        seconds = backward.get(bucket["name"], 0.0)
        total = sum(layer["bytes"] for layer in bucket["layers"]) or 1
        buckets.append(tuple(layer["name"] for layer in bucket["layers"]))
        layers += [LayerProfile(layer["name"], layer["bytes"], seconds * layer["bytes"] / total,
                                FCShape(**layer["fc"]) if layer["fc"] else None, layer["tensors"],
                                _traced_shapes(layer, layout["element_size"]))
                   for layer in bucket["layers"]]
    forward = _median_by_name(ranks, "forward", per_name=False).get(None, 0.0)
    source = f"trace {path}" + (" (parameter-server run: the schemes send what the default mode sends)"
                                if layout.get("server") else "")
    return Profile(tuple(layers), forward, _median_gap(ranks), tuple(buckets), layout["element_size"],
                   layout["gemm_flops"], None, source, layout["link"], _wire_gbps(ranks), layout.get("memory_bps"))


def _traced_shapes(layer: dict, element_size: int) -> tuple:
    """A traced layer's shapes: () where the trace has none (written before they were recorded) or where
    they do not hold the layer's bytes at the profile's one element size (a layer of another dtype than the
    model's first parameter: the profile sizes it by its bytes alone, as before shapes were recorded)."""
    shapes = _shapes(layer.get("shapes"))
    if isinstance(shapes, tuple) and sum(math.prod(shape) for shape in shapes) * element_size == layer["bytes"]:
        return shapes
    return ()


def _wire_gbps(ranks: dict[int, list[Span]]) -> float | None:
    """Bytes the syncs sent over the union of the time any of them was on the wire, summed over ranks,
    in Gbit/s (jobs on several channels overlap: the union counts that time once)."""
    sent = sum(span.args.get("bytes", 0) for spans in ranks.values() for span in spans if span.kind in ("sync", "pull"))
    busy = sum(total_length([(s.start_ns, s.end_ns) for s in spans if s.kind == "network"]) for spans in ranks.values())
    return sent * 8 / busy if sent and busy else None


def _median_by_name(ranks: dict[int, list[Span]], kind: str, per_name: bool = True) -> dict[str | None, float]:
    """Per span name (``per_name``; else all names as one, under None): the median over rank-iterations
    of the summed durations of ``kind`` spans, in seconds."""
    totals: dict[tuple[str | None, int, int], int] = defaultdict(int)
    for rank, spans in ranks.items():
        for span in spans:
            if span.kind == kind:
                totals[span.name if per_name else None, rank, span.iteration] += span.duration_ns
    by_name: dict[str | None, list[int]] = defaultdict(list)
    for (name, _, _), ns in totals.items():
        by_name[name].append(ns)
    return {name: statistics.median(values) / 1e9 for name, values in by_name.items()}


def _median_gap(ranks: dict[int, list[Span]]) -> float:
    """The median time from one iteration span's end to the next one's start on the same rank: the
    optimizer step, zero_grad and the data of the next step."""
    gaps = []
    for spans in ranks.values():
        iterations = sorted((s for s in spans if s.kind == "iteration"), key=lambda s: s.start_ns)
        gaps += [max(0, b.start_ns - a.end_ns) for a, b in zip(iterations, iterations[1:])]
    return statistics.median(gaps) / 1e9 if gaps else 0.0
