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
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "gloo", force)
    assert_parity(results, spec, 2, cluster.world_size)


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_gradients_written_late_on_the_gpu_are_the_ones_synced(cluster, force):
    """The GPU writes every layer's gradient ~10 ms after its hook fired on the CPU: a staging copy not
    ordered after those kernels (the ready event) would sync the previous values."""
    spec = ModelSpec(conv_channels=(4,), widths=(16, 8), image=5)
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "gloo", force, True)
    assert_parity(results, spec, 2, cluster.world_size)
    for result in results:
        fc = [path for name, path in result["paths"].items() if not name.startswith("features")]
        assert fc and all(path == force for path in fc), result["paths"]


def test_late_written_gradients_break_parity_when_the_copies_ignore_the_ready_event(cluster):
    """The negative control of the test above: waiting on a fresh event instead of the ready event, the
    staging copies read ``.grad`` before the GPU wrote it, and parity must fail (ran on an H100: it did)."""
    spec = ModelSpec(conv_channels=(4,), widths=(16, 8), image=5)
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "gloo", "PS", True, False, "cuda", True)
    with pytest.raises(AssertionError):
        assert_parity(results, spec, 2, cluster.world_size)


def test_averages_uploaded_late_are_the_ones_written_back(cluster):
    """The averages go back to the GPU on the job's side stream; here every upload starts ~10 ms late
    there: ``.grad`` written back at the end of backward must still get them (the training stream waits
    for the job's event, recorded after the upload), not the device copy's previous contents."""
    spec = ModelSpec(conv_channels=(4,), widths=(16, 8), image=5)
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "gloo", "PS", False, False, "cuda", False, "ordered")
    assert_parity(results, spec, 2, cluster.world_size)
    assert all(result["uploads"] > 0 for result in results), [result["uploads"] for result in results]


def test_averages_uploaded_late_break_parity_when_the_upload_is_not_ordered(cluster):
    """The negative control of the test above: the late upload on a stream of its own, and the event
    the readers wait on recorded where it covers nothing of the copy, so the end of backward copies the
    device copy before the averages reach it, and parity must fail."""
    spec = ModelSpec(conv_channels=(4,), widths=(16, 8), image=5)
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "gloo", "PS", False, False, "cuda", False,
                          "unordered")
    assert all(result["uploads"] > 0 for result in results), [result["uploads"] for result in results]
    with pytest.raises(AssertionError):
        assert_parity(results, spec, 2, cluster.world_size)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs one GPU per rank")
def test_cuda_tensors_over_nccl_match(cluster):
    spec = ModelSpec(widths=(16, 8))
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "nccl", "SFB")
    assert_parity(results, spec, 2, cluster.world_size)


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_nccl_in_a_world_of_one_matches(cluster, force):
    """NCCL needs a GPU per rank, so on one GPU it runs only in worlds of one: each rank trains alone
    (its CPU twin: test_parity.py::test_a_world_of_one_matches_single_process)."""
    spec = ModelSpec(widths=(16, 8))
    results = cluster.run(workers.train_pair_group, spec, 3, 2, "nccl", force, False, True)
    assert_parity(results, spec, 2, 1)

