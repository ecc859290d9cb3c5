"""Issue 19: Lightning and the HF Trainer on PoseidonDDP give the parameters of the framework's own DDP
path (bit-identical at P = 2, where the two averages are the same arithmetic; within rtol 1e-5 where
the server clips or sums in another order), default mode and ServerOptimizer, with clipping and
gradient accumulation."""
from __future__ import annotations

import pytest
import torch

import integration_workers

RTOL, ATOL = 1e-5, 1e-6

pytest.importorskip("lightning")
pytest.importorskip("transformers")


def assert_same(ours: dict, theirs: dict, exact: bool) -> None:
    for name, value in theirs.items():
        if exact:
            assert torch.equal(ours[name], value), f"{name}: max diff {(ours[name] - value).abs().max()}"
        else:
            torch.testing.assert_close(ours[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
def test_lightning_strategy_matches_lightning_ddp(cluster, tmp_path, server):
    kwargs = dict(clip=0.5, accumulate=2, root=str(tmp_path))
    theirs = cluster.run(integration_workers.lightning_fit, "ddp", False, *kwargs.values(), timeout=180)
    ours = cluster.run(integration_workers.lightning_fit, "poseidon", server, *kwargs.values(), timeout=180)
    for mine, ref in zip(ours, theirs):
        assert mine["unwrapped"]
        assert len(mine["losses"]) == len(ref["losses"]) == 10  # 5 steps of 2 micro-batches
        assert_same(mine["params"], ref["params"], exact=not server and cluster.world_size == 2)


def test_lightning_refuses_clipping_it_cannot_apply(cluster, tmp_path):
    for message in cluster.run(integration_workers.lightning_refuses_mismatched_clipping, str(tmp_path), timeout=120):
        assert "gradient_clip_val=1.0" in message and "max_grad_norm" in message, message


@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
def test_hf_trainer_matches_hf_ddp(cluster, tmp_path, server):
    theirs = cluster.run(integration_workers.hf_train, "ddp", False, str(tmp_path), timeout=180)
    ours = cluster.run(integration_workers.hf_train, "poseidon", server, str(tmp_path), timeout=180)
    for mine, ref in zip(ours, theirs):
        assert_same(mine["params"], ref["params"], exact=not server and cluster.world_size == 2)
        torch.testing.assert_close(torch.tensor(mine["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=0)


def test_hf_trainer_checkpoint_with_server_optimizer_resumes_exactly(cluster, tmp_path):
    """The Trainer's own checkpoint (optimizer.pt gathered from the shards on the main process) and its
    resume give the parameters of an uninterrupted run."""
    whole = cluster.run(integration_workers.hf_train, "poseidon", True, str(tmp_path / "whole"), timeout=180)
    cut = str(tmp_path / "cut")
    cluster.run(integration_workers.hf_train, "poseidon", True, cut, 4, 2, 2, timeout=180)
    resumed = cluster.run(integration_workers.hf_train, "poseidon", True, cut, 4, 2, 0, True, timeout=180)
    for mine, ref in zip(resumed, whole):
        assert_same(mine["params"], ref["params"], exact=False)
