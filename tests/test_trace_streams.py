"""The GPU stream report read from a profiler trace (synthetic traces, so it runs without a GPU)."""
from __future__ import annotations

import pytest

from poseidon_torch.trace.streams import format_report, stream_report


def kernel(stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def copy(stream: int, ts: float, dur: float, kind: str = "DtoH") -> dict:
    name = "Memcpy DtoH (Device -> Pinned)" if kind == "DtoH" else "Memcpy HtoD (Pinned -> Device)"
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_copies_on_a_side_stream_under_training_kernels():
    # training stream 7: kernels over [0, 100) and [150, 200); side stream 20: copies [50, 90) (hidden),
    # [100, 140) (exposed: no training kernel then), [190, 210) (half hidden); one H2D on stream 7
    events = [kernel(7, 0, 100), kernel(7, 150, 50), kernel(20, 95, 1),
              copy(20, 50, 40), copy(20, 100, 40), copy(20, 190, 20), copy(7, 220, 20, "HtoD")]
    report = stream_report({"traceEvents": events})
    assert report["training_stream"] == 7
    assert report["streams"][20]["d2h_us"] == 100 and report["streams"][20]["d2h_count"] == 3
    assert report["streams"][7]["h2d_us"] == 20 and report["streams"][7]["kernel_us"] == 150
    assert report["side_copy_share"] == pytest.approx(100 / 120)
    assert report["side_copy_hidden"] == pytest.approx((40 + 10) / 100)
    assert "(training)" in format_report(report)


def test_copies_on_the_training_stream_are_not_side_copies():
    report = stream_report([kernel(7, 0, 100), copy(7, 100, 10)])
    assert report["side_copy_share"] == 0.0 and report["side_copy_hidden"] == 1.0


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no CUDA kernel"):
        stream_report({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})
