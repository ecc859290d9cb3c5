"""Wait-free backprop: syncs start while backward is still computing the lower layers."""
from __future__ import annotations

import json

import pytest

import workers


def test_last_layer_sync_starts_before_first_layer_backward_ends(cluster, tmp_path):
    results = cluster.run(workers.sync_timing, str(tmp_path))
    for rank, r in enumerate(results):
        last_layer = r["syncers"][0]
        assert last_layer.startswith("6"), f"bucket order should start at the output layer: {r['syncers']}"
        network = [s for s in r["spans"] if s.kind == "network" and s.name == last_layer]
        assert len(network) == 1
        lead_ms = (r["first_ready_ns"] - network[0].start_ns) / 1e6
        assert lead_ms > 0, f"rank {rank}: last layer's sync started {-lead_ms:.2f} ms after backward ended"
    merged = json.loads((tmp_path / "trace_merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == set(range(cluster.world_size))


def test_real_trace_covers_every_layer_and_rank_and_summary_agrees(cluster, tmp_path):
    from poseidon_torch import trace
    from poseidon_torch.trace import files as tracefile

    iters = 3
    results = cluster.run(workers.traced_training, str(tmp_path), iters)
    merged = tmp_path / "trace_merged.json"
    spans = tracefile.load_spans(merged)
    assert sorted(spans) == list(range(cluster.world_size))
    for rank, rank_spans in spans.items():
        assert {s.iteration for s in rank_spans} == {1, 2, 3}
        for kind in ("forward", "iteration"):
            assert sum(s.kind == kind for s in rank_spans) == iters
        for name in results[rank]["syncers"]:
            for kind in ("queue", "network", "sync"):
                assert sum(s.kind == kind and s.name == name for s in rank_spans) == iters, (rank, name, kind)
        assert {s.args["path"] for s in rank_spans if s.kind == "sync"} == {"PS", "SFB"}
    summary = trace.summarize(spans)
    for row in summary["layers"]:
        network = [s for r in spans.values() for s in r if s.kind == "network" and s.name == row["layer"]]
        comm_ms = sum(s.duration_ns for s in network) / 1e6 / (iters * cluster.world_size)
        assert abs(row["comm_ms_per_iteration"] - comm_ms) < 1e-6
        engine_bytes = [b[row["layer"]] for r in results for b in r["bytes_by_syncer"]]
        assert row["bytes_per_iteration"] == pytest.approx(sum(engine_bytes) / len(engine_bytes))
    assert summary["iterations"] == iters and summary["ranks"] == cluster.world_size
    for rank_spans in spans.values():  # BSP: the training thread waits for the jobs after its backward
        for iteration in (1, 2, 3):
            waits = _waits(rank_spans, iteration)
            assert sorted(waits) == ["facts", "forward collectives", "jobs"], (iteration, waits)
            backward_starts = [s.start_ns for s in rank_spans if s.kind == "backward" and s.iteration == iteration]
            assert waits["jobs"].start_ns >= max(backward_starts)
            assert waits["facts"].start_ns >= waits["jobs"].end_ns
    assert summary["waits_ms_per_iteration"]["jobs"] > 0
    for rank_spans in spans.values():  # BSP: a pass closes inside its step
        for span, period in _iterations_and_periods(rank_spans):
            assert span.duration_ns < period, (span, period)


def test_pipe_sgd_trace_shows_the_jobs_waited_for_in_the_next_backward(cluster, tmp_path):
    """delay=1: a pass's jobs, then its facts, are waited for in the next step's backward, after its
    forward and before its first bucket is submitted; nothing is waited for at the end of a backward (no
    barrier per step). Each step's backward spans lie in its own backward, after its forward; an
    iteration span (to where its pass closes) outlasts the step period."""
    from poseidon_torch import trace
    from poseidon_torch.trace import files as tracefile

    cluster.run(workers.traced_training, str(tmp_path), 3, 1)
    spans = tracefile.load_spans(tmp_path / "trace_merged.json")
    assert trace.summarize(spans)["step_ms_median"] is not None
    for rank_spans in spans.values():
        for span, period in _iterations_and_periods(rank_spans):
            assert span.duration_ns > period, (span, period)
        for iteration in (1, 2):
            waits = _waits(rank_spans, iteration)
            (forward,) = [s for s in rank_spans if s.kind == "forward" and s.iteration == iteration]
            backward = sorted((s for s in rank_spans if s.kind == "backward" and s.iteration == iteration),
                              key=lambda s: s.start_ns)
            assert forward.end_ns <= backward[0].start_ns <= waits["jobs"].start_ns, iteration
            assert waits["jobs"].end_ns <= waits["facts"].start_ns, iteration
            assert waits["facts"].end_ns <= backward[0].end_ns, iteration
            (next_forward,) = [s for s in rank_spans if s.kind == "forward" and s.iteration == iteration + 1]
            assert backward[-1].end_ns <= next_forward.start_ns, iteration


def test_a_pipe_sgd_window_whose_last_pass_is_open_at_close_is_written_whole(cluster, tmp_path):
    """delay=1, a run of exactly skip + iters steps: the window's last pass closes at a forward that never
    comes; ``close()`` records it (no collective) and each rank's file holds every traced iteration."""
    from poseidon_torch.trace import load_spans

    results = cluster.run(workers.trace_cut_short, str(tmp_path), 4, 1, 3, 1)
    (note,) = results[0]["warnings"]
    assert "last pass was still open" in note and "merge" in note
    for rank in range(cluster.world_size):
        spans = load_spans(tmp_path / f"trace_rank{rank}.json")[rank]
        for iteration in (1, 2, 3):
            assert sum(s.kind == "iteration" and s.iteration == iteration for s in spans) == 1, (rank, iteration)
            assert any(s.kind == "backward" and s.iteration == iteration for s in spans), (rank, iteration)
        assert {s.iteration for s in spans} == {1, 2, 3}


def _iterations_and_periods(spans) -> list:
    """(iteration span, ns from its start to the next iteration's start) for consecutive iterations."""
    by_index = {s.iteration: s for s in spans if s.kind == "iteration"}
    return [(span, by_index[i + 1].start_ns - span.start_ns) for i, span in by_index.items() if i + 1 in by_index]


def _waits(spans, iteration: int) -> dict:
    """The wait spans of ``iteration``, by name (one each)."""
    waits = [s for s in spans if s.kind == "wait" and s.iteration == iteration]
    by_name = {s.name: s for s in waits}
    assert len(by_name) == len(waits), waits
    return by_name


def test_user_profiler_sees_every_sync_job(cluster):
    for r in cluster.run(workers.profiled_step):
        assert r["events"] == r["expected"]


def test_a_run_shorter_than_the_trace_window_writes_what_it_recorded(cluster, tmp_path):
    """Issue 19: a run that ends inside the window wrote nothing and said nothing."""
    from poseidon_torch.trace import load_spans, main

    results = cluster.run(workers.trace_cut_short, str(tmp_path), 3, 1)
    files = sorted(tmp_path.glob("trace_rank*.json"))
    assert len(files) == cluster.world_size
    (note,) = results[0]["warnings"]
    assert "2 of the 10 traced iteration(s)" in note and "merge" in note
    assert all(r["warnings"] == [] for r in results[1:])  # said once, by rank 0
    merged = tmp_path / "merged.json"
    assert main(["merge", "-o", str(merged), *map(str, files)]) == 0
    spans = load_spans(merged)
    assert sorted(spans) == list(range(cluster.world_size))
    assert {s.iteration for s in spans[0] if s.kind == "iteration"} == {1, 2}
    nothing = cluster.run(workers.trace_cut_short, str(tmp_path / "none"), 2, 5)
    assert "nothing was recorded" in nothing[0]["warnings"][0] and not (tmp_path / "none").exists()
