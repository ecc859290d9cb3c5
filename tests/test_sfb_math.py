"""SFB rebuilds exactly the rank-averaged gradient autograd computes; capture holds nothing after clear()."""
from __future__ import annotations

import copy
import queue
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from poseidon_torch.coordinator import probe_gemm_flops, probe_link
from poseidon_torch.sfb import (
    FactorCapture,
    fc_spec,
    gather_factors,
    rebuild_gradients,
    register_fc,
    sfb_bytes_per_rank,
)

RTOL, ATOL = 1e-5, 1e-6


class TransposedFC(nn.Module):
    """y = x @ W + b with W stored as (N x M)."""

    def __init__(self, n: int, m: int, bias: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, m))
        self.b = nn.Parameter(torch.randn(m)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        return y if self.b is None else y + self.b


register_fc(TransposedFC, weight="w", bias="b", transposed=True)


class UnprovenLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def make_fc(m: int, n: int, bias: bool, transposed: bool) -> nn.Module:
    return TransposedFC(n, m, bias) if transposed else nn.Linear(n, m, bias=bias)


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    spec = fc_spec(module)
    bias = getattr(module, spec.bias) if spec.bias else None
    return getattr(module, spec.weight), bias


def run_rank(module: nn.Module, batches: list[torch.Tensor], seed: int) -> FactorCapture:
    """One rank's iteration: every batch is one call of ``module``; a nonlinear loss over all calls."""
    generator = torch.Generator().manual_seed(seed)
    capture = FactorCapture(module, fc_spec(module))
    loss = sum((torch.tanh(module(x)) * torch.randn(x.shape[:-1] + (1,), generator=generator)).sum()
               for x in batches)
    loss.backward()
    return capture


def check_rebuild(base: nn.Module, rank_batches: list[list[torch.Tensor]]) -> None:
    """Simulate len(rank_batches) ranks: rebuilt factors == mean of the ranks' autograd gradients."""
    world_size = len(rank_batches)
    spec = fc_spec(base)
    factors, weight_grads, bias_grads = [], [], []
    for rank, batches in enumerate(rank_batches):
        replica = copy.deepcopy(base)
        capture = run_rank(replica, batches, seed=rank)
        assert capture.num_samples == sum(x.numel() // x.shape[-1] for x in batches)
        factors.append(capture.local_factors())
        weight, bias = weight_and_bias(replica)
        weight_grads.append(weight.grad)
        bias_grads.append(None if bias is None else bias.grad)
    u_all = torch.cat([u for u, _ in factors])
    v_all = torch.cat([v for _, v in factors])
    grad_w, grad_b = rebuild_gradients(u_all, v_all, world_size, spec)
    torch.testing.assert_close(grad_w, torch.stack(weight_grads).mean(0), rtol=RTOL, atol=ATOL)
    if spec.bias is None:
        assert grad_b is None
    else:
        torch.testing.assert_close(grad_b, torch.stack(bias_grads).mean(0), rtol=RTOL, atol=ATOL)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 9),
    n=st.integers(1, 9),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    positions=st.sampled_from([None, 1, 3]),
    uses=st.integers(1, 2),
    bias=st.booleans(),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rebuild_matches_averaged_autograd(m, n, ks, positions, uses, bias, transposed, seed):
    torch.manual_seed(seed)
    base = make_fc(m, n, bias, transposed)
    leading = (lambda k: (k,)) if positions is None else (lambda k: (k, positions))
    rank_batches = [[torch.randn(leading(k) + (n,)) for _ in range(uses)] for k in ks]
    check_rebuild(base, rank_batches)


def test_chained_use_and_inplace_relu_after_the_layer():
    """A square layer applied twice in a row, followed by an in-place ReLU (VGG's classifier pattern)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 5)
    captures, grads = [], []
    for rank in range(3):
        replica = copy.deepcopy(layer)
        capture = FactorCapture(replica, fc_spec(replica))
        y = nn.ReLU(inplace=True)(replica(torch.relu(replica(torch.randn(4, 5)))))
        (y * torch.randn(4, 5)).sum().backward()
        captures.append(capture.local_factors())
        grads.append(replica.weight.grad)
    grad_w, _ = rebuild_gradients(torch.cat([u for u, _ in captures]), torch.cat([v for _, v in captures]),
                                  3, fc_spec(layer))
    torch.testing.assert_close(grad_w, torch.stack(grads).mean(0), rtol=RTOL, atol=ATOL)


def test_registry_is_exact_type():
    assert fc_spec(nn.Linear(2, 3)) is not None
    assert fc_spec(UnprovenLinear(2, 3)) is None
    assert fc_spec(nn.Conv2d(1, 1, 1)) is None
    spec = fc_spec(TransposedFC(n=2, m=3, bias=True))
    assert (spec.weight, spec.bias, spec.transposed) == ("w", "b", True)
    assert (spec.out_features(TransposedFC(2, 3, True)), spec.in_features(TransposedFC(2, 3, True))) == (3, 2)
    with pytest.raises(TypeError):
        register_fc(object)


def test_missing_bias_instance_has_no_bias_in_spec():
    assert fc_spec(nn.Linear(2, 3, bias=False)).bias is None
    assert fc_spec(TransposedFC(2, 3, bias=False)).bias is None
    assert fc_spec(nn.Linear(2, 3)).bias == "bias"


def test_clear_releases_every_tensor():
    layer = nn.Linear(4, 3)
    capture = FactorCapture(layer, fc_spec(layer))
    x = torch.randn(5, 4)
    layer(x).pow(2).sum().backward()
    u, v = capture.local_factors()
    input_ref, grad_ref = StorageWeakRef(x.untyped_storage()), StorageWeakRef(u.untyped_storage())
    del x, u, v
    assert not input_ref.expired() and not grad_ref.expired()
    capture.clear()
    assert input_ref.expired() and grad_ref.expired()
    assert capture.num_samples == 0
    assert [f.shape for f in capture.local_factors()] == [(0, 3), (0, 4)]


def test_no_capture_without_grad_or_with_frozen_weight_and_after_remove():
    layer = nn.Linear(4, 3)
    capture = FactorCapture(layer, fc_spec(layer))
    with torch.no_grad():
        layer(torch.randn(2, 4))
    layer.requires_grad_(False)
    layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert capture.num_samples == 0
    layer.requires_grad_(True)
    capture.remove()
    layer(torch.randn(2, 4)).sum().backward()
    assert capture.num_samples == 0


def test_calls_outside_the_loss_contribute_nothing():
    """A call whose output got no gradient (not in the loss) adds no factors; the others stay exact."""
    layer = nn.Linear(4, 3)
    capture = FactorCapture(layer, fc_spec(layer))
    layer(torch.randn(2, 4))  # e.g. a logging forward, never backpropagated
    x = torch.randn(5, 4)
    layer(x).square().sum().backward()
    u, v = capture.local_factors()
    assert u.shape == (5, 3) and torch.equal(v, x)
    grad_w, _ = rebuild_gradients(u, v, 1, fc_spec(layer))
    torch.testing.assert_close(grad_w, layer.weight.grad, rtol=RTOL, atol=ATOL)


# --- two ranks over gloo -------------------------------------------------------------------------

RANK_SAMPLES = (3, 5)  # different K per rank: exercises the padding
M, N = 6, 4


def _two_rank_worker(rank: int, port: int, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=len(RANK_SAMPLES))
        torch.manual_seed(0)
        layer = nn.Linear(N, M)  # identical on both ranks
        capture = run_rank(layer, [torch.randn(RANK_SAMPLES[rank], N) + rank], seed=rank)
        u_all, v_all, sent = gather_factors(*capture.local_factors(), list(RANK_SAMPLES))
        grad_w, grad_b = rebuild_gradients(u_all, v_all, dist.get_world_size(), fc_spec(layer))
        for rebuilt, local in ((grad_w, layer.weight.grad), (grad_b, layer.bias.grad)):
            dist.all_reduce(local)
            torch.testing.assert_close(rebuilt, local / dist.get_world_size(), rtol=RTOL, atol=ATOL)
        assert u_all.shape == (sum(RANK_SAMPLES), M) and v_all.shape == (sum(RANK_SAMPLES), N)
        assert sent == sfb_bytes_per_rank(max(RANK_SAMPLES), M, N, 2) == 5 * (M + N) * 4
        link = probe_link(sizes=(1 << 10, 1 << 14), repeats=1)
        assert link.alpha_s >= 0 and link.beta_s_per_byte >= 0
        results.put((rank, None, (link, probe_gemm_flops())))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc(), None))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_rank_gloo_gather_rebuild_and_agreed_probes():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_two_rank_worker, args=(rank, port, results))
               for rank in range(len(RANK_SAMPLES))]
    for worker in workers:
        worker.start()
    try:
        reports = [results.get(timeout=120) for _ in workers]
    except queue.Empty:
        pytest.fail("two-rank gloo test timed out")
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    failures = [f"rank {rank}:\n{error}" for rank, error, _ in reports if error]
    assert not failures, "\n".join(failures)
    models = {model for _, _, model in reports}
    assert len(models) == 1, f"ranks measured different link / GEMM models: {models}"
