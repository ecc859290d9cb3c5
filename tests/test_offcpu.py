"""The emulated accelerator of the benchmarks (``bench/offcpu.py``): waits split by FLOPs, placed where the
module's compute would run, holding no CPU, changing no gradient."""
from __future__ import annotations

import copy
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poseidon_torch.bench.offcpu import BACKWARD_PER_FORWARD, install_waits, own_flops
from poseidon_torch.bench.workloads import build

BATCH = 4


class TwoLayersAndAHead(nn.Module):
    """Two Linear layers, then a matmul in the model's own forward (as a tied output projection is)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 32)
        self.head = nn.Parameter(torch.randn(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.second(torch.relu(self.first(x))), self.head)


def _matmul_flops(rows: int, inner: int, cols: int) -> int:
    return 2 * rows * inner * cols


def test_each_module_gets_its_own_flops_its_childrens_excluded():
    model = TwoLayersAndAHead()
    own, calls = own_flops(model, torch.randn(BATCH, 8))
    assert own[model.first] == _matmul_flops(BATCH, 8, 16)
    assert own[model.second] == _matmul_flops(BATCH, 16, 32)
    assert own[model] == _matmul_flops(BATCH, 32, 64)  # the head, not the layers' FLOPs again
    assert calls[model.first] == calls[model] == 1


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().sum().backward()


def test_one_iteration_waits_the_given_seconds_without_using_the_cpu_and_the_gradients_are_unchanged():
    torch.manual_seed(0)
    reference = TwoLayersAndAHead()
    model = copy.deepcopy(reference)
    x = torch.randn(BATCH, 8)
    waits = install_waits(model, x, seconds=0.6)
    assert set(waits) == {"", "first", "second"}
    assert sum(waits.values()) * (1 + BACKWARD_PER_FORWARD) == pytest.approx(0.6)
    wall, cpu = time.perf_counter(), time.process_time()
    _step(model, x)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.6 <= wall < 0.9
    assert cpu < 0.2 * wall
    _step(reference, x)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_a_layers_gradient_is_ready_after_its_own_backward_wait_and_those_of_the_layers_after_it():
    model = TwoLayersAndAHead()
    x = torch.randn(BATCH, 8)
    waits = install_waits(model, x, seconds=0.6)
    ready = {}

    def note_ready(name: str, _param: torch.Tensor) -> None:
        ready.setdefault(name, time.perf_counter())

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(partial(note_ready, name))
    loss = model(x).square().sum()
    start = time.perf_counter()
    loss.backward()
    backward = {name: waits[name] * BACKWARD_PER_FORWARD for name in waits}
    assert ready["second.weight"] - start >= backward[""] + backward["second"]
    assert ready["first.weight"] - start >= backward[""] + backward["second"] + backward["first"]


def test_an_off_cpu_workload_is_the_same_on_every_build_and_computes_one_sample():
    first, second = build("gpt2-offcpu", tiny=True), build("gpt2-offcpu", tiny=True)
    x, y = first.make_batch(1, 3)
    assert x.shape[0] == y.shape[0] == first.batch_size == 1
    assert torch.equal(x, second.make_batch(1, 3)[0])
    example = build("gpt2", tiny=True).make_batch(0, 0)[0]
    assert install_waits(build("gpt2", tiny=True).model, example, 1.0) == \
        install_waits(build("gpt2", tiny=True).model, example, 1.0)
    images, labels = build("resnet18-offcpu", tiny=True).make_batch(0, 0)
    assert images.shape == (1, 3, 32, 32) and labels.shape == (1,)
