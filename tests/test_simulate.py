"""The scaling simulator: hand-computed timelines, the traced run's bytes and plan, the CLI, the paper."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simulate_workers
from poseidon_torch.link import LinkModel
from poseidon_torch.simulate.cli import main as simulate_main
from poseidon_torch.simulate import FCShape, Job, LayerProfile, Profile, bsp, from_trace, pipelined, predict
from poseidon_torch.simulate.paper import vgg19_22k
from poseidon_torch.simulate.schemes import SCHEMES, Poseidon
from poseidon_torch.simulate.timeline import _greedy, advance, fastest

#: alpha 10 ms per message, 1e-7 s per byte (80 Mbit/s)
LINK = LinkModel(0.01, 1e-7)


def two_layers(**extra) -> Profile:
    """Forward 1 s; the top layer (ready first) 2 s of backward and 7,999,992 parameter bytes in one
    tensor, the bottom layer 3 s and 3,999,992 bytes; 0.5 s between iterations. With the PS path's
    flags (one per tensor and one per bucket, 4 bytes each) the buckets move 8e6 and 4e6 bytes."""
    layers = (LayerProfile("top", 7_999_992, 2.0), LayerProfile("bottom", 3_999_992, 3.0))
    return Profile(layers, 1.0, 0.5, **extra)


def iteration(scheme: str, profile: Profile, hosts: int = 2, slowdown: float = 1.0) -> float:
    return SCHEMES[scheme].run(profile, hosts, LINK, slowdown).iteration_s


def test_wfbp_overlaps_the_top_layer_with_the_bottom_layers_backward():
    # P = 2: a PS sync sends the bucket once, 2 messages: top 0.02 + 0.8 s from t = 3 (ends 3.82, hidden
    # by the bottom's backward until 6); bottom 0.02 + 0.4 s from 6; + 0.5 s
    assert iteration("wfbp", two_layers()) == pytest.approx(6.92)


def test_plain_ps_syncs_after_backward():
    assert iteration("ps", two_layers()) == pytest.approx(6.0 + 0.82 + 0.42 + 0.5)


def test_traced_buckets_make_one_job():
    fused = two_layers(buckets=(("top", "bottom"),))
    # one bucket of 7,999,992 + 3,999,992 + 4 * (2 + 1) bytes after the bottom layer: 0.02 + 1.2 s
    assert iteration("wfbp", fused) == pytest.approx(6.0 + 1.22 + 0.5)


def test_one_machine_has_no_communication():
    for scheme in SCHEMES:
        assert iteration(scheme, two_layers(), hosts=1) == pytest.approx(6.5)


def test_ddp_buckets_close_at_one_mebibyte_then_25():
    layers = (LayerProfile("a", 600_000, 1.0), LayerProfile("b", 600_000, 1.0), LayerProfile("c", 1_000_000, 1.0),
              LayerProfile("d", 1_000_000, 1.0))
    jobs = SCHEMES["ddp"].jobs(Profile(layers, 0.0), 4, LINK)
    # a + b = 1.2 MB >= 1 MiB closes the first bucket; c + d stay under 25 MiB until the last layer
    assert [(job.name, job.after) for job in jobs] == [("a+b", 1), ("c+d", 3)]
    # ring all-reduce at P = 4: 6 steps, 2 * 3 / 4 of the bucket
    assert jobs[0].nbytes == 1_800_000
    assert jobs[0].seconds == pytest.approx(0.06 + 0.18)


def test_slowdown_stretches_compute_while_the_link_is_busy():
    # the top layer's job is busy from 3 to 3.82; the bottom layer's 3 s of backward progress 0.41 s there
    # at half speed, then 2.59 s: ends 6.41; its own job 0.42 s; + 0.5
    assert iteration("wfbp", two_layers(), slowdown=2.0) == pytest.approx(7.33)
    # 0.5 s free, 0.125 s of work in the busy half second at quarter speed, the last 0.375 s free again
    assert advance(0.0, 1.0, [(0.5, 1.0), (2.0, 3.0)], 4.0) == pytest.approx(1.375)
    assert advance(0.0, 1.0, [(0.0, 1.0)], 4.0) == pytest.approx(1.75)


def test_sfb_rebuild_runs_on_the_compute_lane():
    # job A (after the top layer): 0.5 s on the link from 3, then 1 s of rebuild, available at 3.5 while
    # the bottom layer computes (3 to 6): it runs after it, 6 to 7; job B's 0.2 s link from 6; + 0.5
    jobs = [Job("a", 0, 0.5, 0.0, "SFB", compute_s=1.0), Job("b", 1, 0.2, 0.0, "PS")]
    assert bsp(two_layers(), jobs).iteration_s == pytest.approx(7.5)
    # available at 3, before the bottom layer starts: it runs first, 3 to 4; the bottom layer 4 to 7
    jobs[0] = Job("a", 0, 0.0, 0.0, "SFB", compute_s=1.0)
    assert bsp(two_layers(), jobs).iteration_s == pytest.approx(7.7)
    # pipelined: 6.5 s of compute and 1 s of rebuild against 0.2 s on the link
    assert pipelined(two_layers(), jobs).iteration_s == pytest.approx(7.5)


def test_pipelined_iteration_is_the_larger_of_compute_and_communication():
    # 6.5 s of compute against 1.24 s of communication; at slowdown 2 the overlapped 1.24 s cost half more
    assert iteration("wfbp+delay", two_layers()) == pytest.approx(6.5)
    assert iteration("wfbp+delay", two_layers(), slowdown=2.0) == pytest.approx(6.5 + 0.62)
    slow = LinkModel(0.01, 1e-6)
    assert SCHEMES["wfbp+delay"].run(two_layers(), 2, slow).iteration_s == pytest.approx(8.02 + 4.02)


def test_poseidon_takes_sfb_where_it_is_cheaper_and_grows_with_the_machines():
    # an FC layer 1000 x 2000 with K = 4 rows per machine: SFB sends (P - 1) blocks of
    # 24 + 4 * 3000 * 4 = 48,024 bytes; PS sends 2 (P - 1) / P of 8,004,000 bytes (+ flags)
    # (ready last, its sync exposed: SFB shortens the iteration)
    fc = LayerProfile("fc", 8_004_000, 1.0, FCShape(1000, 2000, 4), tensors=2)
    profile = Profile((LayerProfile("conv", 400_000, 1.0), fc), 0.5, gemm_flops=1e12)
    rows = {row.hosts: row for row in predict(profile, ["poseidon"], [2, 16], LINK)}
    assert rows[2].sfb_layers == ("fc",)
    ps_conv = 400_000 + 4 * 2
    assert rows[2].bytes_per_machine == pytest.approx(48_024 + ps_conv)
    # its rebuild, 2 M (P K) N = 32 MFLOP at 1 TFLOP/s, is compute after its 0.01 + 0.0048 s all-gather
    (sfb,) = [job for job in SCHEMES["poseidon"].jobs(profile, 2, LINK) if job.path == "SFB"]
    assert (sfb.seconds, sfb.compute_s) == pytest.approx((0.01 + 48_024e-7, 32e6 / 1e12))
    assert rows[16].bytes_per_machine == pytest.approx(15 * 48_024 + 2 * 15 / 16 * ps_conv)
    # at 512 machines 511 blocks (24.5 MB) cost more than the PS sync (16 MB) where bytes dominate
    (row,) = predict(profile, ["poseidon"], [512], LinkModel(1e-6, 1e-7))
    assert row.sfb_layers == ()
    assert rows[2].iteration_s < predict(profile, ["wfbp"], [2], LINK)[0].iteration_s


def test_poseidon_leaves_an_fc_layer_on_ps_where_its_sync_hides_under_the_backward():
    """The FC layer of the test above ready first, with 3 s of backward after it: its PS sync (0.81 s)
    hides, so SFB, faster by its sync alone, would only add its rebuild to the compute lane. It stays PS
    and poseidon predicts wfbp's iteration (the README's example at 10 Gbit/s predicted poseidon slower
    than wfbp when SFB was chosen by its sync alone). Pipelined, likewise."""
    fc = LayerProfile("fc", 8_004_000, 1.0, FCShape(1000, 2000, 4), tensors=2)
    profile = Profile((fc, LayerProfile("conv", 400_000, 3.0)), 0.5, gemm_flops=1e9)
    assert Poseidon.cheaper_paths(fc, profile, 2, LINK)[0][0] == "SFB"
    for scheme, wfbp in (("poseidon", "wfbp"), ("poseidon+delay", "wfbp+delay")):
        (row,) = predict(profile, [scheme], [2], LINK)
        assert row.sfb_layers == ()
        assert row.iteration_s == pytest.approx(predict(profile, [wfbp], [2], LINK)[0].iteration_s, rel=1e-12)
    # a slower link exposes the sync: then SFB pays
    slow = LinkModel(0.01, 1e-6)
    (row,) = predict(profile, ["poseidon"], [2], slow)
    assert row.sfb_layers == ("fc",)
    assert row.iteration_s < predict(profile, ["wfbp"], [2], slow)[0].iteration_s


def test_a_lossy_scheme_compresses_a_layer_only_where_its_model_predicts_a_shorter_iteration():
    """poseidon+int8 at 27 Mbit/s (a quarter of the bytes for 22 ns of compute per element at 20 GB/s): the
    bottom layer, ready last, its sync exposed, goes to the 8-bit path and the iteration gets 11% shorter;
    the top layer's exact sync (2.4 s) hides under the bottom's 3 s of backward, so compressing it would make
    the iteration no shorter: it stays exact (by its sync alone, it would be compressed). Pipelined, where the link
    is hidden behind the 6.5 s of compute anyway, nothing is compressed. At 80 Gbit/s the compute costs
    more than the bytes it saves and it is poseidon; without a memory bandwidth no lossy path is costed;
    bf16 sends half."""
    from poseidon_torch.paths import BucketCost
    from poseidon_torch.simulate.schemes import PATHS

    profile = two_layers(memory_bps=20e9)
    LINK = LinkModel(0.01, 3e-7)  # noqa: N806 (this test's link)
    int8 = PATHS["INT8"].predict
    (row,) = predict(profile, ["poseidon+int8"], [2], LINK)
    assert row.sfb_layers == ("bottom",)
    (exact,) = predict(profile, ["poseidon"], [2], LINK)
    bottom = BucketCost(4e6, 4e6 - 8, None, ((4e6 // 4 - 2,),))
    bottom_ps = PATHS["PS"].predict(bottom, 2, LINK, None, 20e9).bytes
    assert row.bytes_per_machine == pytest.approx(exact.bytes_per_machine - bottom_ps + int8(bottom, 2, LINK, None, 20e9).bytes)
    assert row.iteration_s < exact.iteration_s * 0.95
    ((path, top),) = Poseidon.cheaper_paths(profile.layers[0], profile, 2, LINK, ("INT8",))
    top_too = [Job("top", 0, top.seconds - top.compute_s, top.bytes, path, top.compute_s) if job.name == "top" else job
               for job in SCHEMES["poseidon+int8"].jobs(profile, 2, LINK)]
    assert row.iteration_s <= bsp(profile, top_too).iteration_s  # the model's reason to leave the top exact
    delayed = predict(profile, ["poseidon+int8+delay", "poseidon+delay"], [2], LINK)
    assert delayed[0].iteration_s == delayed[1].iteration_s == pytest.approx(6.5)
    fast = LinkModel(1e-5, 1e-10)
    assert predict(profile, ["poseidon+int8"], [2], fast)[0] == replace(predict(profile, ["poseidon"], [2], fast)[0],
                                                                         scheme="poseidon+int8")
    assert predict(two_layers(), ["poseidon+int8"], [2], LINK)[0].iteration_s == exact.iteration_s
    (bf16,) = predict(profile, ["poseidon+bf16"], [2], LINK)
    bottom_bf16 = PATHS["BF16"].predict(bottom, 2, LINK, None, 20e9).bytes
    assert bf16.sfb_layers == ("bottom",)
    assert bf16.bytes_per_machine == pytest.approx(exact.bytes_per_machine - bottom_ps + bottom_bf16)


def test_a_lossy_plan_must_be_predicted_five_percent_shorter_than_the_exact_one():
    """At 80 Mbit/s compressing the bottom layer of the test above would shorten the iteration by 3.8%: a
    lossy path costs progress per step, which the time model does not see, so below LOSSY_MIN_GAIN (5%) the
    plan stays exact. The search without the margin compresses it."""
    from poseidon_torch.simulate.timeline import LOSSY_MIN_GAIN

    profile = two_layers(memory_bps=20e9)
    (exact,) = predict(profile, ["poseidon"], [2], LINK)
    assert predict(profile, ["poseidon+int8"], [2], LINK)[0] == replace(exact, scheme="poseidon+int8")
    jobs = SCHEMES["poseidon+int8"].jobs(profile, 2, LINK)
    assert not any(job.lossy for job in jobs)
    options = [[job, *(Job(job.name, job.after, p.seconds - p.compute_s, p.bytes, path, p.compute_s, lossy=True)
                       for path, p in Poseidon.cheaper_paths(profile.layers[job.after], profile, 2, LINK, ("INT8",))
                       if path == "INT8")] for job in jobs]
    unmargined = fastest(profile, options, min_gain=0.0)
    assert [job.path for job in unmargined] == ["PS", "INT8"]
    gain = 1.0 - bsp(profile, unmargined).iteration_s / exact.iteration_s
    assert 0.0 < gain < LOSSY_MIN_GAIN == 0.05
    assert fastest(profile, options) == jobs


def test_poseidon_powersgd_costs_each_matrix_by_its_shape_as_the_coordinator_does():
    """A 2000 x 1000 FC layer ready last at 80 Mbit/s: its exact sync (8 MB, ~0.8 s) is exposed, so
    poseidon+powersgd puts it on PowerSGD (rank 4: (2000 + 1000) x 4 floats) with the bytes and compute the
    path predicts from its shapes; the bias goes uncompressed in the same sync. The same layer with no
    shapes in its profile is one flat tensor, which PowerSGD does not compress: the plan stays exact.
    Pipelined, the link hides behind the compute and nothing is compressed."""
    from poseidon_torch.paths import BucketCost
    from poseidon_torch.simulate.schemes import PATHS

    shapes = ((2000, 1000), (2000,))
    wide = LayerProfile("wide", 4 * 2_002_000, 0.2, None, 2, shapes)
    profile = Profile((LayerProfile("top", 4_000, 0.5), wide), 0.3, 0.0, memory_bps=20e9, gemm_flops=1e10)
    (exact,) = predict(profile, ["poseidon"], [2], LINK)
    (row,) = predict(profile, ["poseidon+powersgd"], [2], LINK)
    assert row.sfb_layers == ("wide",)
    jobs = {job.name: job for job in SCHEMES["poseidon+powersgd"].jobs(profile, 2, LINK)}
    cost = BucketCost(4 * (2_002_000 + 3), 4 * 2_002_000, None, shapes, 4)
    expected = PATHS["PowerSGD"].predict(cost, 2, LINK, 1e10, 20e9)
    assert jobs["wide"].path == "PowerSGD" and jobs["wide"].lossy
    assert (jobs["wide"].nbytes, jobs["wide"].compute_s) == (expected.bytes, expected.compute_s)
    assert expected.bytes == (4 * (2000 * 4 + 2000 + 3) + 4 * 1000 * 4) * 2 * (2 - 1) / 2  # P and bias, then Q
    assert row.exposed_comm_s < 0.1 < 0.8 < exact.exposed_comm_s  # the wide sync no longer holds up the step
    flat = replace(profile, layers=(profile.layers[0], replace(wide, shapes=())))
    assert predict(flat, ["poseidon+powersgd"], [2], LINK)[0] == replace(exact, scheme="poseidon+powersgd")
    assert not predict(profile, ["poseidon+powersgd+delay"], [2], LINK)[0].sfb_layers


def test_vgg19_22k_holds_every_tensors_shape():
    profile = vgg19_22k()
    assert profile.layers[0].shapes == ((21841, 4096), (21841,))
    assert all(layer.elements * 4 == layer.nbytes and len(layer.shapes) == layer.tensors for layer in profile.layers)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def lossy_options(backward_s: list[float], ps_s: list[float], compute_s: list[float]) -> tuple[Profile, list[list[Job]]]:
    """A profile of layers ready in order after ``backward_s``, each with a PS sync of ``ps_s`` seconds
    and an 8-bit one of no link time but ``compute_s`` seconds of compute."""
    profile = Profile(tuple(LayerProfile(f"l{i}", 4, s) for i, s in enumerate(backward_s)), forward_s=1e-9)
    return profile, [[Job(f"l{i}", i, ps, 10, "PS"), Job(f"l{i}", i, 0.0, 1, "INT8", compute)]
                     for i, (ps, compute) in enumerate(zip(ps_s, compute_s))]


def test_fastest_puts_back_a_layer_whose_compression_a_later_choice_made_useless():
    """Layers l0 and l1 ready at once (PS syncs of 4 s each, back to back on the link), l2 after 2 s of
    backward (1 s). The greedy compresses l0 first (its 2 s of compute on the lane: 9 s -> 7 s), then l1
    (1 s of compute: 6 s), and keeps l2 exact (a tie). But with l1 compressed, l0's exact sync (0 to 4 s)
    hides under l1's compute and l2's backward: back on PS the iteration is 5 s, not 6. The plan must not
    keep a layer on a lossy path its own model predicts slower (issue 48)."""
    profile, options = lossy_options([0.0, 0.0, 2.0], [4.0, 4.0, 1.0], [2.0, 1.0, 1.0])
    plan = fastest(profile, options)
    assert [job.path for job in plan] == ["PS", "INT8", "PS"]
    assert bsp(profile, plan).iteration_s == pytest.approx(5.0)


@settings(max_examples=300, deadline=None)
@given(layers=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.sampled_from([0.5, 1.0, 4.0]),
                                 st.sampled_from([0.1, 0.5, 1.0, 2.0])), min_size=1, max_size=6),
       pipelined_steps=st.booleans())
def test_every_layer_fastest_moves_off_its_default_shortens_the_iteration(layers, pipelined_steps):
    """The plan is never slower than all-default, and putting any layer it moved back on its default
    would make the predicted iteration longer (BSP and pipelined)."""
    profile, options = lossy_options(*map(list, zip(*layers)))
    timeline = pipelined if pipelined_steps else bsp
    plan = fastest(profile, options, pipelined_steps)
    planned = timeline(profile, plan).iteration_s
    assert planned <= timeline(profile, [jobs[0] for jobs in options]).iteration_s * (1 + 1e-9)
    for i, jobs in enumerate(options):
        if plan[i] != jobs[0]:
            assert planned < timeline(profile, [*plan[:i], jobs[0], *plan[i + 1:]]).iteration_s, (i, plan)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layers=st.integers(1, 8), buckets=st.integers(1, 10))
def test_fastest_times_each_change_from_its_layer_on_and_finds_the_whole_timelines_plan(data, layers, buckets):
    """The search times a change from its bucket's layer on (the BSP timeline's state kept per layer, and
    stopping where it meets the plan's again): the plan and its iteration are those of the search that
    times every change over the whole timeline, to the bit (buckets ready after any layer, several or
    none per layer, with compute after their sync)."""
    seconds = st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0])
    profile = Profile(tuple(LayerProfile(f"l{i}", 4, data.draw(seconds)) for i in range(layers)),
                      forward_s=data.draw(st.sampled_from([1e-9, 0.5])), other_s=data.draw(seconds))
    options = []
    for b in range(buckets):
        after = data.draw(st.integers(0, layers - 1))
        paths = data.draw(st.lists(st.tuples(seconds, seconds, st.booleans()), min_size=1, max_size=3))
        options.append([Job(f"b{b}", after, 4.0, 10, "PS"),
                        *(Job(f"b{b}", after, s, 1, f"P{k}", c, lossy) for k, (s, c, lossy) in enumerate(paths))])
    whole = _greedy(profile, options, lambda *args: bsp(*args), 1.0)  # not bsp itself: every change timed whole
    replayed = _greedy(profile, options, bsp, 1.0)
    assert replayed == whole


@pytest.mark.parametrize("after", [1.0, "0", -1, 2])
def test_a_job_that_waits_for_no_layer_index_is_refused(after):
    profile = Profile((LayerProfile("a", 4, 1.0), LayerProfile("b", 4, 1.0)), forward_s=1.0)
    options = [[Job("x", after, 5.0, 1, "PS"), Job("x", after, 1.0, 1, "SFB")]]
    for plan in (lambda: bsp(profile, options[0]), lambda: fastest(profile, options)):
        with pytest.raises(ValueError, match="job 'x' waits for layer .*: a layer's index, and the profile has 2"):
            plan()


def test_fastest_plans_hundreds_of_layers_in_seconds():
    """The coordinator times a plan per candidate layer: on a 500-layer model every layer has a lossy
    candidate. Each timeline without slowdown is linear in the layers (walking every span for every
    piece of compute made it quadratic, and 500 layers took minutes on the 2-core machine)."""
    profile, options = lossy_options([0.004 * (i % 3) for i in range(500)], [0.01 + 0.002 * (i % 5) for i in range(500)],
                                     [0.003] * 500)
    started = time.perf_counter()
    fastest(profile, options)
    assert time.perf_counter() - started < 10.0


def test_every_prediction_is_at_least_the_compute():
    profile = vgg19_22k()
    for row in predict(profile, list(SCHEMES), [1, 2, 8, 64], LinkModel.from_gbps(1.0, 50)):
        assert row.iteration_s >= profile.compute_s - 1e-12
        assert row.speedup <= row.hosts + 1e-9


def test_vgg19_22k_profile_has_the_papers_size_and_iteration():
    profile = vgg19_22k()
    assert profile.nbytes / 4 == pytest.approx(229e6, rel=0.01)
    assert profile.compute_s == pytest.approx(0.925)
    assert [layer.name for layer in profile.layers[:3]] == ["fc8", "fc7", "fc6"]


@pytest.mark.parametrize("hybrid, compression", [(True, None), (False, None), (True, "int8"), (True, "powersgd")],
                         ids=["hybrid", "ps", "int8", "powersgd"])
def test_bytes_and_plan_match_the_engines_counters(cluster, tmp_path, hybrid, compression):
    """The simulator fed the traced run's own trace, at its machines and link, sends what the engine
    counted (mean over ranks) and takes the same layers off the PS path, to the same paths: SFB, or with
    ``compression="int8"`` the 8-bit path (with ``"powersgd"`` PowerSGD, costed from the tensors' shapes the
    trace records) where the coordinator's model (bytes, and the compression compute at the probed memory
    bandwidth the trace records) predicts the iteration shorter. Those
    choices depend on when each layer's gradients were ready: the engine times them with the readiness of
    its first pass, the simulator with the trace's medians, so the simulator is given the engine's
    readiness (the profile's layers one job each, as the coordinator times them): one model, one plan."""
    # PowerSGD (rank 4) sends 4 (M + N) values a layer, SFB K (M + N) (P - 1): 8 rows make it PowerSGD's
    rows = 8 if compression == "powersgd" else 3
    results = cluster.run(simulate_workers.traced_bytes, str(tmp_path), hybrid, compression, rows)
    profile = from_trace(tmp_path / "trace_merged.json")
    link = LinkModel(**profile.link)
    scheme = "wfbp" if not hybrid else "poseidon" if compression is None else f"poseidon+{compression}"
    ready_s = results[0]["ready_s"]
    assert (ready_s is not None) == hybrid and all(r["ready_s"] == ready_s for r in results)
    if ready_s is not None:
        profile = as_timed_by_the_coordinator(profile, ready_s)
    (row,) = predict(profile, [scheme], [cluster.world_size], link)
    # the engine counts a ring all-reduce's 2 (P-1)/P share in whole bytes: PowerSGD's two per bucket may drop one each
    truncated = 2 * len(results[0]["outcomes"]) if compression == "powersgd" else 0
    assert row.bytes_per_machine == pytest.approx(sum(r["bytes"] for r in results) / cluster.world_size, rel=1e-12,
                                                  abs=truncated)
    engine_off_ps = {name for name, outcome in results[0]["outcomes"].items() if outcome != "PS"}
    assert set(row.sfb_layers) == engine_off_ps
    jobs = {job.name: job.path for job in SCHEMES[scheme].jobs(profile, cluster.world_size, link)}
    assert {name: jobs[name] for name in engine_off_ps} == {name: results[0]["outcomes"][name] for name in engine_off_ps}
    sfb = {"body.0", "body.2", "body.4"}  # at 3 rows; at 8 the input layer's PS sync is the cheaper
    if compression is None:
        assert engine_off_ps == (sfb if hybrid else set())
    elif compression == "int8":
        assert sfb <= engine_off_ps
    if compression is not None:  # the slow link makes some layer's compressed sync pay
        assert {"int8": "INT8", "powersgd": "PowerSGD"}[compression] in results[0]["outcomes"].values()
    assert (profile.memory_bps is not None) == (compression is not None)
    assert profile.forward_s > 0 and all(layer.backward_s >= 0 for layer in profile.layers)


def as_timed_by_the_coordinator(profile: Profile, ready_s: dict[str, float]) -> Profile:
    """``profile``'s layers, one job each, in the order of ``ready_s`` and each the backward seconds since
    the one before (how the coordinator lays out the iteration it plans with)."""
    layers = sorted(profile.layers, key=lambda layer: ready_s[layer.name])
    timed, last = [], 0.0
    for layer in layers:
        timed.append(replace(layer, backward_s=max(0.0, ready_s[layer.name] - last)))
        last = max(last, ready_s[layer.name])
    return replace(profile, layers=tuple(timed), buckets=(), forward_s=1e-9, other_s=0.0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poseidon_torch.simulate", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_cli_json_rows_and_plot(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(two_layers().to_dict()))
    plot = tmp_path / "speedup.png"
    done = run_cli(str(profile), "--hosts", "1,2,4", "--bandwidth", "80mbit", "--latency-us", "10000", "--json",
                   "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {(row["scheme"], row["hosts"]) for row in rows} == {(s, n) for s in SCHEMES for n in (1, 2, 4)}
    wfbp2 = next(row for row in rows if row["scheme"] == "wfbp" and row["hosts"] == 2)
    assert wfbp2["iteration_s"] == pytest.approx(6.92)
    assert wfbp2["speedup"] == pytest.approx(2 * 6.5 / 6.92)
    assert plot.stat().st_size > 10_000


@pytest.mark.slow
def test_cli_prints_the_papers_figures_beside_vgg19_22k():
    done = run_cli("vgg19-22k", "--hosts", "2,32", "--bandwidth", "40gbit", "--json")
    assert done.returncode == 0, done.stderr
    paper = {(row["scheme"], row["hosts"]): row.get("paper_speedup") for row in json.loads(done.stdout)}
    assert paper["poseidon", 32] == 29.5 and paper["ps", 2] == 1.01 and paper["ddp", 2] is None


@pytest.mark.parametrize("args, message", [
    (["missing.json", "--bandwidth", "1gbit"], "No such file"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--gemm-gflops", "0"], "gemm_flops is a finite number > 0"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--slowdown", "inf"], "--slowdown is a finite factor"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--plot", "."], "a directory"),
    ([__file__, "--bandwidth", "1gbit"], "not JSON"),
    (["vgg19-22k", "--bandwidth", "fast"], "bad rate"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--hosts", "0,2"], "must be >= 1"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--schemes", "ring"], "unknown scheme"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--slowdown", "0.5"], "finite factor >= 1"),
    (["vgg19-22k", "--bandwidth", "1gbit", "--memory-gbps", "-3"], "memory_bps is a finite number > 0"),
])
def test_cli_bad_input_is_a_clear_error(args, message, capsys):
    """In process (the command's wiring is ``run_cli``'s tests'): the exit status and the message."""
    try:
        status = simulate_main(list(args))
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    stderr = capsys.readouterr().err
    assert status == 2
    assert "poseidon-simulate: error:" in stderr and message in stderr, stderr


@pytest.mark.parametrize("change, message", [
    ({"layers": [{"name": "a", "nbytes": -4, "backward_s": 1.0}]}, "nbytes is an int >= 0"),
    ({"layers": [{"name": "a", "nbytes": 4 * 10 ** 400, "backward_s": 1.0}]}, "nbytes is an int >= 0"),
    ({"layers": [{"name": "a", "nbytes": 4, "backward_s": 1.0, "fc": {"m": 2 ** 63, "n": 2, "k": 1}}]}, "ints > 0"),
    ({"layers": [{"name": "a", "nbytes": 4, "backward_s": 1.0, "fc": {"m": 2, "n": 2, "k": 0}}]}, "ints > 0"),
    ({"gemm_flops": 0}, "gemm_flops is a finite number > 0"),
    ({"element_size": 0}, "element_size is 1, 2, 4 or 8"),
    ({"samples": "32"}, "samples is an int > 0"),
    ({"forward_s": True}, "forward_s is a time"),
    ({"forward_s": 0.0, "other_s": 0.0, "layers": [{"name": "a", "nbytes": 4, "backward_s": 0.0}]},
     "must be finite and > 0"),
    ({"forward_s": None}, "forward_s is a time"),
    ({"layers": [{"name": "a", "nbytes": 12, "backward_s": 1.0, "shapes": [[2]]}]}, "shapes hold 2 elements"),
    ({"layers": [{"name": "a", "nbytes": 8, "backward_s": 1.0, "shapes": [[2], [1]]}]}, "one tuple of sizes"),
    ({"layers": [{"name": "a", "nbytes": 8, "backward_s": 1.0, "shapes": [2]}]}, "one tuple of sizes"),
    ({"layers": [{"name": "a", "nbytes": 8, "backward_s": 1.0, "shapes": 0}]}, "one tuple of sizes"),
    ({"layers": [{"name": "a", "nbytes": 8, "backward_s": 1.0, "shapes": {}}]}, "one tuple of sizes"),
])
def test_a_bad_profile_is_refused_with_the_field_named(change, message):
    good = {**two_layers().to_dict(), "buckets": []}
    with pytest.raises(ValueError, match=message):
        Profile.from_dict({**good, **change})
    with pytest.raises(ValueError, match="the field 'forward_s' is missing"):
        Profile.from_dict({key: value for key, value in good.items() if key != "forward_s"})


@pytest.mark.slow
def test_profile_out_is_the_traced_profile_before_the_options(tmp_path):
    out = tmp_path / "profile.json"
    done = run_cli("vgg19-22k", "--hosts", "2", "--bandwidth", "10gbit", "--compute-scale", "2", "--profile-out",
                   str(out), "--json")
    assert done.returncode == 0, done.stderr
    again = run_cli(str(out), "--hosts", "2", "--bandwidth", "10gbit", "--compute-scale", "2", "--json")
    assert json.loads(again.stdout)[0]["iteration_s"] == json.loads(done.stdout)[0]["iteration_s"]
    failed = tmp_path / "never.json"
    assert run_cli("vgg19-22k", "--hosts", "0", "--bandwidth", "1gbit", "--profile-out", str(failed)).returncode == 2
    assert not failed.exists()


def test_a_trace_whose_forward_waits_for_the_network_is_refused(cluster, tmp_path):
    cluster.run(simulate_workers.traced_delayed, str(tmp_path))
    with pytest.raises(ValueError, match="forward or backward waits for the last step"):
        from_trace(tmp_path / "trace_merged.json")


def test_a_trace_of_a_model_of_two_dtypes_keeps_the_shapes_that_hold_its_bytes(cluster, tmp_path):
    """The trace's element size is the first parameter's (fp32): the fp32 layer keeps its shapes, the fp64
    head's (which would hold half its bytes at 4 bytes an element) are dropped, and the profile loads and
    predicts, as before shapes were recorded."""
    cluster.run(simulate_workers.traced_mixed_dtypes, str(tmp_path))
    layers = {layer.name: layer for layer in from_trace(tmp_path / "trace_merged.json").layers}
    assert layers["body"].shapes == ((32, 16), (32,)) and layers["head"].shapes == ()
    assert layers["head"].nbytes == 8 * (32 * 4 + 4)
    (row,) = predict(from_trace(tmp_path / "trace_merged.json"), ["poseidon+powersgd"], [2], LINK)
    assert row.iteration_s > 0


def test_a_trace_without_layout_is_refused(tmp_path):
    from poseidon_torch.trace.files import write_rank_trace

    path = tmp_path / "old.json"
    write_rank_trace(path, [], 0, 1, {"skip": 0, "iters": 1, "recorded": 1})
    with pytest.raises(ValueError, match="no model layout"):
        from_trace(path)
