"""Issue 19: torch.compile. The wrapper stays eager and the module underneath compiles, with no graph
break from the engine, either way round; the compiled backward is cut at bucket boundaries (dynamo's
DDPOptimizer), so syncs still start during backward; FC layers inside a compiled graph stay on PS."""
from __future__ import annotations

import pytest
import torch

import workers

LAYERWISE = {"fusion_bytes": 1 << 20}


def assert_matches_eager_ddp(results: list[dict], reference: list[dict]) -> None:
    for ours, theirs in zip(results, reference):
        for name, value in theirs["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["inner", "outer"], ids=["compile-then-wrap", "wrap-then-compile"])
def test_compiled_module_trains_exactly_without_graph_breaks_and_keeps_overlap(cluster, how):
    reference = cluster.run(workers.compiled_training, "eager", {}, timeout=240)
    results = cluster.run(workers.compiled_training, how, {**LAYERWISE, "link": workers.slow_link()}, timeout=240)
    assert_matches_eager_ddp(results, reference)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["graph_breaks"] == 0
        # compiled once: no guard on the engine's state (an FC hook that read its own flag before asking
        # dynamo whether it was tracing recompiled the whole model when the flag changed after pass 1)
        assert r["graphs_compiled"] == 1, r["graphs_compiled"]
        assert r["outcomes"] == {"PS"}  # the FC layers' calls were compiled: never SFB, whatever the link says
        assert r["compiled_backwards"] > 1, r["compiled_backwards"]  # dynamo cut the graph at buckets
        assert r["spread"] > 0.35, r["spread"]  # one fused backward would make every bucket ready at once


@pytest.mark.slow
def test_without_the_split_every_bucket_is_ready_at_once(cluster):
    """The control for the cut above: with dynamo's DDP optimisation off, the compiled backward is one
    function, so every bucket becomes ready at its end (its timing spread is left out: a loaded
    2-core machine stretched it past any fixed bound)."""
    results = cluster.run(workers.compiled_training, "inner", LAYERWISE, None, False, timeout=240)
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    assert all(r["compiled_backwards"] == 1 for r in results), [r["compiled_backwards"] for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["step-waits", "lazy-pull"])
def test_server_optimizer_under_compile(cluster, server):
    results = cluster.run(workers.compiled_training, "inner", LAYERWISE, server, timeout=240)
    if server == "lazy-pull":  # the per-module waits cannot run inside a compiled graph: a clear error
        assert all("torch.compile" in r["error"] for r in results), [r["error"] for r in results]
        return
    eager = cluster.run(workers.compiled_training, "eager", {}, timeout=240)
    for r in results:
        assert r["error"] is None and r["graph_breaks"] == 0, r["error"]
    assert_matches_eager_ddp(results, eager)


def test_compiled_graphs_are_cut_where_torch_ddp_cuts(cluster):
    """By default at DDP's 25 MiB (PoseidonDDP's own 4 MiB fusion cap cut a 17 M-parameter GPT-2 into
    about 16 compiled pieces: 16% more CPU per step than compiled DDP), else at the cap the user set."""
    for caps in cluster.run(workers.compile_split_caps, timeout=60):
        assert caps == [25 << 20, 2 << 20, 3 << 20], caps
