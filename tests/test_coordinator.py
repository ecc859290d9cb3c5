"""The coordinator: byte formulas from first principles, plans from shared facts, the link fit."""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

from poseidon_torch import link as link_module
from poseidon_torch.bucket import Bucket, JobCost, Layer
from poseidon_torch.coordinator import Coordinator
from poseidon_torch.fc import CHECKPOINTED, HOOKED, FCLayer, fc_spec
from poseidon_torch.link import LinkModel, fit_link, probe_gemm_flops, probe_link
from poseidon_torch.paths.ps import predict_ps, ps_bytes_per_rank
from poseidon_torch.paths.sfb import predict_sfb, sfb_bytes_per_rank

GIGABIT = LinkModel.from_gbps(1.0, latency_us=50.0)
GEMM_FLOPS = 100e9  # fixed, so the plans below do not depend on this machine


# --- our own traffic ------------------------------------------------------------------------------

def test_ps_bytes_per_rank():
    # a rank pushes the (P-1)/P of a buffer it does not own and sends its own 1/P to P-1 peers
    assert ps_bytes_per_rank(4096 * 4096 * 4, 8) == 7 / 8 * 4096 * 4096 * 4 + 1 / 8 * 4096 * 4096 * 4 * 7
    assert ps_bytes_per_rank(1000, 1) == 0


def test_sfb_bytes_per_rank():
    # a ring all-gather sends P-1 blocks; a block is a 24-byte header and K rows of M+N values,
    # padded to 8 bytes
    assert sfb_bytes_per_rank(32, 4096, 4096, 8) == 7 * (24 + 32 * 8192 * 4)
    assert sfb_bytes_per_rank(3, 5, 2, 2, element_size=2) == 1 * 72  # 24 + 42 = 66 -> 72
    assert sfb_bytes_per_rank(32, 4096, 4096, 1) == 0


def test_predictions_add_latency_bandwidth_and_the_rebuild():
    sent, seconds = predict_ps(1_000_000, 4, GIGABIT)
    assert sent == 1_500_000 and seconds == pytest.approx(6 * 50e-6 + 1_500_000 * 8 / 1e9)
    sent, seconds = predict_sfb(10, 100, 200, 4, 4, GIGABIT, GEMM_FLOPS)
    rebuild = 2 * 100 * (4 * 10) * 200 / GEMM_FLOPS
    assert seconds == pytest.approx(3 * 50e-6 + sent * 8 / 1e9 + rebuild)


# --- plans from shared facts -----------------------------------------------------------------------

def layers(*shapes: tuple[str, int, int]) -> dict[str, FCLayer]:
    out = {}
    for name, m, n in shapes:
        module = nn.Linear(n, m)
        out[name] = FCLayer(name, module, fc_spec(module), lambda: False, lambda: False)
    return out


def coordinator(world_size: int = 4, overrides=None, **shapes) -> Coordinator:
    fc = layers(*((name, m, n) for name, (m, n) in shapes.items()))
    c = Coordinator(fc, world_size, GIGABIT, GEMM_FLOPS, overrides)
    c.solo = set(fc)
    return c


def alone(fc: dict[str, FCLayer]) -> list[Bucket]:
    """Every FC layer in a bucket of its own."""
    return [Bucket(i, [Layer(name, layer.module, tuple(layer.module.named_parameters()))])
            for i, (name, layer) in enumerate(fc.items())]


def facts(c: Coordinator, per_rank: list[dict[str, tuple[int, int]]], aborted=(), buckets: int = 0) -> torch.Tensor:
    """Every rank's facts vector: [aborted, late per bucket, syncing per bucket, (K, sticky) per FC
    layer in name order]."""
    rows = []
    for rank, layer_facts in enumerate(per_rank):
        row = [int(rank in aborted)] + [0] * 2 * buckets
        for name in c.fc:
            row += list(layer_facts[name])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def k_where_sfb_stops_winning(m: int, n: int, world_size: int) -> int:
    """The smallest K at which SFB's time (latency, bytes, rebuild) is no longer below what the layer's
    bytes cost on PS (where it may share a bucket's latency with its neighbours)."""
    ps_bytes = predict_ps((m * n + m) * 4, world_size, GIGABIT)[0]
    k = 1
    while predict_sfb(k, m, n, 4, world_size, GIGABIT, GEMM_FLOPS)[1] < ps_bytes * GIGABIT.beta_s_per_byte:
        k += 1
    return k


def test_first_pass_plans_ps_everywhere():
    c = coordinator(fc=(512, 512))
    assert c.on("SFB") == set() and not c.commits("fc")


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_plan_flips_from_sfb_to_ps_where_the_predicted_times_cross(world_size):
    flip = k_where_sfb_stops_winning(512, 512, world_size)
    assert 1 < flip < 512
    for k, expected in ((flip - 1, {"fc"}), (flip, set())):
        c = coordinator(world_size, fc=(512, 512))
        c.observe(facts(c, [{"fc": (k if r == 0 else 1, 0)} for r in range(world_size)]), 0)
        assert c.k_max["fc"] == k and c.on("SFB") == expected, (k, flip)


def test_sticky_facts_of_any_rank_keep_a_layer_on_ps_even_when_forced():
    c = coordinator(2, overrides={"fc": "SFB"}, fc=(512, 512), other=(512, 512))
    with pytest.warns(UserWarning, match="'fc' stays on the PS path.*user hooks on its parameters"):
        c.observe(facts(c, [{"fc": (4, 0), "other": (4, 0)}, {"fc": (4, HOOKED), "other": (4, 0)}]), 0)
    assert c.on("SFB") == {"other"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        c.observe(facts(c, [{"fc": (4, CHECKPOINTED), "other": (4, 0)}] * 2), 0)
    assert c.sticky["fc"] == HOOKED | CHECKPOINTED and c.on("SFB") == {"other"}


def test_sfb_needs_a_bucket_of_its_own_and_ps_overrides_win():
    c = coordinator(2, overrides={"forced_ps": "PS"}, fused=(512, 512), forced_ps=(512, 512))
    c.solo = {"forced_ps"}
    c.observe(facts(c, [{"fused": (4, 0), "forced_ps": (4, 0)}] * 2), 0)
    assert c.on("SFB") == set()


def test_an_aborted_pass_does_not_change_the_plan():
    c = coordinator(2, fc=(512, 512))
    c.observe(facts(c, [{"fc": (4, 0)}] * 2), 0)
    assert c.on("SFB") == {"fc"}
    outcome = c.observe(facts(c, [{"fc": (4000, 0)}] * 2, aborted={1}), 0)
    assert outcome.aborted and c.on("SFB") == {"fc"}


def test_late_buckets_are_reported_if_any_rank_saw_one():
    c = coordinator(2, fc=(8, 8))
    rows = facts(c, [{"fc": (1, 0)}] * 2, buckets=3)
    rows[1, 2] = 1  # rank 1: bucket 1 got a gradient after its sync
    rows[0, 4 + 2] = 1  # rank 0: bucket 2's job still ran when its backward ended
    outcome = c.observe(rows, 3)
    assert outcome.late == [False, True, False] and outcome.syncing == [False, False, True]
    assert c.k_max["fc"] == 1


@pytest.mark.parametrize("overrides, message", [
    ({"conv": "SFB"}, "not an FC layer"),
    ({"fc": "allreduce"}, "must be one of"),
    ({"nope": "PS"}, "'nope', which is not a layer"),
])
@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_overrides_raise(overrides, message, world_size):
    c = coordinator(world_size, overrides=overrides, fc=(8, 8))
    with pytest.raises(ValueError, match=message):
        c.check_overrides(["fc", "conv"], ["fc"])


def test_an_sfb_override_means_ps_in_a_world_of_one():
    """The script written for P ranks runs on one: nothing to gather, so its FC layer takes PS."""
    c = coordinator(1, overrides={"fc": "SFB"}, fc=(8, 8))
    c.check_overrides(["fc", "conv"], ["fc"])
    assert c.overrides == {"fc": "PS"}


# --- the link fit ------------------------------------------------------------------------------------

SIZES = [16 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]


def ring_times(alpha: float, beta: float, world_size: int, sizes=SIZES) -> list[float]:
    return [2 * (world_size - 1) * alpha + 2 * (world_size - 1) / world_size * s * beta for s in sizes]


def test_fit_recovers_the_ring_model():
    alpha, beta, p = 30e-6, 8 / 10e9, 4
    fit = fit_link(SIZES, [[t] * 3 for t in ring_times(alpha, beta, p)], p)
    assert fit.usable
    assert fit.model.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.model.beta_s_per_byte == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("gbps", [0.00925, 0.0925])
def test_a_slow_link_is_believed(gbps):
    """10 and 100 Mbit/s links as tc shapes them (9.25 and 92.5 Mbit/s of payload): the fit is usable, so
    the cost model sees them (a floor of 10 Mbit/s refused the first: compression= then assumed 10 Gbit/s
    and never compressed over 10 Mbit/s)."""
    fit = fit_link(SIZES, [[t] * 3 for t in ring_times(300e-6, 8 / (gbps * 1e9), 2)], 2)
    assert fit.usable and fit.model.bandwidth_gbps == pytest.approx(gbps, rel=1e-6), fit.reason


def test_fit_ignores_slow_repeats_and_a_wild_size():
    """A loaded machine: every size has a repeat 20x too slow, and one size is off entirely."""
    alpha, beta, p = 50e-6, 8 / 5e9, 2
    times = ring_times(alpha, beta, p)
    repeats = [[t, t * 1.02, t * 0.98, t * 20, t] for t in times]
    repeats[1] = [t * 30 for t in repeats[1]]
    fit = fit_link(SIZES, repeats, p)
    assert fit.usable
    assert fit.model.bandwidth_gbps == pytest.approx(5.0, rel=0.1)
    assert fit.model.alpha_s == pytest.approx(alpha, rel=0.5)


def test_fit_survives_noise():
    rng = random.Random(0)
    alpha, beta, p = 100e-6, 8 / 1e9, 4
    repeats = [[t * rng.uniform(0.8, 1.25) for _ in range(5)] for t in ring_times(alpha, beta, p)]
    fit = fit_link(SIZES, repeats, p)
    assert fit.usable and fit.model.bandwidth_gbps == pytest.approx(1.0, rel=0.3)


@pytest.mark.parametrize("times, reason", [
    ([3e-3, 2e-3, 1e-3, 0.5e-3, 0.2e-3], "do not grow"),
    ([1.2e-3] * 5, "do not grow"),
    # the localhost run that printed 'alpha 1.2e+03 us, bandwidth 2.84e+03 Gbit/s': noise, no slope
    ([1.2e-3, 1.21e-3, 1.19e-3, 1.22e-3, 1.23e-3], "outside"),
    ([1.0, 1.1, 1.2, 1.3, 1.4], "latency"),
])
def test_unusable_fits_are_rejected_with_a_reason(times, reason):
    fit = fit_link(SIZES, [[t] for t in times], 2)
    assert not fit.usable and reason in fit.reason


def test_fit_needs_two_sizes_and_world_size_one_sends_nothing():
    with pytest.raises(ValueError):
        fit_link([1 << 20], [[1e-3]], 2)
    fit = fit_link([1 << 20], [[1e-3]], 1)
    assert fit.usable and fit.model.seconds(1e9, 10) == 0


def test_probe_link_reads_the_environment_without_probing(monkeypatch):
    monkeypatch.setenv("POSEIDON_BANDWIDTH_GBPS", "2.5")
    monkeypatch.setenv("POSEIDON_LATENCY_US", "20")
    link = probe_link(None, key="no group exists here: probing would raise")
    assert link == LinkModel.from_gbps(2.5, 20.0, "environment")
    monkeypatch.setenv("POSEIDON_BANDWIDTH_GBPS", "fast")
    with pytest.raises(ValueError, match="POSEIDON_BANDWIDTH_GBPS"):
        probe_link(None, key=None)
    monkeypatch.delenv("POSEIDON_BANDWIDTH_GBPS")
    monkeypatch.setitem(link_module._LINK_CACHE, ("probed before", "cpu"), GIGABIT)
    assert probe_link(None, key="probed before").alpha_s == pytest.approx(20e-6)
    monkeypatch.setenv("POSEIDON_LATENCY_US", "-50")  # replaces the probed latency: refused as well
    with pytest.raises(ValueError, match="POSEIDON_LATENCY_US"):
        probe_link(None, key="probed before")


@pytest.mark.parametrize("alpha,beta", [(-1e-4, 1e-9), (float("nan"), 1e-9), (float("inf"), 1e-9),
                                        (1e-4, -1e-9), (1e-4, float("inf"))])
def test_a_link_or_job_cost_that_is_negative_or_not_finite_is_refused(alpha, beta):
    """The bucket grouping simulates jobs with these: a negative latency made it loop forever, an
    infinite one made it return no buckets at all."""
    with pytest.raises(ValueError, match="latency|seconds per byte"):
        LinkModel(alpha, beta)
    with pytest.raises(ValueError, match="finite latency"):
        JobCost(alpha, beta)



@pytest.mark.parametrize("gbps,latency_us", [(float("nan"), 50.0), (-1.0, 50.0), (1.0, -50.0),
                                             (1.0, float("nan")), (1.0, float("inf"))])
def test_a_link_from_gbps_refuses_bad_figures(gbps, latency_us):
    with pytest.raises(ValueError):
        LinkModel.from_gbps(gbps, latency_us)


def test_link_model_seconds_and_text():
    assert GIGABIT.seconds(125_000_000, messages=2) == pytest.approx(1.0 + 100e-6)
    assert "1 Gbit/s" in str(GIGABIT) and "50 us" in str(GIGABIT)
    with pytest.raises(ValueError):
        LinkModel.from_gbps(0.0)


def test_probe_gemm_flops_is_positive_and_cached():
    rate = probe_gemm_flops()
    assert rate > 0 and probe_gemm_flops("cpu") == rate


def test_a_layer_alone_in_a_learned_bucket_is_charged_the_latency_on_ps():
    """A small FC layer whose SFB messages cost less than its PS messages: before the buckets are
    learned it may still share a bucket on PS (only its bytes count: PS); once the buckets are fixed and
    it sits alone, PS pays the latency too, and SFB's fewer, smaller messages win."""
    slow_start = LinkModel(2e-3, GIGABIT.beta_s_per_byte)  # 2 ms per message
    fc = layers(("head", 10, 1024))
    c = Coordinator(fc, 2, slow_start, GEMM_FLOPS)
    c.buckets_changed(alone(fc), learned=False)
    c.observe(facts(c, [{"head": (32, 0)}] * 2), 0)
    assert c.on("SFB") == set()
    c.buckets_changed(alone(fc), learned=True)
    c.observe(facts(c, [{"head": (32, 0)}] * 2), 0)
    assert c.on("SFB") == {"head"}


def test_plan_printout_wraps_fused_names_and_says_when_the_gemm_was_not_probed():
    from poseidon_torch.coordinator import Plan, PlanRow

    fused = "+".join(f"blocks.{i}.conv{j}" for i in range(12) for j in (1, 2))
    rows = [PlanRow(fused, "fused x24", (64, 64, 3, 3), None, "PS", False, {"PS": (1e6, 1e-3, 0.0), "SFB": None, "INT8": None},
                    tuple(fused.split("+"))),
            PlanRow("head", "Linear", (10, 512), 32, "SFB", True, {"PS": (2e4, 1e-4, 0.0), "SFB": (1e3, 2e-5, 0.0),
                                                                   "INT8": (5e3, 6e-5, 4e-6)}, ("head",))]
    text = str(Plan(rows, 2, LinkModel.from_gbps(1.0, latency_us=50), None))
    lines = text.splitlines()
    assert max(len(line) for line in lines[:-1]) < Plan.NAME_WIDTH + 120
    assert "".join(line.split("  ")[0] for line in lines[2:-2]) == fused  # every layer, in order, once
    assert lines[-1].endswith("GEMM not probed; * = forced by override")
    assert "60.0 us (4.0 us compute)" in lines[-2] and "100.0 us" in lines[-2]  # compression shown apart
    assert "1e-09" not in text


def test_a_plan_timed_once_for_its_options_is_remembered_when_they_come_back():
    """A model whose FC layers' K alternates between two values (lengths padded to a multiple) times the
    iteration once per value: the options of a K seen recently give back the plan timed for them."""
    from unittest import mock

    from poseidon_torch import coordinator as coordinator_module

    fc = layers(("a", 512, 512), ("b", 512, 512))
    buckets = alone(fc)
    c = Coordinator(fc, 2, LinkModel.from_gbps(0.1, latency_us=1.0), GEMM_FLOPS, layers=[b.layers[0] for b in buckets])
    c.buckets_changed(buckets, learned=True, ready_s={"a": 0.0, "b": 1e-3})
    plans = []
    with mock.patch.object(coordinator_module, "fastest", wraps=coordinator_module.fastest) as timed:
        for k in (8, 16, 8, 16, 8):
            c.observe(facts(c, [{"a": (k, 0), "b": (k, 0)}] * 2), 0)
            plans.append(c.on("SFB"))
    assert plans == [{"a", "b"}] * 5
    assert timed.call_count == 2


def test_in_parameter_server_mode_sfb_is_charged_the_pull_of_new_values():
    """A 64x64 layer at K = 24, P = 2, on a link where bytes decide: the factor all-gather alone (12.3 KB)
    beats PS (16.7 KB), but with a ServerOptimizer the new values come back by pull (+8.3 KB): PS wins."""
    slow = LinkModel.from_gbps(0.1, latency_us=1.0)
    chosen = {}
    for pull_values in (False, True):
        c = Coordinator(layers(("fc", 64, 64)), 2, slow, GEMM_FLOPS)
        c.solo, c.pull_values = {"fc"}, pull_values
        c.observe(facts(c, [{"fc": (24, 0)}] * 2), 0)
        chosen[pull_values] = c.on("SFB")
    assert chosen == {False: {"fc"}, True: set()}


# --- recorded plans (issue 44 item 5) -------------------------------------------------------------------

def test_a_recorded_plan_round_trips_through_its_file_and_must_name_every_fc_layer(tmp_path):
    from poseidon_torch.coordinator import Plan, PlanRow, recorded_paths

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 8), nn.Linear(8, 2))
    rows = [PlanRow("3", "Linear", (2, 8), 4, "SFB", False, {"PS": (1e3, 1e-4), "SFB": (1e2, 1e-5)}, ("3",)),
            PlanRow("2+0", "fused x2", (8, 8), None, "PS", False, {"PS": (1e3, 1e-4), "SFB": None}, ("2", "0"))]
    plan = Plan(rows, 2, GIGABIT, GEMM_FLOPS)
    assert plan.layer_paths() == {"3": "SFB", "2": "PS", "0": "PS"}
    plan.save(tmp_path / "plan.json")
    assert recorded_paths(str(tmp_path / "plan.json"), model) == recorded_paths(plan, model) == plan.layer_paths()
    with pytest.raises(ValueError, match=r"no path for the layer\(s\) \['2'\]"):
        recorded_paths({"3": "SFB"}, model)
    (tmp_path / "other.json").write_text('{"3": "SFB"}')
    with pytest.raises(ValueError, match="not a plan written by Plan.save"):
        recorded_paths(tmp_path / "other.json", model)
    with pytest.raises(TypeError, match="plan must be a Plan"):
        recorded_paths(["3"], model)
