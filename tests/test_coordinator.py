"""The paper's Table 1 arithmetic, our own traffic formulas, the link fit and the per-layer plan."""
from __future__ import annotations

import pytest
from torch import nn

from poseidon_torch.coordinator import (
    LayerInfo,
    LinkModel,
    fit_link,
    paper_best_scheme,
    paper_ps_traffic,
    paper_sfb_traffic,
    plan_layers,
    probe_gemm_flops,
    probe_link,
    ps_bytes_per_rank,
    sfb_bytes_per_rank,
)

K_BATCH = 32
GIGABIT = LinkModel.from_gbps(1.0, latency_us=50.0)
GEMM_FLOPS = 100e9  # fixed, so the plans below do not depend on this machine


# --- the paper's Table 1 -------------------------------------------------------------------------

def test_table1_vgg_4096x4096():
    assert paper_sfb_traffic(K_BATCH, 4096, 4096, 8) == 2 * 32 * 8192 * 7 == 3_670_016
    assert paper_ps_traffic(4096, 4096, 8, 8) == 2 * 4096 * 4096 * 14 / 8 == 58_720_256
    assert paper_best_scheme(K_BATCH, 4096, 4096, 8, 8) == "SFB"


def test_table1_vgg_fc6():
    assert round(paper_sfb_traffic(K_BATCH, 25088, 4096, 8) / 1e6, 1) == 13.1
    assert round(paper_ps_traffic(25088, 4096, 8, 8) / 1e6, 1) == 359.7


@pytest.mark.parametrize("machines, ratio", [(8, 27.0), (32, 6.7)])
def test_table1_22k_classifier_ratio(machines, ratio):
    ps = paper_ps_traffic(4096, 21841, machines, machines)
    assert ps / paper_sfb_traffic(K_BATCH, 4096, 21841, machines) == pytest.approx(ratio, abs=0.06)


def smallest(predicate, start: int = 1) -> int:
    value = start
    while not predicate(value):
        value += 1
    return value


@pytest.mark.parametrize("m, n", [(4096, 4096), (25088, 4096), (1000, 4096)])
def test_choice_flips_with_k_at_closed_form(m, n):
    p = 8
    flip = smallest(lambda k: paper_best_scheme(k, m, n, p, p) == "PS")
    # SFB iff 2 K (P-1)(M+N) <= 2 M N (2P-2) / P  <=>  K <= M N (2P-2) / (P (P-1)(M+N))
    assert flip == m * n * (2 * p - 2) // (p * (p - 1) * (m + n)) + 1
    if (m, n) == (4096, 4096):
        assert flip == 513


def test_choice_flips_with_machines_at_closed_form():
    m = n = 4096
    flip = smallest(lambda p: paper_best_scheme(K_BATCH, m, n, p, p) == "PS", start=2)
    # with P1 = P2 = P: SFB iff K (M+N) <= 2 M N / P
    assert flip == 2 * m * n // (K_BATCH * (m + n)) + 1 == 129


# --- our own traffic ------------------------------------------------------------------------------

def test_our_traffic_formulas():
    assert ps_bytes_per_rank(4096 * 4096 * 4, 8) == 2 * 7 / 8 * 4096 * 4096 * 4
    assert ps_bytes_per_rank(1000, 1) == 0
    assert sfb_bytes_per_rank(32, 4096, 4096, 8) == 7 * 32 * 8192 * 4
    assert sfb_bytes_per_rank(32, 4096, 4096, 8, element_size=2) == 7 * 32 * 8192 * 2
    assert sfb_bytes_per_rank(32, 4096, 4096, 1) == 0


# --- link and GEMM models -------------------------------------------------------------------------

def test_fit_link_recovers_ring_model():
    alpha, beta, p = 30e-6, 8 / 10e9, 4
    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
    seconds = [2 * (p - 1) * alpha + 2 * (p - 1) / p * size * beta for size in sizes]
    link = fit_link(sizes, seconds, p)
    assert link.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert link.beta_s_per_byte == pytest.approx(beta, rel=1e-6)


def test_fit_link_clips_negative_terms():
    link = fit_link([1000, 2000, 3000], [3e-3, 2e-3, 1e-3], 2)
    assert link.alpha_s > 0 and link.beta_s_per_byte == 0
    assert fit_link([1000], [1.0], 1) == LinkModel(0.0, 0.0)


def test_link_model_seconds():
    assert GIGABIT.seconds(125_000_000, messages=2) == pytest.approx(1.0 + 100e-6)
    assert "1 Gbit/s" in str(GIGABIT) and "50 us" in str(GIGABIT)


def test_probe_link_overrides_skip_probing(monkeypatch):
    # no process group exists here: any probing would raise
    assert probe_link(bandwidth_gbps=10.0, latency_us=5.0) == LinkModel.from_gbps(10.0, 5.0)
    monkeypatch.setenv("POSEIDON_BANDWIDTH_GBPS", "2.5")
    monkeypatch.setenv("POSEIDON_LATENCY_US", "20")
    assert probe_link() == LinkModel.from_gbps(2.5, 20.0)
    assert probe_link(bandwidth_gbps=40.0) == LinkModel.from_gbps(40.0, 20.0)
    monkeypatch.delenv("POSEIDON_LATENCY_US")
    assert probe_link() == LinkModel.from_gbps(2.5, 0.0)


def test_probe_gemm_flops_is_positive_and_cached():
    rate = probe_gemm_flops()
    assert rate > 0
    assert probe_gemm_flops("cpu") == rate


# --- plans ----------------------------------------------------------------------------------------

def fc(name: str, m: int, n: int, k: int | None) -> LayerInfo:
    return LayerInfo.of_module(name, nn.Linear(n, m), k=k)


def conv(name: str) -> LayerInfo:
    return LayerInfo.of_module(name, nn.Conv2d(64, 128, 3))


def small_layers() -> list[LayerInfo]:
    # same shapes as the real ones without allocating 4096 x 4096 weights for every test
    return [
        LayerInfo("fc7", "Linear", (4096, 4096), 4096 * 4096 + 4096, True, K_BATCH, 4096, 4096),
        LayerInfo("fc_tokens", "Linear", (4096, 4096), 4096 * 4096 + 4096, True, 8192, 4096, 4096),
        conv("conv1"),
        LayerInfo("fc_unknown_k", "Linear", (10, 4096), 10 * 4096 + 10, True, None, 10, 4096),
    ]


def test_layer_info_of_module():
    info = fc("fc", 30, 20, k=8)
    assert (info.kind, info.shape, info.numel, info.fc_eligible, info.k, info.m, info.n) == (
        "Linear", (30, 20), 30 * 20 + 30, True, 8, 30, 20)
    info = conv("c")
    assert (info.kind, info.numel, info.fc_eligible, info.m) == ("Conv2d", 64 * 128 * 9 + 128, False, None)


@pytest.mark.parametrize("world_size", range(2, 9))
def test_plan_chooses_by_cost(world_size):
    plan = plan_layers(small_layers(), world_size, GIGABIT, GEMM_FLOPS)
    assert plan.path_of("fc7") == "SFB"
    assert plan.path_of("fc_tokens") == "PS"
    assert plan.path_of("conv1") == "PS"
    assert plan.path_of("fc_unknown_k") == "PS"
    fc7 = plan.layers[0]
    assert fc7.sfb_bytes == sfb_bytes_per_rank(K_BATCH, 4096, 4096, world_size)
    assert fc7.ps_bytes == ps_bytes_per_rank((4096 * 4096 + 4096) * 4, world_size)
    assert fc7.sfb_seconds < fc7.ps_seconds and not fc7.forced
    assert plan.layers[2].sfb_bytes is None and plan.layers[2].sfb_seconds is None


def test_slow_rebuild_gemm_makes_ps_win():
    plan = plan_layers(small_layers()[:1], 8, GIGABIT, gemm_flops=1e9)
    assert plan.path_of("fc7") == "PS"


def test_world_size_one_sends_nothing():
    plan = plan_layers(small_layers(), 1, GIGABIT, GEMM_FLOPS)
    assert all(layer.path == "PS" and layer.ps_bytes == 0 and layer.ps_seconds == 0 for layer in plan.layers)


def test_overrides_force_a_path():
    plan = plan_layers(small_layers(), 8, GIGABIT, GEMM_FLOPS,
                       overrides={"fc7": "PS", "fc_tokens": "SFB"})
    assert (plan.path_of("fc7"), plan.path_of("fc_tokens"), plan.path_of("conv1")) == ("PS", "SFB", "PS")
    assert [layer.forced for layer in plan.layers] == [True, True, False, False]


@pytest.mark.parametrize("overrides, message", [
    ({"conv1": "SFB"}, "conv1"),
    ({"fc_unknown_k": "SFB"}, "fc_unknown_k"),
    ({"fc7": "allreduce"}, "fc7"),
    ({"nope": "PS"}, "nope"),
])
def test_bad_override_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        plan_layers(small_layers(), 8, GIGABIT, GEMM_FLOPS, overrides=overrides)


def test_duplicate_layer_names_raise():
    with pytest.raises(ValueError, match="unique"):
        plan_layers([conv("c"), conv("c")], 2, GIGABIT, GEMM_FLOPS)


def test_plan_table_lists_every_layer():
    plan = plan_layers(small_layers(), 8, GIGABIT, GEMM_FLOPS, overrides={"fc_tokens": "SFB"})
    text = str(plan)
    lines = text.splitlines()
    path_column = lines[0].index("path")  # cells are aligned under their header
    for layer in plan.layers:
        row = next(line for line in lines if line.startswith(layer.layer.name + " "))
        assert row[path_column:].split()[0] == layer.path + ("*" if layer.forced else "")
    assert "SFB*" in text and "1 Gbit/s" in text and "P=8" in text
    with pytest.raises(KeyError):
        plan.path_of("missing")
