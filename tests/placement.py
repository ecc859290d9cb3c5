"""Where a test rank keeps its models and batches: the CPU, or with ``POSEIDON_TEST_DEVICE=cuda`` a GPU
(rank r on GPU r mod count; several ranks may share one GPU over gloo).

Only the ranks move (:func:`place_rank`, called by ``cluster._serve``): the test process keeps its
single-process references on the CPU, and every tensor a rank returns comes back as a CPU tensor
(:func:`to_host`). On a GPU the kernels' TF32 modes are off, so fp32 results stay comparable with the
CPU references at the parity tests' tolerance.
"""
from __future__ import annotations

import os

import torch
from torch.utils._pytree import tree_map

DEVICE = torch.device("cpu")  #: where this process's test models and batches live


def place_rank(rank: int) -> None:
    """Put this rank's test models and batches where ``POSEIDON_TEST_DEVICE`` says (default: the CPU)."""
    global DEVICE
    wanted = os.environ.get("POSEIDON_TEST_DEVICE", "cpu")
    if wanted == "cpu":
        return
    if wanted != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"POSEIDON_TEST_DEVICE={wanted!r}: only 'cpu' and 'cuda' (with a GPU) are supported")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)


def on_device(*tensors: torch.Tensor):
    """``tensors`` moved to this process's test device (one tensor, or a tuple of them)."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def to_host(result):
    """``result`` with every tensor in it (dicts, lists, tuples) copied to the CPU."""
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, result)
