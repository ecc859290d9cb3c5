"""SFB on its own: committed calls skip the local dW, their factors rebuild exactly the rank-averaged
gradient autograd computes, uses live as long as their graph, and the wire format round-trips."""
from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import workers
from poseidon_torch.fc import (
    CREATE_GRAPH,
    FCLayer,
    EngineHook,
    fc_spec,
    inert_hook,
    rebuild_gradients,
    register_fc,
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
    return getattr(module, spec.weight), (getattr(module, spec.bias) if spec.bias else None)


def committed(module: nn.Module, commit: bool = True) -> FCLayer:
    """The module's FCLayer as inside a synced forward, committed to SFB for this round."""
    layer = FCLayer("fc", module, fc_spec(module), in_forward=lambda: True, in_synced_forward=lambda: True)
    layer.begin_round(commit)
    return layer


def backward(loss: torch.Tensor) -> int:
    """Run ``loss.backward()``; the pass's graph task id."""
    task = []
    loss.register_hook(lambda grad: task.append(torch._C._current_graph_task_id()))
    loss.backward()
    return task[0]


def rank_loss(module: nn.Module, batches: list[torch.Tensor], seed: int) -> torch.Tensor:
    """One rank's loss: every batch is one call of ``module``; a nonlinear loss over all calls."""
    generator = torch.Generator().manual_seed(seed)
    return sum((torch.tanh(module(x)) * torch.randn(x.shape[:-1] + (1,), generator=generator)).sum()
               for x in batches)


def check_rebuild(base: nn.Module, rank_batches: list[list[torch.Tensor]]) -> None:
    """Simulate len(rank_batches) ranks: the factors of committed replicas rebuild the mean of plain
    replicas' autograd gradients, and the committed replicas' autograd computed no weight gradient."""
    world_size = len(rank_batches)
    factors, weight_grads, bias_grads = [], [], []
    for rank, batches in enumerate(rank_batches):
        plain = copy.deepcopy(base)
        rank_loss(plain, batches, seed=rank).backward()
        weight, bias = weight_and_bias(plain)
        weight_grads.append(weight.grad if weight.grad is not None else torch.zeros_like(weight))
        bias_grads.append(None if bias is None else (bias.grad if bias.grad is not None else torch.zeros_like(bias)))
        replica = copy.deepcopy(base)
        layer = committed(replica)
        loss = rank_loss(replica, batches, seed=rank)
        if not loss.requires_grad:  # no rows anywhere
            factors.append(layer.local_factors(-1))
            continue
        task = backward(loss)
        assert layer.k_round == sum(x.numel() // x.shape[-1] for x in batches)
        factors.append(layer.local_factors(task))
        assert all(p.grad is None for p in layer.params), "autograd computed the local gradient"
    u_all = torch.cat([u for u, _ in factors])
    v_all = torch.cat([v for _, v in factors])
    grad_w, grad_b = rebuild_gradients(u_all, v_all, world_size, fc_spec(base))
    torch.testing.assert_close(grad_w, torch.stack(weight_grads).mean(0), rtol=RTOL, atol=ATOL)
    if bias_grads[0] is not None:
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
    base = nn.Linear(5, 5)
    factors, grads = [], []
    for rank in range(3):
        x, weights = torch.randn(4, 5), torch.randn(4, 5)
        plain = copy.deepcopy(base)
        (nn.ReLU(inplace=True)(plain(torch.relu(plain(x)))) * weights).sum().backward()
        grads.append(plain.weight.grad)
        replica = copy.deepcopy(base)
        layer = committed(replica)
        loss = (nn.ReLU(inplace=True)(replica(torch.relu(replica(x)))) * weights).sum()
        task = backward(loss)  # the factors live with the graph: read them while ``loss`` holds it
        factors.append(layer.local_factors(task))
    grad_w, _ = rebuild_gradients(torch.cat([u for u, _ in factors]), torch.cat([v for _, v in factors]),
                                  3, fc_spec(base))
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


def test_uses_live_until_consumed_and_no_longer_than_their_graph():
    """The factors of a call stay reachable while its graph may be backpropagated again (retain_graph)
    and, once a backward reached them, until that backward's sync job consumed them (in parameter-server
    mode the job may run after the graph is gone); then nothing of them stays. A use no job consumes
    (reached by autograd.grad) goes two rounds later."""
    module = nn.Linear(4, 3)
    layer = committed(module)
    x = torch.randn(5, 4)
    out = module(x)
    loss = out.pow(2).sum()
    first = backward_retain(loss)
    second = backward_retain(loss)
    assert layer.local_factors(first)[0].shape == (0, 3), "U is recorded per pass; the first pass's is overwritten"
    refs = [weakref.ref(use) for use in layer.recorded]
    del out, loss
    gc.collect()
    u, v = layer.local_factors(second)
    assert u.shape == (5, 3) and torch.equal(v, x), "the graph is gone, the factors are not"
    layer.consume(second)
    del u, v
    gc.collect()
    assert refs and all(ref() is None for ref in refs) and not layer.recorded
    x = x.clone().requires_grad_()
    torch.autograd.grad(module(x).sum(), x)
    assert len(layer.recorded) == 1
    layer.begin_round(commit=True)
    layer.begin_round(commit=True)
    assert not layer.recorded


def backward_retain(loss: torch.Tensor) -> int:
    task = []
    loss.register_hook(lambda grad: task.append(torch._C._current_graph_task_id()))
    loss.backward(retain_graph=True)
    return task[0]


def test_no_capture_without_grad_outside_synced_forwards_or_with_frozen_weight():
    module = nn.Linear(4, 3)
    outside = FCLayer("fc", module, fc_spec(module), in_forward=lambda: False, in_synced_forward=lambda: False)
    outside.begin_round(True)
    module(torch.randn(2, 4)).sum().backward()
    assert outside.k_round == 0 and outside.witness is None and module.weight.grad is not None
    outside.remove()
    layer = committed(module)
    with torch.no_grad():
        module(torch.randn(2, 4))
    module.requires_grad_(False)
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert layer.k_round == 0 and layer.witness is None


def test_calls_outside_the_loss_contribute_nothing():
    """A call whose output got no gradient (not in the loss) adds no factors; the others stay exact."""
    module = nn.Linear(4, 3)
    plain = copy.deepcopy(module)
    layer = committed(module)
    module(torch.randn(2, 4))  # e.g. a logging forward, never backpropagated
    x = torch.randn(5, 4)
    loss = module(x).square().sum()
    task = backward(loss)
    u, v = layer.local_factors(task)
    assert u.shape == (5, 3) and torch.equal(v, x)
    plain(x).square().sum().backward()
    grad_w, _ = rebuild_gradients(u, v, 1, fc_spec(module))
    torch.testing.assert_close(grad_w, plain.weight.grad, rtol=RTOL, atol=ATOL)


def test_create_graph_through_a_committed_call_raises_and_marks_the_layer():
    module = nn.Linear(4, 3)
    layer = committed(module)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True.*'fc'"):
        torch.autograd.grad(module(x).sum(), x, create_graph=True)
    assert layer.sticky & CREATE_GRAPH
    other = nn.Linear(4, 3)
    watched = committed(other, commit=False)
    torch.autograd.grad(other(x).sum(), x, create_graph=True)  # not detached: exact, but never commit
    assert watched.sticky & CREATE_GRAPH


def test_copies_of_the_module_get_inert_hooks():
    module = nn.Linear(4, 3)
    layer = committed(module)
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        hooks = list(copied._forward_pre_hooks.values()) + list(copied._forward_hooks.values())
        assert hooks and all(hook is inert_hook for hook in hooks)
        copied(torch.randn(2, 4)).sum().backward()  # a plain module: its own dW
        assert copied.weight.grad is not None
    assert isinstance(module._forward_pre_hooks[next(iter(module._forward_pre_hooks))], EngineHook)
    layer.remove()
    assert not module._forward_pre_hooks and not module._forward_hooks


# --- the wire format, over two gloo ranks ---------------------------------------------------------------

def test_factor_exchange_pads_strips_and_reports_headers(cluster):
    for r in cluster.run(workers.exchange_factors_roundtrip):
        assert r["headers"] == r["expected_headers"]
        assert torch.equal(r["u"], r["expected_u"]) and torch.equal(r["v"], r["expected_v"])
        assert r["bytes"] == (cluster.world_size - 1) * r["block_bytes"]
