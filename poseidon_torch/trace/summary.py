"""Summary numbers of a Poseidon trace: per-layer communication and the overlap ratio (no matplotlib).

Definitions (time sets are unions of span intervals, see :mod:`poseidon_torch.overlap`):
- every measure is taken per rank (ranks have separate clocks and threads) and combined over ranks
  by summing lengths, bytes or times before dividing;
- a *rank-iteration* is one (rank, iteration index) pair present in the trace; "per iteration"
  values are totals divided by the number of rank-iterations, i.e. means per iteration per rank;
- comm = ``network`` spans, compute = ``forward`` + ``backward`` spans less the ``wait`` spans (the
  training thread blocked on the sync computes nothing); the overlap ratio is HTA's
  ``|∪comm ∩ ∪compute| / |∪comm|`` (1.0 without comm) and exposed communication is
  ``|∪comm| - |∪comm ∩ ∪compute|``;
- waits are the summed durations of ``wait`` spans by name (what the training thread waited on), per
  rank-iteration;
- a layer is the name of ``sync``/``network`` spans: its bytes come from ``args["bytes"]`` of its
  ``sync`` spans, its comm time is the summed duration of its ``network`` spans, and its hidden share
  is the part of its ``network`` time covered by the same rank's ``backward`` spans;
- iteration time is the median duration of ``iteration`` spans (``null`` without them): from a step's
  first synced forward to where its pass closes, which in a deferred mode (``delay=k``, lazy pulls) is
  in the next step; the step period is the median time from an iteration's start to the next one's on
  the same rank (``null`` without two consecutive iterations), what a benchmark's step time measures.

"""
from __future__ import annotations

import statistics
from collections.abc import Iterable

from .overlap import Interval, difference, intersection_length, total_length
from .spans import COMM_KINDS, COMPUTE_KINDS, JOB_KINDS, WAIT_KINDS, WAIT_NAMES, Span

NS_PER_MS = 1_000_000


def summarize(spans_by_rank: dict[int, list[Span]]) -> dict:
    """Summary numbers of a trace as a JSON-ready dict (see the module docstring for definitions)."""
    samples = sum(len(iterations_of(spans)) for spans in spans_by_rank.values())
    comm_ns, hidden_ns = _hidden(spans_by_rank, COMM_KINDS, COMPUTE_KINDS)
    durations = [s.duration_ns for spans in spans_by_rank.values() for s in spans if s.kind == "iteration"]
    return {
        "ranks": len(spans_by_rank),
        "iterations": len(set().union(*map(iterations_of, spans_by_rank.values()))),
        "rank_iterations": samples,
        "overlap_ratio": _ratio(hidden_ns, comm_ns),
        "comm_ms_per_iteration": _per(comm_ns, samples) / NS_PER_MS,
        "exposed_comm_ms_per_iteration": _per(comm_ns - hidden_ns, samples) / NS_PER_MS,
        "iteration_ms_median": _median_ms(durations),
        "step_ms_median": _median_ms(list(_step_periods_ns(spans_by_rank))),
        "waits_ms_per_iteration": _waits(spans_by_rank, samples),
        "layers": [_layer_row(name, spans_by_rank, samples) for name in _layer_names(spans_by_rank)],
    }


def _step_periods_ns(spans_by_rank: dict[int, list[Span]]) -> Iterable[int]:
    """Per rank, the time from each iteration's start to the next iteration's (consecutive ones only)."""
    for spans in spans_by_rank.values():
        starts = {s.iteration: s.start_ns for s in spans if s.kind == "iteration"}
        yield from (starts[i + 1] - starts[i] for i in starts if i + 1 in starts)


def _median_ms(values_ns: list[int]) -> float | None:
    return statistics.median(values_ns) / NS_PER_MS if values_ns else None


def _ms_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def format_summary(summary: dict, title: str) -> str:
    """``summary`` as an aligned plain-text table followed by the totals."""
    header = ("layer", "path", "bytes/iter", "comm ms/iter", "hidden")
    rows = [
        (short_name(row["layer"]), row["path"], _format_bytes(row["bytes_per_iteration"]),
         f"{row['comm_ms_per_iteration']:.3f}", f"{row['hidden_share']:.1%}")
        for row in summary["layers"]
    ]
    totals = [
        ("overlap ratio (HTA, comm hidden by compute)", f"{summary['overlap_ratio']:.1%}"),
        ("communication per iteration", f"{summary['comm_ms_per_iteration']:.3f} ms"),
        ("exposed communication per iteration", f"{summary['exposed_comm_ms_per_iteration']:.3f} ms"),
        ("iteration time (median)", _ms_or_dash(summary["iteration_ms_median"])),
        ("step period (median, start to next start)", _ms_or_dash(summary["step_ms_median"])),
        ("training thread waiting on the sync per iteration", _format_waits(summary["waits_ms_per_iteration"])),
    ]
    label_width = max(len(label) for label, _ in totals)
    lines = [f"{title}: {summary['ranks']} ranks, {summary['iterations']} iterations", ""]
    lines += _table(header, rows, left_aligned=2) if rows else ["(no sync or network spans)"]
    lines += [""] + [f"{label + ':':<{label_width + 1}} {value}" for label, value in totals]
    return "\n".join(lines)


def iterations_of(spans: list[Span]) -> set[int]:
    return {span.iteration for span in spans}


def _intervals(spans: Iterable[Span], kinds: Iterable[str], name: str | None = None) -> list[Interval]:
    kinds = set(kinds)
    return [(s.start_ns, s.end_ns) for s in spans if s.kind in kinds and (name is None or s.name == name)]


def _hidden(
    spans_by_rank: dict[int, list[Span]], comm_kinds: Iterable[str], cover_kinds: Iterable[str], name: str | None = None
) -> tuple[int, int]:
    """``(|∪comm|, |∪comm ∩ ∪cover|)`` summed over ranks, where cover excludes the rank's waits; ``name``
    restricts comm to one layer."""
    comm_ns = hidden_ns = 0
    for spans in spans_by_rank.values():
        comm = _intervals(spans, comm_kinds, name)
        comm_ns += total_length(comm)
        cover = difference(_intervals(spans, cover_kinds), _intervals(spans, WAIT_KINDS))
        hidden_ns += intersection_length(comm, cover)
    return comm_ns, hidden_ns


def _waits(spans_by_rank: dict[int, list[Span]], samples: int) -> dict[str, float]:
    """Milliseconds per rank-iteration the training thread waited, by what it waited on."""
    waited = dict.fromkeys(WAIT_NAMES, 0)
    for spans in spans_by_rank.values():
        for span in spans:
            if span.kind in WAIT_KINDS:
                waited[span.name] = waited.get(span.name, 0) + span.duration_ns
    return {name: _per(ns, samples) / NS_PER_MS for name, ns in waited.items()}


def _format_waits(waits: dict[str, float]) -> str:
    parts = ", ".join(f"{name} {ms:.3f}" for name, ms in waits.items())
    return f"{sum(waits.values()):.3f} ms ({parts})"


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


def _per(total: float, samples: int) -> float:
    return total / samples if samples else 0.0


def _layer_names(spans_by_rank: dict[int, list[Span]]) -> list[str]:
    """Layers in the order their first sync/network span starts."""
    first: dict[str, int] = {}
    for spans in spans_by_rank.values():
        for span in spans:
            if span.kind in ("sync", *COMM_KINDS):
                first[span.name] = min(first.get(span.name, span.start_ns), span.start_ns)
    return sorted(first, key=lambda name: (first[name], name))


def short_name(name: str, width: int = 48) -> str:
    """A fused bucket's name (layers joined by "+") for a table: whole if it fits in ``width``, else its
    first and last layers and how many there are (``--json`` keeps the whole name)."""
    layers = name.split("+")
    if len(name) <= width or len(layers) < 3:
        return name
    return f"{layers[0]}+...+{layers[-1]} ({len(layers)} layers)"


def _layer_row(name: str, spans_by_rank: dict[int, list[Span]], samples: int) -> dict:
    layer = [s for spans in spans_by_rank.values() for s in spans if s.name == name]
    paths = sorted({str(s.args["path"]) for s in layer if s.kind in ("sync", *COMM_KINDS) and "path" in s.args})
    network_ns, hidden_ns = _hidden(spans_by_rank, COMM_KINDS, ("backward",), name)
    return {
        "layer": name,
        "path": "/".join(paths) or "-",
        "bytes_per_iteration": _per(sum(s.args.get("bytes", 0) for s in layer if s.kind in JOB_KINDS), samples),
        "comm_ms_per_iteration": _per(sum(s.duration_ns for s in layer if s.kind in COMM_KINDS), samples) / NS_PER_MS,
        "hidden_share": _ratio(hidden_ns, network_ns),
    }


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], left_aligned: int) -> list[str]:
    """Rows aligned in columns: the first ``left_aligned`` columns flush left, the rest flush right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: tuple[str, ...]) -> str:
        padded = [c.ljust(w) if i < left_aligned else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(row) for row in rows]
