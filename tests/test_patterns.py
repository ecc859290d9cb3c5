"""Issue 8: every training pattern DDP users rely on gives the hand-averaged gradient on every rank,
bit-identical across ranks, or a clear error; nothing hangs (every call has a deadline)."""
from __future__ import annotations

import pytest
import torch

import patterns

TOL = 2e-6


def assert_exact(results: list[dict], tol: float = TOL) -> None:
    """Every rank's gradients match the hand average at every step, and the ranks agree bit for bit."""
    steps = len(results[0]["steps"])
    assert steps > 0
    for step in range(steps):
        for rank, r in enumerate(results):
            assert r["steps"][step]["diff"] <= tol, f"rank {rank} step {step}: {r['steps'][step]['diff']}"
        prints = {r["steps"][step]["fingerprint"] for r in results}
        assert len(prints) == 1, f"step {step}: ranks hold different gradients"


def outcomes(results: list[dict], step: int) -> dict[str, str]:
    """How each bucket synced at ``step`` (PS, SFB, SFB->PS); the same on every rank."""
    seen = [r["steps"][step]["outcomes"] for r in results]
    assert all(s == seen[0] for s in seen), seen
    return seen[0]


def assert_paths(results: list[dict], expected: dict[str, list[str]]) -> None:
    """``expected[layer]``: the outcome at every step; the first step always syncs on PS."""
    for layer, per_step in expected.items():
        got = [outcomes(results, step)[layer] for step in range(len(per_step))]
        assert got == per_step, f"{layer}: {got}"


#: the Python core is the reference; the native one (the default where it is built) runs the rest
CORES = [pytest.param({"POSEIDON_ENGINE": "python"}, id="python-core"), pytest.param({}, id="default-core")]


@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_caught_exception_in_backward_does_not_leak_into_next_steps(cluster, force, env):
    # with SFB the aborted step's layers are committed: they fall back to PS for that step, exactly
    assert_exact(cluster.run(patterns.caught_exception_in_backward, force, timeout=60, env=env))


@pytest.mark.slow
@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_a_peer_whose_backward_raised_is_named_and_nobody_steps(cluster, force, env, server):
    """Only the last rank raises: the others must not return from backward()/step() with their local
    gradient as if it were the average (a silent divergence); they raise SyncError naming that rank,
    their .grad keeps the local gradient, and after every rank skips the step they agree bit for bit
    with torch DDP skipping the same batch."""
    results = cluster.run(patterns.one_rank_raises_in_backward, force, server, timeout=90, env=env)
    for rank, r in enumerate(results):
        if rank == r["bad_rank"]:
            assert r["error"] is None, r["error"]
            continue
        assert r["error"] is not None and f"rank(s) {r['bad_rank']} was aborted" in r["error"], r["error"]
        if not server:
            assert r["local_diff"] <= TOL < r["average_diff"], (r["local_diff"], r["average_diff"])
        for name, value in r["finals"]["ddp"].items():
            torch.testing.assert_close(r["finals"]["poseidon"][name], value, rtol=1e-5, atol=1e-6)
    assert len({r["fingerprint"] for r in results}) == 1, "the ranks' parameters differ"
    if force == "SFB":  # the step after the bad one syncs on SFB again
        assert results[0]["outcomes"]["fc1"] == "SFB"


@pytest.mark.parametrize("hybrid", [False, True])
def test_no_grad_forward_between_forward_and_backward(cluster, hybrid):
    assert_exact(cluster.run(patterns.no_grad_forward_before_backward, hybrid, timeout=60))


@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_no_sync_keeps_gradients_of_branches_used_early(cluster, force, env):
    results = cluster.run(patterns.no_sync_branch_used_early, force, timeout=60, env=env)
    assert_exact(results)
    if force == "SFB":  # accumulated gradients are more than the factors: PS, then PS for good
        assert_paths(results, {"fc1": ["PS", "SFB->PS", "PS"], "side": ["PS", "SFB->PS", "PS"]})


SFB_ON, PS_ON = ["PS", "SFB", "SFB", "SFB"], ["PS"] * 4
SFB_PATTERNS = {  # how each FC layer syncs, step by step: SFB where exact, PS where not
    "retain_graph": {"fc1": SFB_ON, "head": SFB_ON},
    "gradient_penalty": {"fc1": PS_ON, "head": PS_ON},  # seen in the first step: never committed
    "l2_on_weight": {"fc1": ["PS", "SFB->PS", "PS", "PS"], "head": SFB_ON},
    "weight_hook": {"fc1": PS_ON, "head": SFB_ON},
    "post_accumulate_hook": {"fc1": PS_ON, "head": SFB_ON},  # the mask acts on .grad: fc1 never on SFB
    # the same hooks registered at step 2, with fc1 on SFB: that step's calls run undetached, so the hook
    # acts and every rank sends its whole gradient (SFB->PS); PS from then on
    "late_weight_hook": {"fc1": ["PS", "SFB", "SFB->PS", "PS"], "head": SFB_ON},
    "late_post_accumulate_hook": {"fc1": ["PS", "SFB", "SFB->PS", "PS"], "head": SFB_ON},
    "siamese": {"fc1": SFB_ON, "head": SFB_ON},
    "call_outside_forward": {"fc1": PS_ON, "head": PS_ON},
    "inplace_3d": {"fc1": SFB_ON, "head": SFB_ON},  # relu_ on fc1's 3-D output (a view)
    "inplace_output": {"fc1": SFB_ON, "head": SFB_ON},  # mul_ on the wrapper's 3-D output (a view)
    "grad_call": {"fc1": PS_ON, "head": PS_ON},  # autograd.grad for W from the start: never SFB
    "lazy_grad_call": {"fc1": SFB_ON, "head": SFB_ON},  # starts on SFB: that call fails, see below
}


@pytest.mark.slow
@pytest.mark.parametrize("pattern", sorted(SFB_PATTERNS))
def test_sfb_layers_stay_exact_in_real_training_patterns(cluster, pattern):
    results = cluster.run(patterns.sfb_pattern, pattern, timeout=60)
    assert_exact(results, tol=5e-6)
    assert_paths(results, SFB_PATTERNS[pattern])


@pytest.mark.parametrize("pattern", ["weight_hook", "post_accumulate_hook", "late_post_accumulate_hook"])
def test_hooks_registered_after_wrapping_act_before_the_sync_on_the_python_core(cluster, pattern):
    """The engine learns a parameter is ready only after every hook of its accumulation ran, also hooks
    registered after it (the native core by construction; the Python core runs every GPU model)."""
    results = cluster.run(patterns.sfb_pattern, pattern, timeout=60, env={"POSEIDON_ENGINE": "python"})
    assert_exact(results, tol=5e-6)
    assert_paths(results, SFB_PATTERNS[pattern])


def test_autograd_grad_gives_local_gradients_or_fails_on_every_rank(cluster):
    """autograd.grad for the parameters returns the local gradients, as with DDP, when the loop asks
    for them from the first step (the layers then never go to SFB). Asked first while layers are on
    SFB (their weights are not in that step's graph), the call fails with torch's error on every rank
    and training goes on exactly (a documented limitation: overrides={layer: "PS"})."""
    for r in cluster.run(patterns.sfb_pattern, "grad_call", timeout=60):
        assert all(call["error"] is None and call["diff"] <= 1e-6 for call in r["local"]), r["local"]
    for r in cluster.run(patterns.sfb_pattern, "lazy_grad_call", timeout=60):
        (call,) = r["local"]
        assert "not have been used in the graph" in call["error"]


def test_frozen_bias_trainable_weight(cluster):
    assert_exact(cluster.run(patterns.frozen_bias, timeout=60))


@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_a_bias_frozen_during_training_stays_frozen(cluster, force, server):
    for r in cluster.run(patterns.bias_frozen_midway, force, server, timeout=60):
        assert r["paths"][2] == force, r["paths"]  # the path under test ran the step the bias was frozen in
        assert r["grad_after_freeze"] == [False, False] and r["moved_after_freeze"] == [0.0, 0.0], r


def test_bad_options_fail_at_once_on_every_rank(cluster):
    for r in cluster.run(patterns.bad_options, timeout=60):
        for options, error in zip(patterns.BAD_OPTIONS, r["errors"]):
            assert error is not None and error["type"] == "TypeError", (options, error)
            assert error["seconds"] < 5, (options, error)
            assert next(iter(options)) in error["message"], (options, error)


def test_gradient_penalty_through_a_committed_layer_fails_clearly_on_every_rank(cluster):
    results = cluster.run(patterns.sfb_pattern, "lazy_penalty", timeout=60)
    for r in results:
        assert "create_graph=True" in r["error"] and "'head'" in r["error"], r["error"]


def test_wrapping_twice_works_or_fails_clearly(cluster):
    results = cluster.run(patterns.wrap_twice, timeout=60)
    if results[0]["error"] is None:
        assert_exact(results)
        assert all(r["first_still_synced"] == 0 for r in results), "the first wrapper still syncs"
    else:
        assert all("already wrapped" in r["error"] for r in results)


def test_sfb_with_accumulating_grads_keeps_replicas_bit_identical(cluster):
    results = cluster.run(patterns.sfb_accumulating_grads, timeout=60)
    assert len({r["params"] for r in results}) == 1
    assert all(r["outcomes"] == {"fc1": "SFB", "head": "SFB", "side": "SFB"} for r in results), results[0]


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_amp_autocast_bf16(cluster, force):
    results = cluster.run(patterns.amp_autocast, force, timeout=60)
    assert_exact(results, tol=2e-2)  # bf16 forward: the reference itself differs at bf16 rounding
    if force == "SFB":
        assert_paths(results, {"fc1": SFB_ON, "head": SFB_ON})


@pytest.mark.slow
@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("case", ["bfloat16", "float16", "float16-near-overflow"])
def test_half_precision_is_summed_in_fp32_and_rounded_once(cluster, case, env, server):
    """bf16 and fp16 averages are the fp32 rank-order sum divided by P, rounded once: bit for bit (at
    P = 3 a sum in the parameter's own dtype differs; at any P, 40000 per rank overflows fp16)."""
    dtype, big = case.split("-")[0], case.endswith("overflow")
    for r in cluster.run(patterns.half_precision_average, dtype, big, server, timeout=60, env=env):
        assert r["mismatches"] == [0, 0] and all(r["finite"]), r


def test_parameters_of_several_dtypes(cluster):
    assert_exact(cluster.run(patterns.mixed_dtypes, timeout=60), tol=1e-2)


@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(cluster, reentrant, env):
    results = cluster.run(patterns.activation_checkpointing, reentrant, timeout=60, env=env)
    assert_exact(results, tol=5e-6)
    # the layers inside the checkpointed block stay on PS; the one outside takes SFB
    assert_paths(results, {"fc1": SFB_ON, "block.0": PS_ON, "block.2": PS_ON})


def test_layer_used_on_some_ranks_under_no_sync(cluster):
    assert_exact(cluster.run(patterns.no_sync_layer_on_some_ranks, timeout=60), tol=5e-6)


def test_process_group_other_than_the_world(cluster):
    members = (1, 2) if cluster.world_size == 3 else (1,)
    results = cluster.run(patterns.subgroup_training, members, timeout=60)
    assert_exact([results[r] for r in members], tol=5e-6)
    assert all(not results[r]["member"] for r in range(cluster.world_size) if r not in members)


def test_forward_on_one_rank_only_issues_no_collective(cluster):
    results = cluster.run(patterns.forward_on_rank0_only, timeout=40)
    assert_exact(results, tol=5e-6)


@pytest.mark.parametrize("env", CORES)
@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_join_handles_uneven_inputs_like_ddp(cluster, force, env):
    ours = cluster.run(patterns.uneven_inputs_join, "poseidon", force, timeout=60, env=env)
    theirs = cluster.run(patterns.uneven_inputs_join, "ddp", force, timeout=60)
    for rank in range(cluster.world_size):
        for name, value in theirs[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][name], value, rtol=1e-5, atol=1e-6)


def test_join_with_a_rank_out_of_data_inside_the_trace_window_writes_the_trace(cluster, tmp_path):
    """Rank r has 3 + r batches; the window (iterations 1-3) ends after rank 0 joined: its shadow passes
    count as iterations, so it takes part in the window's gather and the merged trace holds every rank."""
    from poseidon_torch.trace import load_spans

    env = {"POSEIDON_TRACE_DIR": str(tmp_path), "POSEIDON_TRACE_SKIP": "1", "POSEIDON_TRACE_ITERS": "3"}
    ours = cluster.run(patterns.uneven_inputs_join, "poseidon", "PS", timeout=60, env=env)
    theirs = cluster.run(patterns.uneven_inputs_join, "ddp", "PS", timeout=60)
    for rank in range(cluster.world_size):
        for name, value in theirs[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][name], value, rtol=1e-5, atol=1e-6)
    spans = load_spans(tmp_path / "trace_merged.json")
    assert sorted(spans) == list(range(cluster.world_size))
    for rank_spans in spans.values():
        assert sorted(s.iteration for s in rank_spans if s.kind == "iteration") == [1, 2, 3]


def test_deepcopy_and_pickle(cluster):
    results = cluster.run(patterns.deepcopy_and_pickle, timeout=60)
    assert_exact(results, tol=5e-6)
    assert all(r["copies_agree"] for r in results)


@pytest.mark.parametrize("through_wrapper", [False, True])
def test_close_releases_hooks(cluster, through_wrapper):
    results = cluster.run(patterns.close_releases_hooks, through_wrapper, timeout=60)
    for r in results:
        assert r["diff_from_local"] == 0.0 and not r["engine"]
    assert len({r["weight_sum"] for r in results}) == cluster.world_size  # nobody took rank 0's weights


@pytest.mark.slow
def test_torch_ddp_arguments_are_taken(cluster):
    """Code that builds torch DDP (positionally or by keyword) builds PoseidonDDP by changing the class."""
    results = cluster.run(patterns.ddp_arguments, True, timeout=90)
    for name in results[0]["expected_notes"]:  # the flags PoseidonDDP needs not: a note each, rank 0 only
        assert any(name in note for note in results[0]["notes"]), (name, results[0]["notes"])
    assert all(r["notes"] == [] for r in results[1:])
    for r in results:
        assert "device_ids" in r["refused"]["device_ids"] and r["module_device"] in r["refused"]["device_ids"]
        assert "output_device" in r["refused"]["output_device"]
        assert "mixed_precision" in r["refused"]["mixed_precision"]
        assert "delay_all_reduce_named_params" in r["refused"]["delay_all_reduce_named_params"]
        assert "bucket_cap_mb" in r["refused"]["bucket_cap_mb"]  # given with fusion_bytes: which one?
        assert r["fusion_bytes"] == int(0.0001 * 1024 * 1024) and r["buckets"] >= 2  # 4 MiB would fuse them all
        assert_exact([r])
        assert r["local_after_flag"] <= TOL, "require_backward_grad_sync=False must keep gradients local"
        assert r["init_sync_false_weight_sum"] != 0.0
    notes = cluster.run(patterns.ddp_arguments, timeout=90)[0]["notes"]  # said once per process, on rank 0
    assert notes == [], notes
    sums = {r["init_sync_false_weight_sum"] for r in cluster.run(patterns.ddp_arguments, timeout=90)}
    assert len(sums) == cluster.world_size  # init_sync=False: nobody took rank 0's weights


@pytest.mark.parametrize("env", CORES)
def test_a_gradient_that_arrives_late_is_averaged_whole(cluster, env):
    """A layer used inside a reentrant checkpoint and outside it: its bucket is synced, then more
    gradient arrives. The late part was dropped (the first average overwrote .grad before the re-sync)."""
    results = cluster.run(patterns.late_gradient, timeout=60, env=env)
    assert all(r["late"] for r in results)  # the case under test really happened
    assert_exact(results)


@pytest.mark.parametrize("env", CORES)
def test_a_parameter_used_only_in_an_early_no_sync_step_gets_no_gradient_later(cluster, env):
    assert_exact(cluster.run(patterns.used_only_under_no_sync, timeout=60, env=env))


def test_join_without_dividing_by_the_initial_world_size_is_refused(cluster):
    for message in cluster.run(patterns.join_without_initial_world_size, timeout=60):
        assert "divide_by_initial_world_size=True" in message, message
