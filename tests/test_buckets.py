"""Buckets learned from the first backward: rank 0's readiness order, the same buckets on every rank;
the first rebuild costs jobs by the link model."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import workers
from poseidon_torch.bucket import JobCost, Layer, group_layers, readiness_order


@pytest.mark.slow
def test_learned_buckets_are_identical_on_all_ranks_when_hook_order_differs(cluster):
    results = cluster.run(workers.learned_buckets)
    orders = {tuple(r["order"]) for r in results}
    assert len(orders) == 2, "the ranks' readiness orders should differ (two branches, forward order flipped)"
    learned = [r["learned"] for r in results]
    assert all(names == learned[0] for names in learned), learned
    assert learned[0] != results[0]["initial"], "the buckets were not rebuilt from the first backward"
    # the learned order is rank 0's: its first bucket holds the layer whose gradient was ready first
    first_ready = results[0]["order"][0].rsplit(".", 1)[0]
    assert first_ready in learned[0][0].split("+")
    for name, grad in results[0]["grads"].items():  # and the gradients are the same everywhere
        assert all((r["grads"][name] == grad).all() for r in results)


class FakeParam:
    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4

    dtype, device = "float32", "cpu"


def layer(name: str, nbytes: int) -> Layer:
    return Layer(name, None, ((f"{name}.w", FakeParam(nbytes // 4)),))


def names(groups):
    return [[x.name for x in g] for g in groups]


def pipeline_end(groups, ready, cost):
    """When the last of ``groups``' sync jobs ends, jobs run one at a time, each from when its last
    layer is ready and the previous one is done."""
    link_free = 0.0
    for group in groups:
        link_free = max(link_free, ready[group[-1].name]) + cost.alpha_s + \
            cost.beta_s_per_byte * sum(x.nbytes for x in group)
    return link_free


def test_only_the_tail_keeps_short_jobs():
    cost = JobCost(alpha_s=1e-3, beta_s_per_byte=1e-9)  # 1 ms per job, 1 GB/s
    big, small = 4_000_000, 40_000  # 4 ms and 0.04 ms of transfer
    layers = [layer("a", big), layer("b", small), layer("c", small), layer("d", big), layer("e", big)]
    ready = {"a": 0.0, "b": 0.001, "c": 0.0015, "d": 0.020, "e": 0.050}
    # e, ready last, ends at 55 ms whatever comes before it, as long as the link is free by 50 ms: a..d
    # wait for d and go as one job (ends 29 ms), e alone (one job more would end at 63 ms)
    assert names(group_layers(layers, 10**9, set(), ready, cost)) == [["a", "b", "c", "d"], ["e"]]
    # d ready at 49 ms: a..d in one job would hold the link until 58 ms; merged with e, d's transfer
    # saves a latency instead (ends 59 ms, the best any grouping reaches)
    late = {**ready, "d": 0.049}
    assert names(group_layers(layers, 10**9, set(), late, cost)) == [["a", "b", "c"], ["d", "e"]]
    # the cap (on what a bucket holds besides its largest layer) and solo layers bound a bucket: the
    # small layers ride with a layer above the cap
    assert names(group_layers(layers, 2 * small, set(), ready, cost)) == [["a", "b", "c"], ["d"], ["e"]]
    assert names(group_layers(layers, small, set(), ready, cost)) == [["a", "b"], ["c", "d"], ["e"]]
    assert names(group_layers(layers, 10**9, {"c"}, ready, cost)) == [["a", "b"], ["c"], ["d"], ["e"]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4_000_000), st.floats(0, 0.004), st.integers(0, 7).map(lambda v: v == 0)),
                min_size=1, max_size=8),
       st.floats(1e-4, 2e-3), st.floats(1e-10, 2e-9), st.integers(1_000_000, 16_000_000))
def test_fewest_jobs_that_keep_the_best_end(specs, alpha, beta, cap):
    """Against every contiguous split: the grouping is allowed (cap, solo), its pipeline ends within
    one latency of the best split's, and no allowed split with fewer jobs does."""
    cost = JobCost(alpha, beta)
    layers = [layer(f"l{i}", nbytes) for i, (nbytes, _, _) in enumerate(specs)]
    ready = dict(zip((x.name for x in layers), itertools.accumulate(gap for _, gap, _ in specs)))
    solo = {x.name for x, (_, _, alone) in zip(layers, specs) if alone}

    def allowed(group):
        sizes = [x.nbytes for x in group]
        return len(group) == 1 or (sum(sizes) - max(sizes) <= cap and not solo & {x.name for x in group})

    splits = []
    for cuts in itertools.product([False, True], repeat=len(layers) - 1):
        groups, current = [], [layers[0]]
        for layer_, cut in zip(layers[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(layer_)
        groups.append(current)
        if all(allowed(g) for g in groups):
            splits.append(groups)
    best = min(pipeline_end(s, ready, cost) for s in splits)
    fewest = min(len(s) for s in splits if pipeline_end(s, ready, cost) <= best + alpha * (1 + 1e-9))

    chosen = group_layers(layers, cap, solo, ready, cost)
    assert [x for g in chosen for x in g] == layers and all(allowed(g) for g in chosen)
    assert pipeline_end(chosen, ready, cost) <= best + alpha * (1 + 1e-9)
    assert len(chosen) == fewest


def test_readiness_order_puts_unready_layers_last():
    layers = [layer("a", 4), layer("b", 4), layer("c", 4)]
    ordered, ready = readiness_order(layers, param_order=[2, 0], param_ready_s=[0.1, 0.2])
    assert [x.name for x in ordered] == ["c", "a", "b"]
    assert ready == {"c": 0.1, "a": 0.2, "b": 0.2}


@pytest.mark.slow
def test_the_first_rebuild_ignores_how_slow_the_first_jobs_were(cluster):
    """Issue 20: the first pass's job times are cold; a job cost fitted to them learned 2 to 7 jobs in
    fresh runs of one model. The first rebuild costs jobs by the link model: the same buckets whether
    the first jobs were fast or took 20 us per byte (where a fitted cost would split every layer)."""
    fast = cluster.run(workers.buckets_learned_after_cold_jobs, 0.0, timeout=60)
    slow = cluster.run(workers.buckets_learned_after_cold_jobs, 2e-5, timeout=60)
    assert fast == slow, (fast, slow)
    assert len(fast[0]) == 2, fast[0]  # by the link model: the fp32 layers fuse, the fp64 one apart


def test_fc_layers_fused_with_others_are_not_watched(cluster):
    """Issue 20: an FC layer that shares its bucket cannot take SFB, so its calls are not watched (the
    capture hooks cost ~40 us per call in Python); a layer alone in its bucket is watched and committed."""
    for seen in cluster.run(workers.fc_layers_watched_after_learning, timeout=60):
        assert seen["0"] == (False, 0, False) and seen["1"] == (False, 0, False), seen
        assert seen["3"] == (True, 5, True), seen
