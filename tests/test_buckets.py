"""Buckets learned from the first backward: rank 0's readiness order, the same buckets on every rank."""
from __future__ import annotations

import workers
from poseidon_torch.bucket import JobCost, Layer, group_layers, readiness_order


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


def test_mg_wfbp_merges_only_where_it_delays_nothing_or_saves_latency():
    cost = JobCost(alpha_s=1e-3, beta_s_per_byte=1e-9)  # 1 ms per job, 1 GB/s
    big, small = 4_000_000, 40_000  # 4 ms and 0.04 ms of transfer
    layers = [layer("a", big), layer("b", small), layer("c", small), layer("d", big), layer("e", big)]
    ready = {"a": 0.0, "b": 0.001, "c": 0.0015, "d": 0.020, "e": 0.050}
    groups = group_layers(layers, cap_bytes=10**9, solo=set(), ready_s=ready, cost=cost)
    # a's sync runs until 5 ms: b and c, ready meanwhile, ride with a; d comes later (link idle), and
    # its own transfer is well above the latency: alone; e likewise
    assert [[x.name for x in g] for g in groups] == [["a", "b", "c"], ["d"], ["e"]]
    # small layers far apart in time still merge: each message would cost more latency than bytes
    spread = {"a": 0.0, "b": 0.010, "c": 0.020, "d": 0.030, "e": 0.040}
    smalls = [layer(n, small) for n in "abcde"]
    assert len(group_layers(smalls, 10**9, set(), spread, cost)) == 1
    # the cap and solo layers bound it
    assert [[x.name for x in g] for g in group_layers(smalls, 2 * small, set(), spread, cost)] == \
        [["a", "b"], ["c", "d"], ["e"]]
    assert [[x.name for x in g] for g in group_layers(smalls, 10**9, {"c"}, spread, cost)] == \
        [["a", "b"], ["c"], ["d", "e"]]


def test_readiness_order_puts_unready_layers_last():
    layers = [layer("a", 4), layer("b", 4), layer("c", 4)]
    ordered, ready = readiness_order(layers, param_order=[2, 0], param_ready_s=[0.1, 0.2])
    assert [x.name for x in ordered] == ["c", "a", "b"]
    assert ready == {"c": 0.1, "a": 0.2, "b": 0.2}
