"""Read and write Poseidon traces as Chrome Trace Event JSON (opens in Perfetto and chrome://tracing).

A trace file is one JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": ...}``.

Invariants of the files written here:
- every :class:`~poseidon_torch.spans.Span` becomes one complete event (``"ph": "X"``) with
  ``name = span.name``, ``cat = span.kind``, ``ts``/``dur`` in (float) microseconds, ``pid`` = rank,
  an integer ``tid`` per lane, and ``args = {**span.args, "iteration": ..., "lane": ...}``;
- lane ``"compute"`` is ``tid`` 0, the other lanes follow in natural name order (``channel-2`` before
  ``channel-10``) as ``tid`` 1, 2, ...;
- each rank's process carries ``process_name`` ("rank R") and ``process_sort_index`` metadata
  events, each used lane ``thread_name`` (the lane name) and ``thread_sort_index`` (its tid);
- a per-rank file's ``otherData["poseidon"]`` is ``{**meta, "rank", "world_size", "version": 1}``;
  a merged file (:func:`merge_traces` of per-rank files, or :func:`write_merged_trace` of gathered
  spans: the same result) has one process per rank and
  ``{"version": 1, "world_size", "ranks": {"<rank>": <that rank's dict>}}``;
- :func:`load_spans` inverts :func:`write_rank_trace` for spans whose args are JSON values and do
  not use the keys ``iteration`` or ``lane``; times are rounded back to integer nanoseconds, exact
  below 2**51 ns (26 days of ``monotonic_ns``) and within 1 ns beyond (float64 microseconds).
"""
from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from .spans import SPAN_KINDS, Span

TRACE_VERSION = 1
COMPUTE_LANE = "compute"

PathLike = str | os.PathLike[str]


class TraceFormatError(ValueError):
    """A trace file is not valid JSON or not a Poseidon Chrome trace."""


def ordered_lanes(lanes: Iterable[str]) -> list[str]:
    """Distinct lane names in display order: ``compute`` first, then natural name order."""
    return sorted(set(lanes), key=_lane_key)


def write_rank_trace(path: PathLike, spans: list[Span], rank: int, world_size: int, meta: dict) -> None:
    """Write one rank's ``spans`` to ``path`` as a Chrome trace (``pid`` = ``rank``)."""
    poseidon = _rank_meta(rank, world_size, meta)
    _write_trace(path, _rank_events(spans, rank), poseidon)


def write_merged_trace(path: PathLike, spans_by_rank: list[list[Span]], world_size: int, meta: dict) -> None:
    """Write all ranks' spans (``spans_by_rank[rank]``) to one merged trace, as :func:`merge_traces` would."""
    events = [event for rank, spans in enumerate(spans_by_rank) for event in _rank_events(spans, rank)]
    ranks = {str(rank): _rank_meta(rank, world_size, meta) for rank in range(len(spans_by_rank))}
    _write_trace(path, events, {"version": TRACE_VERSION, "world_size": world_size, "ranks": ranks})


def merge_traces(paths: list[PathLike], out_path: PathLike) -> None:
    """Merge per-rank (or already merged) traces into one file with one process row per rank."""
    if not paths:
        raise ValueError("merge_traces needs at least one trace file")
    inputs = []
    for path in paths:
        document = _read_trace(path)
        inputs.append((_rank_metas(document, path), document["traceEvents"], os.fspath(path)))
    inputs.sort(key=lambda item: min(item[0]))
    ranks: dict[int, dict] = {}
    events: list[dict] = []
    for metas, trace_events, path in inputs:
        for rank, rank_meta in metas.items():
            if rank in ranks:
                raise TraceFormatError(f"{path}: rank {rank} appears in more than one input trace")
            ranks[rank] = rank_meta
        events += trace_events
    poseidon = {
        "version": TRACE_VERSION,
        "world_size": _common_world_size(ranks, paths),
        "ranks": {str(rank): meta for rank, meta in sorted(ranks.items())},
    }
    _write_trace(out_path, events, poseidon)


def load_spans(path: PathLike) -> dict[int, list[Span]]:
    """Rebuild spans from a per-rank or merged trace: ``{rank: spans sorted by start}``."""
    events = _read_trace(path)["traceEvents"]
    lane_names = _thread_names(events, path)
    spans: dict[int, list[Span]] = {}
    for index, event in enumerate(events):
        if _field(event, "ph", str, path, index) == "M" and event.get("name") == "process_name":
            spans.setdefault(_field(event, "pid", int, path, index), [])
        elif event["ph"] == "X":
            span = _event_span(event, lane_names, path, index)
            spans.setdefault(event["pid"], []).append(span)
    for rank_spans in spans.values():
        rank_spans.sort(key=lambda span: (span.start_ns, span.end_ns))
    return dict(sorted(spans.items()))


def load_metadata(path: PathLike) -> dict[int, dict]:
    """``{rank: that rank's otherData.poseidon}`` of a per-rank or merged trace (its window and, when the
    engine wrote it, the model's ``layout``)."""
    return _rank_metas(_read_trace(path), path)


def _lane_key(lane: str) -> tuple[bool, list[tuple[int, int | str]]]:
    parts = re.split(r"(\d+)", lane)
    return lane != COMPUTE_LANE, [(0, int(part)) if part.isdigit() else (1, part) for part in parts]


def _lane_tids(lanes: Iterable[str]) -> dict[str, int]:
    ordered = ordered_lanes(lanes)
    first = 0 if ordered and ordered[0] == COMPUTE_LANE else 1
    return {lane: tid for tid, lane in enumerate(ordered, start=first)}


def _process_metadata(rank: int) -> list[dict]:
    return [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]


def _thread_metadata(rank: int, tids: dict[str, int]) -> list[dict]:
    events = []
    for lane, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return events


def _span_event(span: Span, rank: int, tid: int) -> dict:
    if span.end_ns < span.start_ns:
        raise ValueError(f"span {span.kind} {span.name!r} on lane {span.lane!r} ends before it starts")
    return {
        "name": span.name,
        "cat": span.kind,
        "ph": "X",
        "ts": span.start_ns / 1000,
        "dur": span.duration_ns / 1000,
        "pid": rank,
        "tid": tid,
        "args": {**span.args, "iteration": span.iteration, "lane": span.lane},
    }


def _rank_events(spans: list[Span], rank: int) -> list[dict]:
    tids = _lane_tids(span.lane for span in spans)
    events = _process_metadata(rank) + _thread_metadata(rank, tids)
    return events + [_span_event(span, rank, tids[span.lane]) for span in spans]


def _rank_meta(rank: int, world_size: int, meta: dict) -> dict:
    return {**meta, "rank": rank, "world_size": world_size, "version": TRACE_VERSION}


def _write_trace(path: PathLike, events: list[dict], poseidon: dict) -> None:
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"poseidon": poseidon}}
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(document, stream, default=_json_value)


def _json_value(value: Any) -> Any:
    """JSON form of values ``json`` cannot write itself: numpy/torch scalars via ``item()``, else ``str``."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def _read_trace(path: PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as stream:
            document = json.load(stream)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "trace file not found", os.fspath(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{os.fspath(path)}: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise TraceFormatError(f"{os.fspath(path)}: top level is not a JSON object with 'traceEvents'")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise TraceFormatError(f"{os.fspath(path)}: 'traceEvents' list is missing")
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] is not a JSON object")
    return document


def _rank_metas(document: dict, path: PathLike) -> dict[int, dict]:
    """``{rank: otherData.poseidon of that rank}`` of a per-rank or merged trace."""
    other = document.get("otherData")
    poseidon = other.get("poseidon") if isinstance(other, dict) else None
    if not isinstance(poseidon, dict):
        raise TraceFormatError(f"{os.fspath(path)}: 'otherData.poseidon' is missing (not a poseidon_torch trace)")
    if poseidon.get("version") != TRACE_VERSION:
        raise TraceFormatError(f"{os.fspath(path)}: unsupported trace version {poseidon.get('version')!r}")
    ranks = poseidon.get("ranks")
    if isinstance(ranks, dict) and ranks and all(rank.isdigit() for rank in ranks):
        return {int(rank): meta for rank, meta in ranks.items()}
    if isinstance(poseidon.get("rank"), int):
        return {poseidon["rank"]: poseidon}
    raise TraceFormatError(f"{os.fspath(path)}: 'otherData.poseidon' has neither 'rank' nor valid 'ranks'")


def _common_world_size(ranks: dict[int, dict], paths: list[PathLike]) -> int | None:
    sizes = {meta.get("world_size") for meta in ranks.values()}
    if len(sizes) != 1:
        names = ", ".join(os.fspath(path) for path in paths)
        raise TraceFormatError(f"traces disagree on world_size ({sorted(map(str, sizes))}): {names}")
    return sizes.pop()


def _thread_names(events: list[dict], path: PathLike) -> dict[tuple[int, int], str]:
    names = {}
    for index, event in enumerate(events):
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            key = (_field(event, "pid", int, path, index), _field(event, "tid", int, path, index))
            names[key] = _field(event, "args", dict, path, index).get("name")
    return names


def _event_span(event: dict, lane_names: dict[tuple[int, int], str], path: PathLike, index: int) -> Span:
    pid = _field(event, "pid", int, path, index)
    kind = _field(event, "cat", str, path, index)
    if kind not in SPAN_KINDS:
        raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] has unknown span kind {kind!r}")
    ts = _field(event, "ts", (int, float), path, index)
    dur = _field(event, "dur", (int, float), path, index)
    if dur < 0:
        raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] has negative 'dur' {dur}")
    args = dict(_field(event, "args", dict, path, index))
    iteration = args.pop("iteration", None)
    if not isinstance(iteration, int):
        raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] lacks integer field 'args.iteration'")
    lane = args.pop("lane", None) or lane_names.get((pid, event.get("tid")))
    if not isinstance(lane, str):
        raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] has no lane (no 'args.lane', no thread_name)")
    start_ns = round(ts * 1000)
    name = _field(event, "name", str, path, index)
    return Span(kind, name, lane, start_ns, start_ns + round(dur * 1000), iteration, args)


def _field(event: dict, key: str, kind: type | tuple[type, ...], path: PathLike, index: int) -> Any:
    value = event.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        problem = "lacks field" if key not in event else f"has a non-{expected} field"
        raise TraceFormatError(f"{os.fspath(path)}: traceEvents[{index}] {problem} {key!r}")
    return value
