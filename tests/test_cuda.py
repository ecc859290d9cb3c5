"""CUDA twins of the CPU parity tests: gloo through pinned host buffers, and NCCL. Skipped without
GPUs; the CPU paths they mirror are tested in test_parity.py and test_sfb_parity.py."""
from __future__ import annotations

import pytest
import torch

import workers
from models import ModelSpec
from test_parity import assert_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_cuda_tensors_over_gloo_staged_match(cluster, force):
    spec = ModelSpec(conv_channels=(4,), batchnorm=True, widths=(16,), image=5)
    results = cluster.run(workers.train_pair_cuda, spec, 3, 2, "gloo", force)
    assert_parity(results, spec, 2, cluster.world_size)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs one GPU per rank")
def test_cuda_tensors_over_nccl_match(cluster):
    spec = ModelSpec(widths=(16, 8))
    results = cluster.run(workers.train_pair_cuda, spec, 3, 2, "nccl", "SFB")
    assert_parity(results, spec, 2, cluster.world_size)
