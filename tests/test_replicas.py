"""Replica consistency, where the mutation sweep of issue 18 found no test: buffers under join() and
with broadcast_buffers=False against torch DDP, rank 0's whole state (every dtype, buffers) at
construction, and mismatches that must fail at construction on every rank."""
from __future__ import annotations

import pytest
import torch

import workers


@pytest.mark.parametrize("case", ["join", "no_broadcast"])
def test_buffers_behave_as_torch_ddp(cluster, case):
    for result in cluster.run(workers.buffers_against_ddp, case):
        for name, value in result["ddp"].items():
            torch.testing.assert_close(result["poseidon"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def test_construction_takes_rank0s_parameters_of_every_dtype_and_its_buffers(cluster):
    for result in cluster.run(workers.state_after_construction):
        assert all(diff == 0.0 for diff in result.values()), result


@pytest.mark.parametrize("case,needle", [("option", "options differ"), ("extra_parameter", "parameters, rank")])
def test_a_rank_that_differs_fails_construction_everywhere(cluster, case, needle):
    for message in cluster.run(workers.mismatched_construction, case):
        assert needle in message, message
