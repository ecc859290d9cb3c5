"""Where the device work of a step ran, read from a ``torch.profiler`` Chrome trace (CUDA activity).

The tracer's own spans are host times; on a GPU the question is also which *stream* the sync's copies
ran on and whether they ran while the training stream computed. :func:`stream_report` answers it from
the kernel and memcpy events of a profiler trace (``prof.export_chrome_trace``).

Invariants:
- the training stream is the stream with the most kernel time (the backward's);
- ``side_copy_share``: of all device-to-host and host-to-device copy time, the share on other streams;
- ``side_copy_hidden``: of the copy time on other streams, the share during which a kernel ran on the
  training stream (HTA's overlap ratio, :func:`.overlap.overlap_ratio`; 1.0 with no such copy time);
- times are microseconds as the trace gives them, summed per stream (overlaps within a stream counted once).
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from .overlap import overlap_ratio, total_length

COPY_KINDS = {"DtoH": "d2h", "HtoD": "h2d"}


def _copy_kind(name: str) -> str | None:
    return next((kind for tag, kind in COPY_KINDS.items() if tag in name), None)


def _intervals(events: Iterable[dict]) -> list[tuple[int, int]]:
    # nanoseconds as integers for the interval arithmetic
    return [(round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)) for e in events]


def stream_report(trace: dict | list) -> dict:
    """Per stream: kernel and copy time; which stream trains; how much copy time is off it and hidden."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels, copies = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("ph") != "X" or "stream" not in event.get("args", {}):
            continue
        stream = event["args"]["stream"]
        if event.get("cat") == "kernel":
            kernels[stream].append(event)
        elif event.get("cat") == "gpu_memcpy" and (kind := _copy_kind(event.get("name", ""))):
            copies[stream][kind].append(event)
    if not kernels:
        raise ValueError("the trace holds no CUDA kernel: was it recorded with ProfilerActivity.CUDA on a GPU?")
    training = max(kernels, key=lambda s: total_length(_intervals(kernels[s])))
    streams = {}
    for stream in sorted(set(kernels) | set(copies)):
        row = {"kernel_us": total_length(_intervals(kernels[stream])) / 1000}
        for kind in COPY_KINDS.values():
            row[f"{kind}_us"] = total_length(_intervals(copies[stream][kind])) / 1000
            row[f"{kind}_count"] = len(copies[stream][kind])
        streams[stream] = row
    copy_us = {s: sum(row[f"{k}_us"] for k in COPY_KINDS.values()) for s, row in streams.items()}
    side = [e for s in copies if s != training for kind in copies[s].values() for e in kind]
    total_copy = sum(copy_us.values())
    return {
        "training_stream": training,
        "streams": streams,
        "side_copy_share": (total_copy - copy_us.get(training, 0.0)) / total_copy if total_copy else 0.0,
        "side_copy_hidden": overlap_ratio(_intervals(side), _intervals(kernels[training])),
    }


def load_report(path: str | Path) -> dict:
    """:func:`stream_report` of the Chrome trace file at ``path``."""
    return stream_report(json.loads(Path(path).read_text()))


def format_report(report: dict) -> str:
    lines = [f"{'stream':>8} {'kernels ms':>11} {'D2H ms':>8} {'D2H n':>6} {'H2D ms':>8} {'H2D n':>6}"]
    for stream, row in report["streams"].items():
        mark = " (training)" if stream == report["training_stream"] else ""
        lines.append(f"{stream:>8} {row['kernel_us'] / 1e3:>11.2f} {row['d2h_us'] / 1e3:>8.2f} {row['d2h_count']:>6} "
                     f"{row['h2d_us'] / 1e3:>8.2f} {row['h2d_count']:>6}{mark}")
    lines.append(f"copy time off the training stream: {report['side_copy_share']:.1%}; "
                 f"of it, under a training-stream kernel: {report['side_copy_hidden']:.1%}")
    return "\n".join(lines)
