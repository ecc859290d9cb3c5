"""The toy path, ``paths/allreduce.py`` (torch DDP's own arithmetic: the bucket all-reduced, then divided by
P), added as one module and one line of registration. Forced on every layer through ``overrides``, it
gives the parameters of single-process training and of torch DDP, composes with the parameter-server
update like any path, and is what ran (every bucket's outcome, the bytes counted under its name)."""
from __future__ import annotations

import torch

import training
from models import ModelSpec
from test_parity import ATOL, RTOL, STEPS, assert_parity
from training import Run

EVERY_LAYER = {"force_all": "AR"}  # every layer a bucket of its own, on the all-reduce path


def assert_all_reduce_ran(result: dict) -> None:
    """Every bucket on the all-reduce path from the second step on (the first runs on the default path,
    as every first pass), and the bytes of those steps counted under its name."""
    for step, (outcomes, sent) in enumerate(zip(result["paths"], result["sent"])):
        assert set(outcomes.values()) == ({"PS"} if step == 0 else {"AR"}), (step, outcomes)
        if step:
            assert sent["AR"] > 0 and sent["PS"] == 0, (step, sent)


def test_the_all_reduce_path_matches_single_process_training_and_ddp(cluster):
    spec = ModelSpec(conv_channels=(3,), widths=(8, 6), image=5)
    results = cluster.run(training.train_pair, spec, Run(options=EVERY_LAYER), STEPS, 3)
    assert_parity(results, spec, 3, cluster.world_size)
    for result in results:
        assert_all_reduce_ran(result["poseidon"])


def test_the_all_reduce_path_composes_with_the_parameter_server_update(cluster):
    """A ServerOptimizer on it: every rank has the average, the owners step their chunks, the values are
    pulled (``paths/update.py``): DDP + the same optimizer's parameters, on every rank."""
    spec = ModelSpec(widths=(8, 6))
    run = Run(wrapper="server", optimizer="adamw", options=EVERY_LAYER)
    results = cluster.run(training.against, spec, run, ("ddp",), STEPS, 3)
    for rank, result in enumerate(results):
        for name, value in result["ddp"]["state"].items():
            torch.testing.assert_close(result["server"]["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name} vs torch DDP: {m}")
        assert_all_reduce_ran(result["server"])
