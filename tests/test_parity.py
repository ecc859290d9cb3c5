"""Gradient parity: PoseidonDDP gives the parameters of single-process training on the concatenated
batch, and the parameters and buffers of torch DDP, to fp32 rounding (rtol 1e-5)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import training
import workers
from models import ModelSpec, model_specs
from training import Run

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3


def assert_parity(results: list[dict], spec: ModelSpec, size: int, world_size: int, accumulate: int = 1):
    reference = training.bsp(spec, STEPS, size, world_size, accumulate=accumulate)["params"]
    rank0 = results[0]["poseidon"]["state"]
    for name, value in reference.items():
        torch.testing.assert_close(rank0[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} vs single process: {m}")
    for rank, result in enumerate(results):
        ours, theirs = result["poseidon"]["state"], result["ddp"]["state"]
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name} vs torch DDP: {m}")
        for name in reference:  # the ranks hold bit-identical parameters
            assert torch.equal(ours[name], rank0[name]), f"rank {rank} diverged from rank 0 on {name}"


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=model_specs(), size=st.integers(1, 5), chunk_elems=st.sampled_from([3, 64, 1 << 19]))
def test_generated_models_match_single_process_and_ddp(cluster, spec, size, chunk_elems):
    options = {"chunk_bytes": 4 * chunk_elems, "fusion_bytes": 512}
    results = cluster.run(training.train_pair, spec, Run(options=options), STEPS, size)
    assert_parity(results, spec, size, cluster.world_size)


CASES = {
    "shared_weights": ModelSpec(widths=(8,), tied=True),
    "frozen_layer": ModelSpec(widths=(8, 8), frozen_first=True),
    "unused_branch": ModelSpec(widths=(8,), unused_branch=True),
    "branch_used_on_rank0_only": ModelSpec(widths=(8,), rank0_branch=True),
    "cnn_batchnorm": ModelSpec(conv_channels=(4, 6), batchnorm=True, widths=(8,), image=5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_special_models_match(cluster, case):
    spec = CASES[case]
    results = cluster.run(training.train_pair, spec, Run(), STEPS, 3)
    assert_parity(results, spec, 3, cluster.world_size)


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_a_world_of_one_matches_single_process(cluster, force):
    """Every rank in a gloo group of its own: nothing to exchange, the same script as on P ranks runs
    (forcing SFB too: the override is accepted and syncs nothing)."""
    spec = ModelSpec(widths=(16, 8))
    results = cluster.run(workers.train_pair_group, spec, STEPS, 2, "gloo", force, False, True, "cpu")
    assert_parity(results, spec, 2, 1)


def test_unused_parameters_keep_no_grad_like_ddp(cluster):
    """A layer no rank uses gets no gradient at all, so weight decay and momentum leave it alone."""
    spec = CASES["unused_branch"]
    results = cluster.run(training.train_pair, spec, Run(), STEPS, 2)
    initial = workers.build(spec, seed=spec.seed).state_dict()["unused.weight"]
    assert torch.equal(results[0]["poseidon"]["state"]["unused.weight"], initial)


def test_no_sync_accumulation(cluster):
    spec = ModelSpec(widths=(8, 5))
    results = cluster.run(training.train_pair, spec, Run(accumulate=2), STEPS, 2)
    assert_parity(results, spec, 2, cluster.world_size, accumulate=2)


def test_rank_dependent_init_follows_rank0(cluster):
    spec = ModelSpec(conv_channels=(3,), batchnorm=True, widths=(6,), image=4)
    results = cluster.run(training.train_pair, spec, Run(rank_init=True), STEPS, 2)
    assert_parity(results, spec, 2, cluster.world_size)


def test_state_dict_behaves_as_ddp(cluster):
    for r in cluster.run(workers.state_dict_roundtrip):
        assert r["ours"] == r["ddp"]
        assert r["restored"] and r["module_is_model"]


def test_averages_do_not_depend_on_which_shard_owns_an_element(cluster):
    """Owners sum every rank's part in rank order, so the chunk plan (and buckets learned from
    timings) cannot change a single bit."""
    spec = ModelSpec(widths=(40, 24))
    for states in cluster.run(workers.train_chunkings, spec, (64, 4096, 2 * 1024 * 1024)):
        for name, value in states[0].items():
            assert all(torch.equal(other[name], value) for other in states[1:]), name
