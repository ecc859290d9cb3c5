"""Trace files and the poseidon-trace CLI on a synthetic 2-rank, 3-iteration trace with known overlap.

Per rank and iteration (ns from the iteration start ``B``; rank 1 differs only in fc2's network span):

    compute  forward model [0, 100k]   backward fc2 [100k, 200k]   backward fc1 [200k, 300k]
    channel-0  sync fc2 (SFB, 4096 B) [200k, 370k]: queue [200k, 210k], gather [210k, 250k],
               network [250k, 350k] (rank 1: [200k, 300k]), scatter [350k, 370k]
    channel-1  sync fc1 (PS, 1 MB) [300k, 420k]: gather [300k, 320k], network [320k, 400k], scatter [400k, 420k]
    iteration  [0, 450k / 460k / 500k] for iterations 0 / 1 / 2

Hand-computed (compute = [0, 300k]):
- rank 0: comm = [250k, 400k] = 150k, hidden 50k; rank 1: comm = [200k, 300k] + [320k, 400k] = 180k,
  hidden 100k. Overlap ratio = 3 * (50k + 100k) / (3 * (150k + 180k)) = 150 / 330.
- exposed per rank-iteration = 3 * (100k + 80k) / 6 = 90k ns = 0.09 ms; comm = 3 * 330k / 6 = 0.165 ms.
- fc2 hidden share = 3 * (50k + 100k) / (6 * 100k) = 0.75 (backward fc1 covers [200k, 300k]);
  fc1 hidden share = 0 (its network starts after backward ends).
- iteration time median of [450, 450, 460, 460, 500, 500] us = 0.46 ms; iterations start 1000 us apart
  (2 periods per rank), so the step period is 1.0 ms.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poseidon_torch.trace.spans import Span
from poseidon_torch.trace import main
from poseidon_torch.trace.files import (
    TraceFormatError,
    load_spans,
    merge_traces,
    write_merged_trace,
    write_rank_trace,
)

REPO = Path(__file__).resolve().parents[1]
T0 = 1_234_567_890_123_456  # a realistic monotonic_ns value, to exercise float microseconds
K = 1_000
ITERATION_NS = (450 * K, 460 * K, 500 * K)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rank_spans(rank: int) -> list[Span]:
    spans = []
    for it, length in enumerate(ITERATION_NS):
        base = T0 + it * 1_000 * K

        def add(kind, name, lane, start, end, **args):
            spans.append(Span(kind, name, lane, base + start, base + end, it, args))

        add("iteration", "iteration", "compute", 0, length)
        add("forward", "model", "compute", 0, 100 * K)
        add("backward", "fc2", "compute", 100 * K, 200 * K)
        add("backward", "fc1", "compute", 200 * K, 300 * K)
        add("sync", "fc2", "channel-0", 200 * K, 370 * K, path="SFB", bytes=4096)
        add("queue", "fc2", "channel-0", 200 * K, 210 * K)
        add("gather", "fc2", "stream-0", 210 * K, 250 * K)
        fc2_net = (250 * K, 350 * K) if rank == 0 else (200 * K, 300 * K)
        add("network", "fc2", "channel-0", *fc2_net, path="SFB")
        add("scatter", "fc2", "stream-0", 350 * K, 370 * K)
        add("sync", "fc1", "channel-1", 300 * K, 420 * K, path="PS", bytes=1_000_000)
        add("gather", "fc1", "stream-1", 300 * K, 320 * K)
        add("network", "fc1", "channel-1", 320 * K, 400 * K, path="PS")
        add("update", "fc1", "channel-1", 400 * K, 410 * K)  # parameter-server mode: not communication
        add("scatter", "fc1", "stream-1", 400 * K, 420 * K)
    return spans


@pytest.fixture
def rank_files(tmp_path) -> list[Path]:
    paths = []
    for rank in range(2):
        path = tmp_path / f"trace_rank{rank}.json"
        write_rank_trace(path, rank_spans(rank), rank, 2, {"skip": 5, "iters": 3})
        paths.append(path)
    return paths


@pytest.fixture
def merged(tmp_path, rank_files) -> Path:
    out = tmp_path / "trace_merged.json"
    merge_traces(list(reversed(rank_files)), out)
    return out


def summary_json(path: Path, capsys) -> dict:
    assert main(["summary", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_rank_trace_round_trips_spans(rank_files):
    loaded = load_spans(rank_files[1])
    expected = sorted(rank_spans(1), key=lambda s: (s.start_ns, s.end_ns))
    assert list(loaded) == [1]
    assert loaded[1] == expected


def test_rank_trace_events_follow_the_chrome_format(rank_files):
    document = json.loads(rank_files[0].read_text())
    assert document["displayTimeUnit"] == "ms"
    assert document["otherData"]["poseidon"] == {"rank": 0, "world_size": 2, "version": 1, "skip": 5, "iters": 3}
    complete = [e for e in document["traceEvents"] if e["ph"] == "X"]
    forward = next(e for e in complete if e["cat"] == "forward")
    assert forward["name"] == "model" and forward["pid"] == 0 and forward["tid"] == 0
    assert forward["ts"] == pytest.approx(T0 / 1000) and forward["dur"] == pytest.approx(100.0)
    assert forward["args"] == {"iteration": 0, "lane": "compute"}
    network = next(e for e in complete if e["cat"] == "network")
    assert network["args"] == {"path": "SFB", "iteration": 0, "lane": "channel-0"}


def test_merged_trace_has_metadata_for_every_rank(merged):
    document = json.loads(merged.read_text())
    events = document["traceEvents"]
    lanes = ["compute", "channel-0", "channel-1", "stream-0", "stream-1"]
    for rank in range(2):
        meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M" and e["pid"] == rank}
        assert meta[("process_name", 0)] == {"name": f"rank {rank}"}
        assert meta[("process_sort_index", 0)] == {"sort_index": rank}
        assert [meta[("thread_name", tid)]["name"] for tid in range(5)] == lanes
        assert [meta[("thread_sort_index", tid)]["sort_index"] for tid in range(5)] == list(range(5))
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    poseidon = document["otherData"]["poseidon"]
    assert poseidon["world_size"] == 2 and set(poseidon["ranks"]) == {"0", "1"}
    assert poseidon["ranks"]["1"]["rank"] == 1 and poseidon["ranks"]["1"]["iters"] == 3


def test_merged_trace_loads_both_ranks(merged):
    loaded = load_spans(merged)
    assert list(loaded) == [0, 1]
    assert loaded[0] == sorted(rank_spans(0), key=lambda s: (s.start_ns, s.end_ns))


def test_write_merged_trace_equals_merging_rank_files(tmp_path, merged):
    direct = tmp_path / "direct.json"
    write_merged_trace(direct, [rank_spans(0), rank_spans(1)], 2, {"skip": 5, "iters": 3})
    assert json.loads(direct.read_text()) == json.loads(merged.read_text())


def test_merging_a_rank_twice_is_rejected(tmp_path, rank_files):
    with pytest.raises(TraceFormatError, match="rank 0"):
        merge_traces([rank_files[0], rank_files[0]], tmp_path / "out.json")


def test_lanes_get_natural_tid_order(tmp_path):
    lanes = ["channel-10", "compute", "channel-2", "stream-0"]
    spans = [Span("queue", "x", lane, 0, 1, 0) for lane in lanes]
    write_rank_trace(tmp_path / "t.json", spans, 3, 4, {})
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    tids = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert tids == {"compute": 0, "channel-2": 1, "channel-10": 2, "stream-0": 3}


def test_lane_falls_back_to_thread_name_metadata(tmp_path):
    events = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 4, "args": {"name": "channel-3"}},
        {"ph": "X", "name": "fc", "cat": "network", "ts": 1.5, "dur": 2.0, "pid": 0, "tid": 4,
         "args": {"iteration": 7}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert load_spans(path) == {0: [Span("network", "fc", "channel-3", 1500, 3500, 7, {})]}


def test_reversed_span_is_not_written(tmp_path):
    with pytest.raises(ValueError, match="ends before it starts"):
        write_rank_trace(tmp_path / "t.json", [Span("gather", "fc", "stream-0", 5, 4, 0)], 0, 1, {})


def test_summary_json_matches_hand_computed_values(merged, capsys):
    summary = summary_json(merged, capsys)
    assert summary["ranks"] == 2 and summary["iterations"] == 3 and summary["rank_iterations"] == 6
    assert summary["overlap_ratio"] == pytest.approx(150 / 330)
    assert summary["exposed_comm_ms_per_iteration"] == pytest.approx(0.09)
    assert summary["comm_ms_per_iteration"] == pytest.approx(0.165)
    assert summary["iteration_ms_median"] == pytest.approx(0.46)
    assert summary["step_ms_median"] == pytest.approx(1.0)
    layers = {row["layer"]: row for row in summary["layers"]}
    assert [row["layer"] for row in summary["layers"]] == ["fc2", "fc1"]
    assert layers["fc2"] == pytest.approx(
        {"layer": "fc2", "path": "SFB", "bytes_per_iteration": 4096, "comm_ms_per_iteration": 0.1, "hidden_share": 0.75}
    )
    assert layers["fc1"] == pytest.approx(
        {"layer": "fc1", "path": "PS", "bytes_per_iteration": 1e6, "comm_ms_per_iteration": 0.08, "hidden_share": 0.0}
    )


def spans_with_waits() -> dict[int, list[Span]]:
    """The synthetic trace plus waits: every rank on the facts [300k, 340k], rank 0 on jobs [260k, 280k]."""
    spans = {rank: rank_spans(rank) for rank in range(2)}
    for rank, rank_list in spans.items():
        for it in range(len(ITERATION_NS)):
            base = T0 + it * 1_000 * K
            rank_list.append(Span("wait", "facts", "compute", base + 300 * K, base + 340 * K, it))
            if rank == 0:
                rank_list.append(Span("wait", "jobs", "compute", base + 260 * K, base + 280 * K, it))
    return spans


def test_waits_are_reported_and_hide_no_communication():
    """Waits added to the synthetic trace: every rank waits on the facts [300k, 340k] (after backward);
    rank 0 also waits on jobs [260k, 280k], inside backward fc1 while fc2's network [250k, 350k] runs.
    Rank 0's hidden time drops from 50k to 30k per iteration ([250k, 260k] + [280k, 300k]): overlap
    3 * (30k + 100k) / (3 * 330k); fc2's hidden share 3 * (30k + 100k) / (6 * 100k) = 0.65; waits per
    rank-iteration: facts 3 * 2 * 40k / 6 = 0.04 ms, jobs 3 * 20k / 6 = 0.01 ms."""
    from poseidon_torch.trace import summarize

    summary = summarize(spans_with_waits())
    assert summary["overlap_ratio"] == pytest.approx(130 / 330)
    assert summary["exposed_comm_ms_per_iteration"] == pytest.approx(3 * (120 + 80) * K / 6 / 1e6)
    fc2 = next(row for row in summary["layers"] if row["layer"] == "fc2")
    assert fc2["hidden_share"] == pytest.approx(0.65)
    assert summary["waits_ms_per_iteration"] == pytest.approx({"jobs": 0.01, "facts": 0.04, "forward collectives": 0.0,
                                                                 "values": 0.0})


def test_summary_of_one_rank_file(rank_files, capsys):
    summary = summary_json(rank_files[0], capsys)
    assert summary["ranks"] == 1
    assert summary["overlap_ratio"] == pytest.approx(50 / 150)
    assert summary["exposed_comm_ms_per_iteration"] == pytest.approx(0.1)


def test_summary_text_is_an_aligned_table(merged, capsys):
    assert main(["summary", str(merged)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    table = lines[header:header + 3]
    assert table[1].split()[:2] == ["fc2", "SFB"] and table[2].split()[:2] == ["fc1", "PS"]
    assert len({len(line) for line in table}) == 1  # right-aligned last column
    assert "75.0%" in table[1] and "45.5%" in out and "0.090 ms" in out and "0.460 ms" in out and "1.000 ms" in out


def test_plot_writes_a_png(merged, tmp_path):
    out = tmp_path / "timeline.png"
    assert main(["plot", str(merged), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1024


def test_waits_survive_the_files_and_plot(tmp_path, capsys):
    out = tmp_path / "trace_merged.json"
    write_merged_trace(out, list(spans_with_waits().values()), 2, {"skip": 0, "iters": 3})
    assert sum(s.kind == "wait" for s in load_spans(out)[0]) == 6
    text_ok = main(["summary", str(out)]) == 0
    assert text_ok and "waiting on the sync per iteration: 0.050 ms (jobs 0.010, facts 0.040" in capsys.readouterr().out
    png = tmp_path / "waits.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0 and png.read_bytes().startswith(PNG_MAGIC)


def test_plot_selected_iteration(merged, tmp_path):
    out = tmp_path / "it1.png"
    assert main(["plot", str(merged), "-o", str(out), "--iteration", "1"]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_into_missing_directory_fails_cleanly(merged, tmp_path, capsys):
    out = tmp_path / "no_such_dir" / "t.png"
    assert main(["plot", str(merged), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"poseidon-trace: error: {out}: No such file or directory\n"


def test_plot_unrecorded_iteration_fails_cleanly(merged, tmp_path, capsys):
    assert main(["plot", str(merged), "-o", str(tmp_path / "x.png"), "--iteration", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("poseidon-trace: error: ") and "iteration 7" in err and "0..2" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("command", [["summary"], ["plot", "-o", "unused.png"]])
def test_missing_file_exits_2(tmp_path, capsys, command):
    missing = tmp_path / "nope.json"
    assert main([command[0], str(missing), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err == f"poseidon-trace: error: {missing}: trace file not found\n"


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        ('{"traceEvents": [', "not valid JSON"),
        ('{"events": []}', "'traceEvents' list is missing"),
        ('{"traceEvents": [{"ph": "X", "name": "a", "cat": "network", "ts": 1, "pid": 0}]}', "lacks field 'dur'"),
        ('{"traceEvents": [{"ph": "X", "name": "a", "cat": "bogus", "ts": 1, "dur": 1, "pid": 0}]}',
         "unknown span kind"),
        ('{"traceEvents": [{"ph": "X", "name": "a", "cat": "sync", "ts": 1, "dur": 1, "args": {"lane": "c"}}]}',
         "lacks field 'pid'"),
    ],
)
def test_malformed_trace_exits_2(tmp_path, capsys, content, cause):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["summary", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"poseidon-trace: error: {bad}: ") and cause in err
    with pytest.raises(TraceFormatError, match=cause):
        load_spans(bad)


def test_load_spans_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_spans(tmp_path / "nope.json")


@pytest.mark.slow
def test_module_entry_point_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "poseidon_torch.trace", "summary", str(bad)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("poseidon-trace: error:") and "bad.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_summary_table_shortens_long_fused_names():
    from poseidon_torch.trace.summary import short_name

    fused = "+".join(f"blocks.{i}" for i in range(40))
    assert short_name(fused) == "blocks.0+...+blocks.39 (40 layers)"
    assert short_name("head+fc") == "head+fc"
