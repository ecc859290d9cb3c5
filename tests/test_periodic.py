"""Periodic averaging (``PoseidonDDP(sync_every=H, outer=...)``): local SGD and DiLoCo equal their
single-process simulation (``training.periodic``), every rank holds the same parameters right after each
sync and its own between syncs, bytes leave a rank only at syncs, H = 1 with an outer SGD of lr 1 is BSP,
checkpoints resume bit for bit, and bad options are refused by name."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import periodic_workers as pw
from cluster import Cluster
import training
from models import ModelSpec, model_specs
from poseidon_torch.paths import compression_options
from training import Run

RTOL, ATOL = 1e-5, 1e-6
NESTEROV = pw.NESTEROV
OUTERS = {"local-sgd": None, "diloco": NESTEROV}


def periodic_run(h: int, outer: tuple | None, optimizer: str, **run) -> Run:
    options = {"sync_every": h, **({"outer": outer} if outer is not None else {}), **run.pop("options", {})}
    return Run(optimizer=optimizer, options=options, **run)


def assert_periodic(results: list[dict], reference: dict, h: int, what: str, skip: int | None = None) -> None:
    """Every rank matches its replica of the simulation after every step and at the end; right after a
    sync every rank reads the same bits, between syncs each rank its own; bytes are sent at syncs only."""
    steps = len(results[0]["read"])
    taken = [t for t in range(steps) if t != skip]
    synced_before = {t + 1 for i, t in enumerate(taken) if (i + 1) % h == 0}  # forwards reading a sync's values
    for rank, result in enumerate(results):
        for name, value in reference["params"][rank].items():
            torch.testing.assert_close(result["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what}: rank {rank} {name} at the end: {m}")
        for step in range(steps):
            for name, value in reference["read"][rank][step].items():
                torch.testing.assert_close(result["read"][step][name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{what}: rank {rank} {name} read at step {step}: {m}")
            same = all(torch.equal(result["read"][step][n], results[0]["read"][step][n]) for n in result["params"])
            if step in synced_before:
                assert same, f"{what}: rank {rank} differs from rank 0 right after a sync (step {step})"
            elif step > 0 and rank > 0 and step - 1 != skip:
                assert not same, f"{what}: rank {rank} equals rank 0 at step {step}, between syncs"
        sent = [0] + result["total_sent"]  # after each step taken
        sync_steps = [t for i, t in enumerate(taken) if sent[i + 1] > sent[i]]
        assert sync_steps == sorted(s - 1 for s in synced_before), f"{what}: rank {rank} sent at steps {sync_steps}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_matches_the_single_process_simulation(cluster, mode, optimizer):
    """H = 3 over 8 steps (two syncs, then two steps of a third round): every rank against its replica."""
    h, steps, spec = 3, 8, ModelSpec(widths=(8, 5))
    results = cluster.run(training.train, spec, periodic_run(h, OUTERS[mode], optimizer), steps, 3)
    reference = training.periodic(spec, h, OUTERS[mode], steps, 3, cluster.world_size, optimizer)
    assert_periodic(results, reference, h, f"{mode} {optimizer}")
    for result in results:
        assert result["in_flight"]["periodic"]["mode"] == mode and result["in_flight"]["periodic"]["steps"] == steps


@pytest.mark.parametrize("delay", [1, 3])
@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_a_delayed_sync_matches_the_simulation(cluster, mode, delay):
    """``delay=d`` (H = 3, 9 steps: syncs after steps 3 and 6, landing d steps later; with d = 3 the second
    lands as the third is sent): every rank against its replica of the simulation after every step, the
    bytes counted when a sync lands (its pass closes then), at no other step; each rank keeps its own
    steps on top of what lands, so they differ."""
    h, steps, spec = 3, 9, ModelSpec(widths=(8, 5))
    run = periodic_run(h, OUTERS[mode], "adamw", options={"delay": delay})
    results = cluster.run(training.train, spec, run, steps, 3)
    reference = training.periodic(spec, h, OUTERS[mode], steps, 3, cluster.world_size, "adamw", delay=delay)
    for rank, result in enumerate(results):
        for step in range(steps):
            for name, value in reference["read"][rank][step].items():
                torch.testing.assert_close(result["read"][step][name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{mode} delay={delay}: rank {rank} {name} step {step}: {m}")
        for name, value in reference["params"][rank].items():
            torch.testing.assert_close(result["state"][name], value, rtol=RTOL, atol=ATOL)
        sent = [0] + result["total_sent"]
        landed_at = [t + delay for t in (2, 5) if t + delay < steps]  # the sync after step 8 lands at the end
        assert [t for t in range(steps) if sent[t + 1] > sent[t]] == landed_at, f"rank {rank}: {sent}"
        assert result["in_flight"]["delay"] == delay and "in_flight" in result["in_flight"]["periodic"]
        assert rank == 0 or not torch.equal(result["state"]["head.weight"], results[0]["state"]["head.weight"])
    # the delay is what makes them differ: the no-delay reference has every rank equal right after a sync
    landed = training.periodic(spec, h, OUTERS[mode], 4 + delay - 1, 3, cluster.world_size, "adamw", delay=0)
    assert torch.equal(landed["read"][0][3]["head.weight"], landed["read"][1][3]["head.weight"])


@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_fragments_sync_in_turn_and_match_the_simulation(cluster, mode, delay):
    """H = 4 in 2 fragments (every layer its own bucket: fusion_bytes=0), 10 steps: fragment 0 syncs after
    steps 2, 6, 10 and fragment 1 after 4, 8, each landing d steps later; every rank equals its replica of
    the simulation with the same fragments after every step, and each sync sends only its fragment."""
    h, steps, spec = 4, 10, ModelSpec(widths=(8, 5))
    run = periodic_run(h, OUTERS[mode], "adamw", options={"delay": delay, "fragments": 2, "fusion_bytes": 0})
    results = cluster.run(training.train, spec, run, steps, 3)
    fragments = results[0]["fragments"]
    assert len(fragments) == 2 and all(fragments) and not fragments[0] & fragments[1]
    assert all(result["fragments"] == fragments for result in results)
    reference = training.periodic(spec, h, OUTERS[mode], steps, 3, cluster.world_size, "adamw", delay=delay,
                                  fragments=fragments)
    for rank, result in enumerate(results):
        for step in range(steps):
            for name, value in reference["read"][rank][step].items():
                torch.testing.assert_close(result["read"][step][name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{mode} delay={delay}: rank {rank} {name} step {step}: {m}")
        sent = [0] + result["total_sent"]
        per_sync = [sent[t + 1] - sent[t] for t in range(steps) if sent[t + 1] > sent[t]]
        landed = [t + delay for t in (1, 3, 5, 7, 9) if t + delay < steps]
        assert [t for t in range(steps) if sent[t + 1] > sent[t]] == landed, (rank, sent)
        assert max(per_sync) < sum(per_sync[:2]), per_sync  # one fragment at a time, not the model


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=12), fragments=st.integers(1, 6))
def test_fragments_are_runs_of_consecutive_buckets_of_about_equal_bytes(sizes, fragments):
    """Every fragment gets a run of consecutive buckets, none empty, each within one bucket's bytes of an
    equal share; fewer buckets than fragments is refused, saying what to change."""
    from types import SimpleNamespace

    from poseidon_torch.modes.periodic import LocalSGD, PeriodicOptions
    mode = LocalSGD(PeriodicOptions(fragments * 2, fragments=fragments))
    buckets = [SimpleNamespace(nbytes=size) for size in sizes]
    if len(sizes) < fragments:
        with pytest.raises(ValueError, match="give fewer fragments"):
            mode.buckets_changed(buckets)
        return
    mode.buckets_changed(buckets)
    assigned = [mode._fragment_of[id(b)] for b in buckets]
    assert assigned == sorted(assigned) and set(assigned) == set(range(fragments)), assigned
    share = sum(sizes) / fragments
    for f in range(fragments):
        held = sum(size for size, g in zip(sizes, assigned) if g == f)
        assert abs(held - share) <= max(sizes) + 1e-9 or held == max(sizes), (sizes, assigned)


@pytest.mark.parametrize("compression", [None, "int8"])
def test_fragments_resume_bit_for_bit_with_a_sync_in_flight(cluster, compression):
    """DiLoCo, H = 4 in 2 fragments, delay 1: a checkpoint after step 5 (fragment 0's second sync, sent
    after step 6, not yet; fragment 1's first, sent after 4, landed) and after step 6 (in flight); with
    int8 outer syncs the checkpoint carries every rank's residuals too."""
    for stop in (5, 6):
        options = {"sync_every": 4, "fragments": 2, "delay": 1, "fusion_bytes": 0, "outer": NESTEROV,
                   **({"compression": compression} if compression else {})}
        for rank, result in enumerate(cluster.run(pw.checkpoint_resume, options, "adamw", stop, 9)):
            for name, value in result["straight"].items():
                assert torch.equal(result["resumed"][name], value), f"stop {stop}: rank {rank}: {name} differs"
            assert ("in_flight" in result["saved"]["periodic"]) == (stop == 6)
            assert result["saved"]["periodic"]["fragments"] == 2
            assert ("paths" in result["saved"]) == (compression is not None)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=model_specs(), h=st.integers(1, 3), mode=st.sampled_from(sorted(OUTERS)),
       optimizer=st.sampled_from(["sgd", "adamw"]), engine=st.sampled_from(["native", "python"]))
def test_generated_models_match_the_simulation(cluster, spec, h, mode, optimizer, engine):
    if spec.batchnorm:  # a bias before BatchNorm gets a gradient of rounding noise, which Adam scales up to steps
        optimizer = "sgd"
    run = periodic_run(h, OUTERS[mode], optimizer, options={"engine": engine, "fusion_bytes": 512})
    results = cluster.run(training.train, spec, run, 5, 2, timeout=200)
    reference = training.periodic(spec, h, OUTERS[mode], 5, 2, cluster.world_size, optimizer)
    for rank, result in enumerate(results):
        for name, value in reference["state"][rank].items():
            torch.testing.assert_close(result["state"][name].to(value.dtype), value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{spec} {mode} H={h}: rank {rank} {name}: {m}")


def test_buffers_are_averaged_at_each_sync_unless_broadcast_buffers_is_off(cluster):
    """BatchNorm's statistics: averaged with the parameters (the same on every rank after a sync), or each
    rank's own with ``broadcast_buffers=False``. (SGD: a conv bias before BatchNorm gets a gradient of
    rounding noise, which Adam would scale up to whole steps.)"""
    spec, h, steps = ModelSpec(conv_channels=(3,), batchnorm=True, widths=(5,)), 2, 4
    for average in (True, False):
        run = periodic_run(h, NESTEROV, "sgd", options={"broadcast_buffers": average})
        results = cluster.run(training.train, spec, run, steps, 2)
        reference = training.periodic(spec, h, NESTEROV, steps, 2, cluster.world_size, "sgd",
                                      average_buffers=average)
        for rank, result in enumerate(results):
            for name, value in reference["state"][rank].items():
                torch.testing.assert_close(result["state"][name].to(value.dtype), value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"buffers averaged={average}: rank {rank} {name}: {m}")
        running = [result["state"]["features.1.running_mean"] for result in results]
        assert all(torch.equal(r, running[0]) for r in running) == average


@pytest.mark.parametrize("options", [{"sync_every": 4}, {"sync_every": 4, "outer": NESTEROV},
                                     {"sync_every": 4, "delay": 1}, {"sync_every": 4, "fragments": 2, "delay": 1,
                                                                      "fusion_bytes": 0}],
                         ids=["local-sgd", "diloco", "delayed", "fragments"])
def test_end_round_ends_the_round_on_every_rank(cluster, options):
    """``end_round()`` after step 5 (H = 4: mid-round; with delay 1 the sync sent after step 4 landed in
    step 5): every rank holds the same bits, for local SGD without a delay the average of the ranks'
    parameters (rank order); training goes on, and a second one after step 8 agrees again."""
    results = cluster.run(pw.synchronize_mid_round, options)
    for rank, result in enumerate(results):
        for name, value in results[0]["after"].items():
            assert torch.equal(result["after"][name], value), (rank, name)
            assert torch.equal(result["later"][name], results[0]["later"][name]), (rank, name)
    if options == {"sync_every": 4}:
        before = results[0]["before"]
        for name, value in results[0]["after"].items():
            expected = sum((b[name] for b in before[1:]), before[0][name].clone()) / len(before)
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(results[0]["after"][n], results[0]["before"][0][n]) for n in results[0]["after"])


def test_a_buffer_that_never_changes_keeps_its_bits(cluster):
    """Averaging x over P ranks as sum / P changes about one value in six by an ulp at P = 3; the sync must
    leave a buffer equal on every rank unchanged."""
    assert all(cluster.run(pw.constant_buffer))


def test_a_step_every_rank_skips_is_no_step(cluster):
    """A backward that raises on every rank, its step skipped: the round counts the steps taken."""
    h, steps, spec = 2, 6, ModelSpec(widths=(8, 5))
    results = cluster.run(training.train, spec, periodic_run(h, NESTEROV, "sgd", skip=2), steps, 3)
    reference = training.periodic(spec, h, NESTEROV, steps, 3, cluster.world_size, "sgd", skip=2)
    assert all(result["errors"] == ["ValueError"] for result in results)
    assert_periodic(results, reference, h, "skip", skip=2)


def test_h1_with_outer_sgd_lr_1_is_bsp(cluster):
    """Plain SGD: bit-identical to BSP where every inner step is exact (dyadic data: several steps with 2
    ranks; with 3 the average's division by 3 rounds, so one step), else to rounding."""
    world_size = cluster.world_size
    steps = 3 if world_size == 2 else 1
    for rank, result in enumerate(cluster.run(pw.exact_h1_against_bsp, steps)):
        for name, value in result["bsp"].items():
            if world_size == 2:  # the premise: nothing rounded (every value a multiple of 2^-20)
                assert not torch.any(torch.frac(value * 2 ** 20)), f"{name} was rounded: {value}"
            assert torch.equal(result["diloco"][name], value), f"rank {rank}: DiLoCo H=1 {name} is not BSP's bits"
            if world_size == 2:
                assert torch.equal(result["local"][name], value), f"rank {rank}: local SGD H=1 {name} is not BSP's"
    spec = ModelSpec(widths=(8, 5))
    outer = (torch.optim.SGD, {"lr": 1.0})
    results = cluster.run(training.train_runs, spec, [periodic_run(1, outer, "plain-sgd"), Run(optimizer="plain-sgd")],
                          5, 3)
    reference = training.bsp(spec, 5, 3, world_size, "plain-sgd")
    for rank, (diloco, bsp) in enumerate(results):
        for name, value in reference["params"].items():
            torch.testing.assert_close(diloco["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name} against BSP in one process: {m}")
            torch.testing.assert_close(diloco["state"][name], bsp["state"][name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stop", [4, 3], ids=["mid-round", "at-a-sync"])
@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_a_resumed_run_continues_bit_for_bit(cluster, mode, stop):
    """AdamW inside, H = 3, 7 steps: a checkpoint after ``stop`` steps (each rank its own model and inner
    optimizer; the consistency state, the same on every rank) continues the same trajectory, bit for bit."""
    options = {"sync_every": 3, **({"outer": OUTERS[mode]} if OUTERS[mode] else {})}
    results = cluster.run(pw.checkpoint_resume, options, "adamw", stop, 7)
    for rank, result in enumerate(results):
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), f"rank {rank}: {name} differs after resuming"
        saved = result["saved"]["periodic"]
        assert saved["steps"] == stop and result["integrations_saved"]
        if mode == "diloco":  # the outer momentum (after the first sync), and the round's start mid-round only
            assert (saved["start"] is None) == (stop % 3 == 0)
            first = results[0]["saved"]["periodic"]  # the same on every rank: one copy serves all
            momentum = {k: v["momentum_buffer"] for k, v in saved["outer"]["state"].items()}
            assert momentum and all(torch.equal(t, first["outer"]["state"][k]["momentum_buffer"])
                                    for k, t in momentum.items())
            assert saved["start"] is None or all(torch.equal(t, first["start"][n]) for n, t in saved["start"].items())


@pytest.mark.parametrize("stop", [4, 5, 6], ids=["in-flight", "as-it-lands", "just-sent"])
@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_a_run_resumed_with_a_sync_in_flight_continues_bit_for_bit(cluster, mode, stop):
    """H = 3, delay = 2, 8 steps: a checkpoint while the first sync flies (after step 4), right as it landed
    (5), or right after the second was sent (6) carries what was sent and its averages, and the resumed run
    lands them at the same step, bit for bit."""
    options = {"sync_every": 3, "delay": 2, **({"outer": OUTERS[mode]} if OUTERS[mode] else {})}
    results = cluster.run(pw.checkpoint_resume, options, "adamw", stop, 8)
    for rank, result in enumerate(results):
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), f"rank {rank}: {name} differs after resuming"
        saved = result["saved"]
        assert saved["delay"] == 2 and ("in_flight" in saved["periodic"]) == (stop != 5)
        assert result["integrations_saved"]


def test_wrong_consistency_states_are_refused_and_change_nothing(cluster):
    for result in cluster.run(pw.bad_states):
        for case, error in result["errors"].items():
            assert error is not None, f"{case} was loaded"
        assert "saved without sync_every" in result["errors"]["bsp state"]
        assert "sync_every=2" in result["errors"]["other H"] and "local-sgd" in result["errors"]["local sgd state"]
        assert "'steps'" in result["errors"]["bad steps"] and "'start'" in result["errors"]["missing start"]
        assert "head.bias" in result["errors"]["bad shape"] and "sync_every=H" in result["errors"]["into bsp"]
        assert "must be there exactly when 'steps' is not a multiple" in result["errors"]["no start mid-round"]
        assert "it was there at steps=" in result["errors"]["start at a round's end"]
        assert result["unchanged"]


def test_wrong_in_flight_states_are_refused_and_change_nothing(cluster):
    expected = {"saved without a delay": "saved with delay=0", "no sync in flight": "it was missing",
                "in flight when none flies": "it was there", "sent of one parameter": "every parameter of the fragment",
                "average of a bad shape": "'head.bias'", "an unknown key": "with 'sent' and 'averages'"}
    for result in cluster.run(pw.bad_flight_states):
        for case, text in expected.items():
            error = result["errors"][case]
            assert error is not None and error[0] == "ValueError" and text in error[1], (case, error)
        assert result["unchanged"]


def test_a_state_saved_with_another_outer_is_refused_and_changes_nothing(cluster):
    """torch's load_state_dict would take the saved outer hyperparameters over the new outer= (a smaller
    outer lr asked for on resume, silently dropped) or, from another class, break at the next outer step
    (Adam: a KeyError while loading, with the state half replaced)."""
    for result in cluster.run(pw.resume_with_another_outer):
        for case, outcome in result.items():
            assert outcome["error"] is not None, f"{case}: loaded"
            kind, message = outcome["error"]
            assert kind == "ValueError" and "resume with the outer= it was saved with" in message, (case, message)
            assert outcome["unchanged"], case

def test_bad_options_and_combinations_are_refused_by_name(cluster):
    expected = {
        "sync_every=0": ("ValueError", "sync_every must be >= 1"),
        "sync_every=-2": ("ValueError", "sync_every must be >= 1"),
        "sync_every=True": ("TypeError", "sync_every must be an int"),
        "sync_every=2.0": ("TypeError", "sync_every must be an int"),
        "outer without sync_every": ("ValueError", "needs sync_every=H"),
        "outer an optimizer": ("TypeError", "not an optimizer already built"),
        "outer not an optimizer": ("TypeError", "option outer must be"),
        "outer bad lr": ("ValueError", "option outer: SGD refused its arguments"),
        "outer bad argument": ("ValueError", "Nesterov"),
        "delay above H": ("ValueError", "must be at most 2"),
        "fragments not dividing H": ("ValueError", "that divides sync_every=4"),
        "delay above H / fragments": ("ValueError", "must be at most 2"),
        "fragments without sync_every": ("ValueError", "fragments (periodic averaging) needs sync_every=H"),
        "more fragments than buckets": ("ValueError", "fragments, and it has 3 (buckets of whole layers"),
        "delay not an int": ("TypeError", "delay must be an int"),
        "SFB override": ("ValueError", "from their factors"),
        "compression with local SGD": ("ValueError", "needs outer= (DiLoCo)"),
        "two compressions": ("ValueError", "every outer sync takes one path"),
        "compression and overrides": ("ValueError", "every outer sync takes the INT8 path"),
        "compression start_iter": ("ValueError", "start_iter=10 does not apply: every outer sync takes PowerSGD"),
        "lossy override": ("ValueError", "overrides put ['head'] on the lossy path(s) ['BF16']"),
        "ServerOptimizer": ("RuntimeError", "drop sync_every"),
        "join": ("RuntimeError", "join() (uneven inputs) is not supported with sync_every=2"),
    }
    for rank, errors in enumerate(cluster.run(pw.refusals)):
        for case, (kind, text) in expected.items():
            assert errors[case] is not None, f"rank {rank}: {case} was accepted"
            assert errors[case][0] == kind and text in errors[case][1], f"rank {rank}: {case}: {errors[case]}"


def test_a_step_is_one_outermost_step_of_one_optimizer(cluster):
    """A subclass calling super().step() and a wrapper calling the wrapped optimizer's step() (SAM's
    shape; it was refused as a second optimizer) each count one step per call, and the wrapper trains
    as plain SGD does; a second optimizer is refused."""
    for result in cluster.run(pw.optimizer_steps):
        for name in ("sgd", "subclass", "wrapper"):
            assert result[name]["error"] is None and result[name]["syncs"] == [0, 1, 1, 2], (name, result[name])
        for n, value in result["sgd"]["params"].items():
            assert torch.equal(result["wrapper"]["params"][n], value), n
        assert result["second"][0] == "RuntimeError" and "use one optimizer with param groups" in result["second"][1]


@pytest.mark.slow
def test_a_dead_peer_fails_the_sync_within_timeout(fresh_cluster):
    """The survivor's H-th step() raises within the timeout, after its own update (its round end stays
    in the parameters), and the next forward refuses."""
    outcomes = fresh_cluster.run_outcomes(pw.peer_exits_before_a_sync, timeout=60)
    assert 1 not in outcomes and fresh_cluster.exit_code(1) == 3
    survivor = outcomes[0]
    assert survivor.ok, survivor.value
    assert survivor.value["error_type"] in ("SyncError", "SyncTimeout") and survivor.value["elapsed"] < 10 + 5
    assert survivor.value["stepped"] and "cannot continue" in survivor.value["next_forward"]


def test_a_closure_optimizer_whose_first_forward_runs_inside_step(cluster):
    """LBFGS's closure runs the model's first forward inside the first step(), so the engine (and its step
    hooks) starts after that step began: DiLoCo still takes the round's start there (it raised a TypeError
    at the first sync), and with an outer SGD of lr 1 it equals local SGD to rounding (start - mean(start -
    end) differs from mean(end) by ulps, which LBFGS's curvature pairs amplify: 1.6e-6 at P3, so 1e-4/1e-5)."""
    for rank, result in enumerate(cluster.run(pw.closure_optimizer)):
        for name in ("diloco", "local"):
            assert result[name]["syncs"] == [0, 1, 1, 2], (rank, name)
        for n, value in result["local"]["params"].items():
            torch.testing.assert_close(result["diloco"]["params"][n], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {n}: {m}")


@pytest.mark.parametrize("compression", ["int8", "bf16", {"powersgd": {"rank": 1}}], ids=["int8", "bf16", "powersgd"])
def test_a_lossy_outer_sync_loses_nothing_to_error_feedback(cluster, compression):
    """DiLoCo (outer SGD, lr 1) with its pseudo-gradients on a lossy path, fp64, H = 2 over 8 steps: every
    rank starts each round from the same bits; the rounds' applied averages plus the mean of the ranks'
    final residuals equal the sum of the true averaged pseudo-gradients (error feedback across rounds loses
    nothing, to fp64 rounding); the path ran (the plan names it for every bucket, the syncs sent fewer bytes
    than the exact outer sync) and rounded (an applied average differs from the exact one)."""
    h, steps = 2, 8
    results = cluster.run(pw.lossy_outer_sync, compression, h, steps)
    exact = cluster.run(pw.lossy_outer_sync, None, h, steps)
    path = compression_options()[next(iter(compression)) if isinstance(compression, dict) else compression].name
    for rank, result in enumerate(results):
        assert result["plan"] == {path}, f"rank {rank}: the plan shows {result['plan']}"
        for k, start in enumerate(result["starts"]):
            assert all(torch.equal(t, results[0]["starts"][k][n]) for n, t in start.items()), f"rank {rank}, round {k}"
        assert all(sent[path] > 0 and sum(sent.values()) < sum(full.values())
                   for sent, full in zip(result["sent"], exact[rank]["sent"]))
    rounded = False
    for name, first in results[0]["starts"][0].items():
        applied = first - results[0]["starts"][-1][name]
        true = sum(torch.stack([r["pseudo"][k][name] for r in results]).mean(0) for k in range(steps // h))
        residual = torch.stack([r["residuals"].get(name, torch.zeros_like(first)) for r in results]).mean(0)
        torch.testing.assert_close(applied + residual, true, rtol=0, atol=1e-12,
                                   msg=lambda m: f"{compression}: {name}: {m}")
        last = results[0]["starts"][-2][name] - results[0]["starts"][-1][name]
        rounded |= not torch.allclose(last, torch.stack([r["pseudo"][-1][name] for r in results]).mean(0),
                                      rtol=0, atol=1e-12)
    assert rounded, f"{compression}: every applied average was exact: the lossy path did not run"


@pytest.fixture(scope="module")
def alone():
    """A world of one rank."""
    c = Cluster(1)
    yield c
    c.close()


@pytest.mark.parametrize("options", [{"sync_every": 2}, {"sync_every": 4, "fragments": 2, "delay": 1}],
                         ids=["H2", "streaming"])
def test_a_lossy_outer_sync_in_a_world_of_one_is_exact_and_resumes(alone, options):
    """A world of one has nothing to send, so compression= means the default (exact) path there, as it
    does in every other mode (docs/compression.md): DiLoCo with int8 trains the same bits as without it,
    keeps no residuals, and a checkpoint it saved mid-round resumes bit for bit (it was refused: the outer
    syncs rounded through INT8, saved its residuals, and the load found no lossy path named)."""
    options = {**options, "outer": NESTEROV, "fusion_bytes": 0}
    [lossy] = alone.run(pw.checkpoint_resume, {**options, "compression": "int8"}, "adamw", 3, 9)
    [exact] = alone.run(pw.checkpoint_resume, options, "adamw", 3, 9)
    assert "paths" not in lossy["saved"]
    for name, value in exact["straight"].items():
        assert torch.equal(lossy["straight"][name], value), f"{name}: int8 rounded in a world of one"
        assert torch.equal(lossy["resumed"][name], value), f"{name} differs after resuming"


@pytest.mark.parametrize("compression", ["bf16", "fp16", "int8"])
def test_a_non_finite_pseudo_gradient_lands_as_the_exact_sync_lands_it(cluster, compression):
    """An inf in one rank's round (a diverged replica) makes the outer sync's average non-finite on every
    rank alike, as the exact sync does (int8: the inf's whole block), and every rank's residuals stay
    finite (the old ones are kept): the bf16/fp16 casts saturated the inf into a huge finite average, and
    its rank kept an inf residual that saturated every later sync of that entry."""
    assert all(not all(r["finite"].values()) for r in cluster.run(pw.non_finite_round, None))  # exact: non-finite
    results = cluster.run(pw.non_finite_round, compression)
    for rank, result in enumerate(results):
        assert not all(result["finite"].values()) and result["finite"] == results[0]["finite"], \
            f"rank {rank}: {result['finite']}"
        assert result["residuals"] and all(bool(torch.isfinite(t).all()) for t in result["residuals"].values()), \
            f"rank {rank}: a residual is not finite"
