"""Bad input and failures end the step with a clear error that names the cause; nothing hangs."""
from __future__ import annotations

import pytest
import torch

import workers
from poseidon_torch import PoseidonDDP


def test_mismatched_models_raise_on_every_rank(cluster):
    messages = cluster.run(workers.mismatched_models)
    for message in messages:
        assert "ranks 0 and 1 disagree" in message
        assert "body.0.weight" in message and "(8, 6)" in message and "(9, 6)" in message


@pytest.mark.slow
@pytest.mark.parametrize("env", [pytest.param({"POSEIDON_ENGINE": "python"}, id="python-core"),
                                 pytest.param({}, id="default-core")])
@pytest.mark.parametrize("path", ["PS", "SFB"])
def test_exception_in_sync_job_reaches_training_thread(fresh_cluster, path, env):
    results = fresh_cluster.run(workers.failing_sync_job, "body.2", path, timeout=60, env=env)
    failed, peer = results
    assert failed["error_type"] == "SyncError"
    assert "body.2" in failed["error"] and "injected failure" in failed["error"]
    assert peer["error_type"] in ("SyncError", "SyncTimeout")
    assert peer["elapsed"] < workers.FAILING_JOB_TIMEOUT_S + 10, "the peer must fail within its timeout"
    assert "cannot continue after a failed sync" in failed["next_forward"]


@pytest.mark.slow
def test_dead_peer_ends_the_step_within_timeout(fresh_cluster):
    outcomes = fresh_cluster.run_outcomes(workers.peer_exits_mid_step, timeout=60)
    assert 1 not in outcomes and fresh_cluster.exit_code(1) == 3
    survivor = outcomes[0]
    assert survivor.ok, survivor.value
    assert survivor.value["error_type"] in ("SyncError", "SyncTimeout")
    assert survivor.value["elapsed"] < 10 + 5
    if survivor.value["error_type"] == "SyncError":  # the connection broke: the error names the peer
        assert "rank 1" in survivor.value["error"], survivor.value["error"]


def test_requires_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        PoseidonDDP(torch.nn.Linear(2, 2))


def test_without_a_process_group_the_error_says_to_launch_with_torchrun():
    with pytest.raises(RuntimeError, match="torchrun") as raised:
        PoseidonDDP(torch.nn.Linear(2, 2))
    assert "init_process_group" in str(raised.value)


@pytest.mark.parametrize("kind, advice", [("meta", "to_empty"), ("lazy", "forward on a sample batch")])
def test_an_unmaterialised_model_is_refused_before_any_collective(cluster, kind, advice):
    results = cluster.run(workers.unmaterialised_model, kind)
    for result in results:
        assert "'0.weight'" in result["error"] and advice in result["error"], result["error"]
        assert result["elapsed"] < 5
        assert result["sum_of_ranks"] == sum(range(len(results)))


def test_a_sparse_embedding_is_refused_by_name_unless_parameters_are_averaged(cluster):
    """nn.Embedding(sparse=True) failed inside the first backward ("reshape is not implemented for sparse
    tensors"); it is refused at construction, naming the module and the ways out. Under sync_every the
    gradients stay local, so it trains."""
    for result in cluster.run(workers.sparse_embedding, {}):
        assert result["error"] is not None and "'0' (Embedding(sparse=True))" in result["error"], result
        assert "sparse=False" in result["error"] and "sync_every" in result["error"]
    assert all(result == {"error": None, "trained": True} for result in cluster.run(workers.sparse_embedding,
                                                                                  {"sync_every": 2}))
