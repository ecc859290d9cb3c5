"""The lossy paths (``paths/powersgd.py``, ``paths/precision.py``) and ``PoseidonDDP(compression=...)``.

Each path is forced on every layer of a model whose gradients the test gives (``compression_workers``),
so the single-process references below replay the algorithm on the same per-rank inputs; every rank is
checked, and every test asserts the path ran (the buckets' outcomes). The first pass of an engine runs
on the default path (exact), so the lossy steps are the later ones.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

import compression_workers as cw
from models import ModelSpec, build
from poseidon_torch.bucket import Bucket, Layer, build_buckets, find_layers, flat_numel
from poseidon_torch.coordinator import Coordinator
from poseidon_torch.fc import FCLayer, fc_spec
from poseidon_torch.link import LinkModel
from poseidon_torch.paths import BucketCost, Paths, PathEnv, compression_option, default_name, path_class
from poseidon_torch.paths.powersgd import initial_q
from poseidon_torch.paths.ps import DEFAULT_CHUNK_BYTES, plan_chunks
from poseidon_torch.simulate import Job, LayerProfile, Profile, bsp

#: a linear layer, a conv layer (out 6, in 3 x 3 x 3: compressed as 6 x 27) and a layer of vectors
LAYERS: cw.Layers = (((12, 20), (12,)), ((6, 3, 3, 3), (6,)), ((5,),))
STEPS = 5


def compressed(shape: tuple[int, ...], rank: int, min_rate: float = 2.0) -> int:
    """torch's rule, as the docs state it: a matrix is compressed to r' = min(r, rows, cols) where
    r' (rows + cols) * min_rate < rows * cols; 1-D tensors never."""
    if len(shape) < 2:
        return 0
    rows, cols = shape[0], torch.Size(shape).numel() // shape[0]
    r = min(rank, rows, cols)
    return r if r * (rows + cols) * min_rate < rows * cols else 0


def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return sum(tensors) / len(tensors)


def powersgd_reference(layers: cw.Layers, world_size: int, steps: int, dtype: torch.dtype, rank: int,
                       low_rank: int = 0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """PowerSGD in one process on every rank's gradients (Vogels et al. 2019, one power iteration per
    step, error feedback, warm start), step 0 exact: per step the average every rank applies, and each
    rank's residuals at the end."""
    names = cw.names(layers)
    shapes = [shape for layer in layers for shape in layer]
    residual = [{name: torch.zeros(shape, dtype=dtype) for name, shape in zip(names, shapes)}
                for _ in range(world_size)]
    qs: dict[str, torch.Tensor] = {}
    applied = []
    for t in range(steps):
        per_rank = [cw.gradients(layers, w, t, dtype, low_rank) for w in range(world_size)]
        step = {}
        for i, (name, shape) in enumerate(zip(names, shapes)):
            r = compressed(shape, rank)
            if t == 0 or not r:
                step[name] = mean([g[i] for g in per_rank])
                continue
            rows = shape[0]
            ms = [(per_rank[w][i] + residual[w][name]).reshape(rows, -1) for w in range(world_size)]
            q = qs.get(name, initial_q(name, ms[0].shape[1], r, seed, dtype))
            basis = torch.linalg.qr(sum(m @ q for m in ms)).Q
            qs[name] = q = mean([m.T @ basis for m in ms])
            average = basis @ q.T
            for w in range(world_size):
                residual[w][name] = (ms[w] - average).reshape(shape)
            step[name] = average.reshape(shape)
        applied.append(step)
    return applied, residual


def assert_ran(results: list[dict], path: str, steps: int) -> None:
    """Every bucket on ``path`` from the second step on, on every rank."""
    for rank, result in enumerate(results):
        for step in range(1, steps):
            assert set(result["outcomes"][step].values()) == {path}, (rank, step, result["outcomes"][step])


def assert_same_on_every_rank(results: list[dict]) -> None:
    for step, grads in enumerate(results[0]["grads"]):
        for rank, other in enumerate(results[1:], 1):
            for name, grad in grads.items():
                assert torch.equal(other["grads"][step][name], grad), f"rank {rank} step {step} {name}"


# ---- PowerSGD against its single-process reference ------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_equals_the_single_process_algorithm(cluster, rank):
    P = cluster.world_size
    results = cluster.run(cw.given_run, LAYERS, "PowerSGD", STEPS, torch.float64, 0, {"rank": rank})
    assert_ran(results, "PowerSGD", STEPS)
    assert_same_on_every_rank(results)
    applied, residual = powersgd_reference(LAYERS, P, STEPS, torch.float64, rank)
    for w, result in enumerate(results):
        for step, expected in enumerate(applied):
            for name, value in expected.items():
                torch.testing.assert_close(result["grads"][step][name], value, rtol=1e-9, atol=1e-10,
                                           msg=lambda m: f"rank {w} step {step} {name}: {m}")
        kept = result["state"]["paths"]["PowerSGD"]["residual"]
        for name, value in residual[w].items():
            torch.testing.assert_close(kept.get(name, torch.zeros_like(value)), value, rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"rank {w} residual of {name}: {m}")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_a_gradient_of_rank_at_most_r_passes_powersgd_unchanged(cluster, dtype, tolerance):
    """The mean over the ranks of every matrix has rank 2 <= r: the applied average is that mean (to
    rounding: ``tolerance`` of the largest value, fp32 rounding grows with the conditioning of P), at every
    step, and the mean of the ranks' residuals is nothing."""
    P = cluster.world_size
    results = cluster.run(cw.given_run, LAYERS, "PowerSGD", STEPS, dtype, 2, {"rank": 2})
    assert_ran(results, "PowerSGD", STEPS)
    for w, result in enumerate(results):
        for step in range(STEPS):
            true = [mean(list(g)) for g in zip(*(cw.gradients(LAYERS, r, step, dtype, 2) for r in range(P)))]
            for name, value in zip(cw.names(LAYERS), true):
                error = (result["grads"][step][name] - value).abs().max()
                assert error <= tolerance * value.abs().max(), (w, step, name, float(error))
    kept = [result["state"]["paths"]["PowerSGD"]["residual"] for result in results]
    for name in kept[0]:  # each rank keeps its own M minus the mean; nothing of the mean is left
        left = mean([residuals[name] for residuals in kept]).abs().max()
        assert left <= tolerance * 10, (name, float(left))


# ---- error feedback loses nothing -----------------------------------------------------------------------

def assert_nothing_lost(results: list[dict], layers: cw.Layers, path: str, steps: int, dtype: torch.dtype,
                        rtol: float, atol: float) -> None:
    """Sum of the applied averages + mean over the ranks of the residuals == sum of the true averages."""
    P = len(results)
    for name_index, name in enumerate(cw.names(layers)):
        true = sum(mean([cw.gradients(layers, r, t, dtype)[name_index] for r in range(P)]) for t in range(steps))
        for w, result in enumerate(results):
            applied = sum(result["grads"][t][name] for t in range(steps))
            kept = [other["state"].get("paths", {}).get(path, {}).get("residual", {}).get(name) for other in results]
            left = mean([torch.zeros_like(true) if k is None else k.to(dtype) for k in kept])
            torch.testing.assert_close(applied + left, true, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{path} rank {w} {name}: {m}")


def settings_of(path: str) -> dict:
    """Compression from the second step on; PowerSGD at rank 2 (which compresses every matrix of LAYERS)."""
    return {"start_iter": 1, "rank": 2} if path == "PowerSGD" else {"start_iter": 1}


layer_shapes = st.lists(st.lists(st.sampled_from([(16, 24), (9, 40), (4, 2, 3, 3), (30,), (7, 5), (33, 17)]),
                                 min_size=1, max_size=2).map(tuple), min_size=1, max_size=3).map(tuple)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(layers=layer_shapes, path=st.sampled_from(["PowerSGD", "BF16", "FP16", "INT8"]))
def test_error_feedback_loses_nothing_on_generated_models_fp64(cluster, layers, path):
    results = cluster.run(cw.given_run, layers, path, STEPS, torch.float64, 0, settings_of(path))
    assert_ran(results, path, STEPS)
    assert_same_on_every_rank(results)
    assert_nothing_lost(results, layers, path, STEPS, torch.float64, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["PowerSGD", "BF16", "INT8"])
def test_error_feedback_loses_nothing(cluster, path):
    """fp64: exact but for fp64 rounding; fp32: to fp32 rounding."""
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        results = cluster.run(cw.given_run, LAYERS, path, STEPS, dtype, 0, settings_of(path))
        assert_ran(results, path, STEPS)
        assert all(result["state"]["paths"][path]["residual"] for result in results)
        assert_nothing_lost(results, LAYERS, path, STEPS, dtype, rtol=tolerance, atol=tolerance)


def path_steps(result: dict, path: str) -> list[int]:
    """The steps whose every bucket synced on ``path``."""
    return [step for step, outcomes in enumerate(result["outcomes"]) if set(outcomes.values()) == {path}]


@pytest.mark.parametrize("path", ["PowerSGD", "INT8"])
def test_a_layer_leaving_a_lossy_path_carries_its_residual_into_the_exact_sync(cluster, path):
    """Steps 1-3 on the lossy path, then every layer on the default (exact) path: the first exact step
    applies the average of gradient + residual (each rank's), to fp64 rounding, and nothing is left of
    the residuals, so the applied averages sum to the true ones."""
    P, steps, dtype = cluster.world_size, 7, torch.float64
    results = cluster.run(cw.given_run, LAYERS, path, steps, dtype, 0, settings_of(path), 0, 1.0, (3, default_name()))
    assert all(path_steps(r, path) == [1, 2, 3] for r in results), [r["outcomes"] for r in results]
    assert all(path_steps(r, default_name()) == [0, 4, 5, 6] for r in results)
    assert_same_on_every_rank(results)
    owed = [r["states"][3]["paths"][path]["residual"] for r in results]  # after the last lossy step
    assert any(t.abs().max() > 0 for residuals in owed for t in residuals.values())  # something was owed
    for name_index, name in enumerate(cw.names(LAYERS)):
        expected = mean([cw.gradients(LAYERS, r, 4, dtype)[name_index] + owed[r].get(name, 0) for r in range(P)])
        torch.testing.assert_close(results[0]["grads"][4][name], expected, rtol=1e-12, atol=1e-12)
    for r in results:
        assert all(not s.get("paths", {}).get(path, {}).get("residual") for s in r["states"][4:]), r["states"][4]
    assert_nothing_lost(results, LAYERS, path, steps, dtype, rtol=1e-12, atol=1e-12)


def test_a_residual_carried_under_pipe_sgd_loses_nothing(cluster):
    """delay=1: the pass after the last one on INT8 carries the residuals into the exact sync; the
    averages of passes 0-6 (in .grad one step later) sum to the true averages of steps 0-6."""
    P, dtype = cluster.world_size, torch.float64
    results = cluster.run(cw.given_run, LAYERS, "INT8", 8, dtype, 0, settings_of("INT8"), 1, 1.0, (3, default_name()))
    assert all(path_steps(r, "INT8") == [2, 3] and path_steps(r, default_name())[-4:] == [4, 5, 6, 7] for r in results)
    assert all("INT8" not in r["state"].get("paths", {}) for r in results)
    for name_index, name in enumerate(cw.names(LAYERS)):
        true = sum(mean([cw.gradients(LAYERS, r, t, dtype)[name_index] for r in range(P)]) for t in range(7))
        for w, result in enumerate(results):
            applied = sum(result["grads"][t][name] for t in range(1, 8))
            torch.testing.assert_close(applied, true, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {w} {name}: {m}")


@pytest.mark.parametrize("joins_after", [0, 2])
@pytest.mark.parametrize("path", ["PowerSGD", "BF16", "INT8"])
def test_error_feedback_loses_nothing_when_a_rank_has_joined(cluster, path, joins_after):
    """Uneven inputs under join(): the last rank stops after 0 or 2 of 6 steps and shadows the others'
    syncs, sending its residual with zero gradients. The applied averages (each the sum over the ranks
    that trained the step, over the initial world size) and the mean over all ranks of the residuals sum
    to the true averages."""
    steps, dtype = 6, torch.float64
    results = cluster.run(cw.joined_run, LAYERS, path, steps, dtype, joins_after, settings_of(path))
    assert_nothing_lost_under_join(results, path, steps, joins_after, skipped=())


def test_a_backward_that_raises_while_a_rank_has_joined_skips_the_step_everywhere_else(cluster):
    """Rank 0's backward raises at step 4 while the last rank has joined (after 2 steps): the ranks that
    train skip the step (ValueError, SyncError), the joined rank shadows it without an error (it has no
    step to skip), training goes on to the end, and error feedback loses nothing."""
    steps, dtype = 6, torch.float64
    results = cluster.run(cw.joined_run, LAYERS, "BF16", steps, dtype, 2, settings_of("BF16"), 4)
    assert all(r["skipped"] == [4] for r in results[:-1]) and results[-1]["skipped"] == []
    assert all(len(r["grads"]) == steps - 1 for r in results[:-1])
    assert_nothing_lost_under_join(results, "BF16", steps, 2, skipped=(4,))


def assert_nothing_lost_under_join(results: list[dict], path: str, steps: int, joins_after: int,
                                   skipped: tuple[int, ...]) -> None:
    """The applied averages of every rank that trained to the end, plus the mean over all ranks of the
    residuals, sum to the true averages of the steps not skipped (the last rank trained the first
    ``joins_after``), to fp64 rounding; those ranks applied the same gradients."""
    P, dtype = len(results), torch.float64
    assert all(set(outcomes.values()) == {path} for outcomes in results[0]["outcomes"][1:])
    for r in results[1:-1]:
        assert all(torch.equal(a[n], b[n]) for a, b in zip(r["grads"], results[0]["grads"]) for n in a)
    for name_index, name in enumerate(cw.names(LAYERS)):
        true = sum(sum(cw.gradients(LAYERS, r, t, dtype)[name_index] for r in range(P) if r < P - 1 or t < joins_after) / P
                   for t in range(steps) if t not in skipped)
        kept = [r["state"].get("paths", {}).get(path, {}).get("residual", {}).get(name) for r in results]
        left = mean([torch.zeros_like(true) if k is None else k.to(dtype) for k in kept])
        for w, result in enumerate(results[:-1]):
            applied = sum(step[name] for step in result["grads"])
            torch.testing.assert_close(applied + left, true, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {w} {name}: {m}")


def test_a_layer_moving_between_lossy_paths_loses_nothing(cluster):
    """INT8 on steps 1-3, then BF16: BF16 compresses gradient + its own residual + INT8's, whose residual
    is then gone; the applied averages and BF16's residuals sum to the true averages."""
    steps, dtype = 7, torch.float64
    results = cluster.run(cw.given_run, LAYERS, "INT8", steps, dtype, 0, None, 0, 1.0, (3, "BF16"))
    assert all(path_steps(r, "INT8") == [1, 2, 3] and path_steps(r, "BF16") == [4, 5, 6] for r in results)
    assert_same_on_every_rank(results)
    assert all("INT8" not in r["state"]["paths"] and r["state"]["paths"]["BF16"]["residual"] for r in results)
    assert_nothing_lost(results, LAYERS, "BF16", steps, dtype, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_powersgd_feeds_back_the_rounding_of_a_half_precision_model(cluster, dtype):
    """A half-precision model on PowerSGD: the bucket holds the low-rank average rounded to the model's
    dtype, and the residual is taken against that rounded average, so over the compressed matrices the
    applied averages and the residuals sum to the true ones to fp32 rounding, not the half's."""
    P, steps = cluster.world_size, STEPS
    results = cluster.run(cw.given_run, LAYERS, "PowerSGD", steps, dtype, 0, settings_of("PowerSGD"))
    assert_ran(results, "PowerSGD", steps)
    matrices = [i for i, shape in enumerate(s for layer in LAYERS for s in layer) if compressed(shape, 2)]
    assert len(matrices) == 2
    for i in matrices:
        name = cw.names(LAYERS)[i]
        lossy = range(1, steps)  # step 0 is exact (the default path, rounded as DDP rounds)
        true = sum(mean([cw.gradients(LAYERS, r, t, dtype)[i].double() for r in range(P)]) for t in lossy)
        left = mean([r["state"]["paths"]["PowerSGD"]["residual"][name].double() for r in results])
        for w, result in enumerate(results):
            applied = sum(result["grads"][t][name].double() for t in lossy)
            torch.testing.assert_close(applied + left, true, rtol=0, atol=1e-5, msg=lambda m: f"rank {w} {name}: {m}")


# ---- reduced precision ------------------------------------------------------------------------------

@pytest.mark.parametrize("path, wire", [("BF16", torch.bfloat16), ("FP16", torch.float16)])
def test_reduced_precision_average_is_the_documented_rounding(cluster, path, wire):
    """Step 1 (the first on the path, residuals zero): every rank applies
    wire(fp32 sum over ranks in rank order of wire(g_rank) / P), bit for bit."""
    P = cluster.world_size
    results = cluster.run(cw.given_run, LAYERS, path, 2, torch.float32)
    assert_ran(results, path, 2)
    per_rank = [cw.gradients(LAYERS, r, 1, torch.float32) for r in range(P)]
    for i, name in enumerate(cw.names(LAYERS)):
        total = per_rank[0][i].to(wire).float()
        for r in range(1, P):
            total += per_rank[r][i].to(wire).float()
        expected = (total / P).to(wire).float()
        for w, result in enumerate(results):
            assert torch.equal(result["grads"][1][name], expected), (w, name)


def int8_round_trip(x: torch.Tensor, block: int) -> torch.Tensor:
    """The documented quantization of flat ``x``, independently written: blocks of ``block`` (zero-padded),
    scale = max |x| / 127, q = round(x / scale) in [-127, 127], back to q * scale."""
    padded = torch.cat([x, x.new_zeros(-x.numel() % block)]).view(-1, block)
    scale = padded.abs().max(dim=1).values / 127
    q = torch.round(padded / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]).clamp(-127, 127)
    return (q.to(torch.int8).to(x.dtype) * scale[:, None]).view(-1)[:x.numel()]


@pytest.mark.parametrize("block", [256, 7])
def test_int8_average_is_the_documented_rounding(cluster, block):
    """Step 1 (the first on the path, residuals zero), one parameter per bucket: every rank applies
    deq(quant(fp32 sum over ranks in rank order of deq(quant(g_rank)) / P)), bit for bit, with blocks of
    256 (one block holds a whole small layer) and of 7 (blocks across the rows, a padded last one); the
    300 x 200 layer is cut into chunks that different ranks own."""
    P, layers = cluster.world_size, (((16, 24),), ((30,),), ((33, 17),), ((300, 200),))
    results = cluster.run(cw.given_run, layers, "INT8", 2, torch.float32, 0, {"start_iter": 1, "block": block})
    assert_ran(results, "INT8", 2)
    per_rank = [cw.gradients(layers, r, 1, torch.float32) for r in range(P)]
    for i, name in enumerate(cw.names(layers)):
        total = int8_round_trip(per_rank[0][i].reshape(-1), block)
        for r in range(1, P):
            total += int8_round_trip(per_rank[r][i].reshape(-1), block)
        expected = int8_round_trip(total / P, block).view(per_rank[0][i].shape)
        for w, result in enumerate(results):
            assert torch.equal(result["grads"][1][name], expected), (w, name)


def test_int8_sends_about_a_quarter(cluster):
    """Over all ranks, the PS path's formula for n + 4 n / B bytes (values and fp32 scales) plus the flags
    in fp32, against 4 n (and the flags) on PS in step 0."""
    P, layers = cluster.world_size, (((64, 40),),)
    results = cluster.run(cw.given_run, layers, "INT8", 2, torch.float32, 0, {"start_iter": 1, "block": 256})
    n, flags = 64 * 40, 2
    on_ps, on_int8 = (sum(result["by_path"][step].get(path, 0) for result in results) for step, path in
                      ((0, "PS"), (1, "INT8")))
    assert on_ps == 2 * (P - 1) * 4 * (n + flags)
    assert on_int8 == 2 * (P - 1) * (n + 4 * (n // 256) + 4 * flags), (on_int8, on_ps)


def test_int8_sends_no_padding_and_predicts_what_it_sends(cluster):
    """A layer smaller than one block (10 elements) and one ending in a part of a block (300 = 256 + 44):
    the last block's zero padding stays home (it was sent: 256 values for a 10-element bias, 5.6 times
    the PS path's bytes), and the plan's prediction is the mean over the ranks of what was sent (it said
    n (1 + 4 / B): 12 bytes where 268 went out, so the coordinator chose int8 where it sends more)."""
    P, layers, flags = cluster.world_size, (((10,),), ((300,),)), 2
    results = cluster.run(cw.given_run, layers, "INT8", 2, torch.float32, 0, {"start_iter": 1, "block": 256})
    assert_ran(results, "INT8", 2)
    for i, n in enumerate((10, 300)):
        sent = sum(result["bytes"][1][f"layers.{i}"] for result in results)
        assert sent == 2 * (P - 1) * (n + 4 * -(-n // 256) + 4 * flags), (n, sent)
        predicted = results[0]["predicted"][f"layers.{i}"]["INT8"][0]  # (bytes, seconds)
        assert predicted == pytest.approx(sent / P), (n, predicted, sent / P)


# ---- compressed pushes to the parameter server (ServerOptimizer) ----------------------------------------

#: LAYERS and a layer of 60 000 elements, which the shards cut into chunks with different owners
SERVER_LAYERS: cw.Layers = LAYERS + (((300, 200),),)

def cast_push_reference(layers: cw.Layers, world_size: int, steps: int, wire: torch.dtype,
                        dtype: torch.dtype = torch.float32, scale: float = 1.0, lr: float = 1.0
                        ) -> tuple[list[dict], list[dict]]:
    """Compressed pushes in one process (a model of ``dtype``, gradients times ``scale``, SGD at ``lr``, a
    power of two, so lr times the average is exact in any dtype): step 0 on the
    exact default path; then every rank casts M = gradient + residual (fp32) to ``wire`` and the owner
    steps from the fp32 sum over the ranks, in rank order, of the cast values, divided by P (not cast to
    ``wire`` again; into ``dtype``). Per step the parameters SGD gives (from zero); each rank's
    residuals at the end."""
    names = cw.names(layers)
    residual = [dict.fromkeys(names, 0.0) for _ in range(world_size)]
    params = {name: torch.zeros((), dtype=dtype) for name in names}
    after = []
    for t in range(steps):
        per_rank = [[g * scale for g in cw.gradients(layers, w, t, dtype)] for w in range(world_size)]
        for i, name in enumerate(names):
            ms = [per_rank[w][i].float() + residual[w][name] for w in range(world_size)] if t else \
                [g[i].float() for g in per_rank]
            sent = [m.to(wire).float() for m in ms] if t else ms
            total = sent[0].clone()
            for part in sent[1:]:
                total += part
            params[name] = params[name] - lr * (total / world_size).to(dtype)
            if t:
                for w in range(world_size):
                    residual[w][name] = ms[w] - sent[w]
        after.append(dict(params))
    return after, residual


@pytest.mark.parametrize("path, wire", [("BF16", torch.bfloat16), ("FP16", torch.float16)])
def test_compressed_pushes_equal_the_single_process_algorithm(cluster, path, wire):
    """A ServerOptimizer (BSP, SGD) with BF16 / FP16 pushes: every rank's parameters after every step and
    its residuals at the end are those of the single-process algorithm, bit for bit; the layers ran on
    the path from step 1 on."""
    P = cluster.world_size
    results = cluster.run(cw.given_server_run, SERVER_LAYERS, path, STEPS, torch.float32, {"start_iter": 1})
    assert_ran(results, path, STEPS)
    after, residual = cast_push_reference(SERVER_LAYERS, P, STEPS, wire)
    for w, result in enumerate(results):
        for step, expected in enumerate(after):
            for name, value in expected.items():
                assert torch.equal(result["params"][step][name], value), (w, step, name)
        kept = result["state"]["paths"][path]["residual"]
        for name, value in residual[w].items():
            assert torch.equal(kept[name], value), (w, name)


def test_a_half_precision_model_is_averaged_in_fp32_at_the_owner(cluster):
    """An fp16 model with bf16 pushes (forced: the coordinator never puts a half bucket on a cast by cost)
    and gradients up to 47 000: at step 1 the ranks' parts of some element sum to 67 000 (P = 2) or
    99 000 (P = 3), past fp16's 65 504, their mean does not. Every rank's parameters are the
    single-process algorithm's (sum in fp32, mean into fp16), finite (summed in fp16 they were inf)."""
    P, scale = cluster.world_size, 1.5e4
    results = cluster.run(cw.given_server_run, LAYERS, "BF16", 2, torch.float16, {"start_iter": 1}, None,
                          {"lr": 0.5}, scale)
    assert_ran(results, "BF16", 2)
    after, _ = cast_push_reference(LAYERS, P, 2, torch.bfloat16, torch.float16, scale, lr=0.5)
    for w, result in enumerate(results):
        for step, expected in enumerate(after):
            for name, value in expected.items():
                assert torch.isfinite(result["params"][step][name]).all(), (w, step, name)
                assert torch.equal(result["params"][step][name], value), (w, step, name)


@pytest.mark.parametrize("server", [False, True], ids=["torch-SGD", "ServerOptimizer"])
def test_a_skipped_powersgd_step_leaves_the_warm_start_as_it_was(cluster, server):
    """Batch 3's backward raises on rank 0 (caught on every rank) after some buckets synced: the run ends
    bit for bit as one that skipped the batch on every rank, parameters, residuals and Q (the Q of the
    buckets synced before the exception was kept before, 0.28 off)."""
    raised = cluster.run(cw.skipped_batch, server, True)
    skipped = cluster.run(cw.skipped_batch, server, False)
    for rank, (a, b) in enumerate(zip(raised, skipped)):
        for name, value in b["params"].items():
            assert torch.equal(a["params"][name], value), (rank, name)
        for key in ("q", "residual"):
            assert a["state"][key].keys() == b["state"][key].keys(), (rank, key)
            for name, value in b["state"][key].items():
                assert torch.equal(a["state"][key][name], value), (rank, key, name)


@pytest.mark.parametrize("server", [False, True], ids=["torch-SGD", "ServerOptimizer"])
def test_a_checkpoint_right_after_a_raised_backward_neither_hangs_nor_changes_the_run(cluster, server):
    """Every rank takes the consistency state where it caught batch 3's error (rank 0's backward raised,
    its pass still open): the call finishes that pass first, so the ranks' collectives meet, and the run
    ends bit for bit as without the call."""
    observed = cluster.run(cw.skipped_batch, server, True, True)
    raised = cluster.run(cw.skipped_batch, server, True)
    for rank, (a, b) in enumerate(zip(observed, raised)):
        for name, value in b["params"].items():
            assert torch.equal(a["params"][name], value), (rank, name)


def test_powersgd_pushes_equal_the_single_process_algorithm(cluster):
    """PowerSGD with a ServerOptimizer: its all-reduces of P and Q stand for the push, the owners step from
    the projected average (every rank holds it) and the new values are pulled exactly: the parameters
    are minus the sum of the reference's averages, the residuals the reference's (fp64)."""
    P = cluster.world_size
    results = cluster.run(cw.given_server_run, LAYERS, "PowerSGD", STEPS, torch.float64, {"start_iter": 1, "rank": 2})
    assert_ran(results, "PowerSGD", STEPS)
    applied, residual = powersgd_reference(LAYERS, P, STEPS, torch.float64, 2)
    for w, result in enumerate(results):
        total = {}
        for step, averages in enumerate(applied):
            for name, value in averages.items():
                total[name] = total.get(name, 0) - value
                torch.testing.assert_close(result["params"][step][name], total[name], rtol=1e-9, atol=1e-10)
        kept = result["state"]["paths"]["PowerSGD"]["residual"]
        for name, value in residual[w].items():
            torch.testing.assert_close(kept.get(name, torch.zeros_like(value)), value, rtol=1e-9, atol=1e-10)


def int8_push_reference(layers: cw.Layers, world_size: int, steps: int, block: int, chunk_bytes: int
                        ) -> list[dict]:
    """Int8 pushes in one process, one parameter per layer (its own bucket, two flags after it), SGD at lr
    1 from zero: step 0 on the exact default path; then every rank cuts M = gradient + residual into the
    shards' chunks (``plan_chunks``, the default path's), each into blocks of ``block`` from its own start,
    quantizes them (``int8_round_trip``), and the owner steps from the sum over the ranks in rank order of
    the dequantized parts, divided by P (not quantized again). Per step the parameters."""
    names = cw.names(layers)
    residual = [dict.fromkeys(names, 0.0) for _ in range(world_size)]
    params = {name: torch.zeros(()) for name in names}
    after = []
    for t in range(steps):
        per_rank = [cw.gradients(layers, w, t, torch.float32) for w in range(world_size)]
        for i, name in enumerate(names):
            ms = [per_rank[w][i].reshape(-1) + residual[w][name] for w in range(world_size)]
            n = ms[0].numel()
            chunks = plan_chunks([n + 2], [4], world_size, chunk_bytes)[0]
            sent = [torch.cat([int8_round_trip(m[c.start:min(c.stop, n)], block) for c in chunks if c.start < n])
                    for m in ms] if t else ms
            total = sent[0].clone()
            for part in sent[1:]:
                total += part
            params[name] = params[name] - (total / world_size).view(per_rank[0][i].shape)
            if t:
                for w in range(world_size):
                    residual[w][name] = ms[w] - sent[w]
        after.append(dict(params))
    return after


@pytest.mark.parametrize("layers, block, chunk_bytes", [
    ((((16, 24),), ((30,),), ((300, 200),)), 256, None),
    ((((16, 24),), ((30,),), ((300, 200),)), 7, None),
    ((((16, 24),), ((15, 24),), ((30,),)), 7, 64)], ids=["B256", "B7", "B7-chunks-of-16"])
def test_int8_pushes_equal_the_single_process_algorithm(cluster, layers, block, chunk_bytes):
    """A ServerOptimizer (BSP, SGD) with INT8 pushes straight to the shards: every rank's parameters after
    every step are the single-process algorithm's, bit for bit, blocks cut from each shard's chunk's
    start (the 300 x 200 layer is cut into chunks that different ranks own; chunks of 16 elements cut a
    layer into 2 to 25, dealt over every rank, each ending in a part of a block; the 16 x 24 layer's
    gradients fill 24 chunks, so its 25th holds the flags alone, whose owner gets no blocks)."""
    P = cluster.world_size
    results = cluster.run(cw.given_server_run, layers, "INT8", 3, torch.float32, {"start_iter": 1, "block": block},
                          None, None, 1.0, chunk_bytes)
    assert_ran(results, "INT8", 3)
    after = int8_push_reference(layers, P, 3, block, chunk_bytes or DEFAULT_CHUNK_BYTES)
    for w, result in enumerate(results):
        for step, expected in enumerate(after):
            for name, value in expected.items():
                assert torch.equal(result["params"][step][name], value), (w, step, name)


def test_int8_pushes_over_small_chunks_lose_nothing(cluster):
    """Chunks of 4 elements (fp64): every shard owns blocks of 4 or fewer, and two of LAYERS' buckets end
    in a chunk of flags alone, which has no blocks to push: the sum of the applied averages plus the mean
    residual is the sum of the true averages, and every rank holds the same parameters after every step."""
    results = cluster.run(cw.given_server_run, LAYERS, "INT8", STEPS, torch.float64, {"start_iter": 1}, None, None,
                          1.0, 32)
    assert_ran(results, "INT8", STEPS)
    assert_server_run_lost_nothing(results, LAYERS, "INT8")


@pytest.mark.parametrize("path", ["PowerSGD", "BF16", "INT8"])
def test_compressed_pushes_lose_nothing(cluster, path):
    """Error feedback through the parameter server (fp64): minus the parameters (the sum of the applied
    averages) plus the mean of the residuals is the sum of the true averages; every rank holds the same
    parameters after every step."""
    results = cluster.run(cw.given_server_run, SERVER_LAYERS, path, STEPS, torch.float64, settings_of(path))
    assert_ran(results, path, STEPS)
    assert_server_run_lost_nothing(results, SERVER_LAYERS, path)


def assert_server_run_lost_nothing(results: list[dict], layers: cw.Layers, path: str) -> None:
    """Every rank holds the same parameters after every step, and minus the last ones (the sum of the
    applied averages, SGD at lr 1 from zero) plus the mean of the residuals is the sum of the true
    averages (fp64)."""
    for step in range(STEPS):
        for name, value in results[0]["params"][step].items():
            assert all(torch.equal(other["params"][step][name], value) for other in results[1:]), (step, name)
    P = len(results)
    for i, name in enumerate(cw.names(layers)):
        true = sum(mean([cw.gradients(layers, r, t, torch.float64)[i] for r in range(P)])
                   for t in range(STEPS))
        kept = [result["state"]["paths"][path]["residual"].get(name) for result in results]
        left = mean([torch.zeros_like(true) if k is None else k for k in kept])
        torch.testing.assert_close(-results[0]["params"][-1][name] + left, true, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{path} {name}: {m}")


#: bytes one rank pushes of a chunk of n gradients and its flags to the chunk's owner, by path
PUSHED = {"BF16": lambda n, flags: 2 * (n + flags) + 2 * flags,  # the chunk, flags too, and the flags again
          "INT8": lambda n, flags: n + 4 * -(-n // 256) + 4 * flags}  # values, a scale per started block, flags


@pytest.mark.parametrize("path", ["BF16", "INT8"])
def test_compressed_pushes_send_less_and_pull_the_values_exactly(cluster, path):
    """Over all ranks, one bucket (one chunk) per layer: on the exact path step 0 sends the fp32 push,
    the flags to the owner and the fp32 pull; BF16 pushes the chunk in bf16 (half), INT8 its int8 values
    and fp32 scales (about a quarter) and the flags in fp32; both pull the values in fp32, as step 0."""
    P, layers = cluster.world_size, (((64, 40),), ((30,), (30,)))
    results = cluster.run(cw.given_server_run, layers, path, 2, torch.float32, {"start_iter": 1})
    assert_ran(results, path, 2)
    sizes = [(sum(torch.Size(shape).numel() for shape in shapes), len(shapes) + 1) for shapes in layers]
    on_ps, on_path = (sum(result["by_path"][step].get(name, 0) for result in results) for step, name in
                      ((0, "PS"), (1, path)))
    assert on_ps == sum((P - 1) * 4 * (2 * (n + flags) + flags) for n, flags in sizes)
    assert on_path == sum((P - 1) * (PUSHED[path](n, flags) + 4 * (n + flags)) for n, flags in sizes)


@pytest.mark.parametrize("path", ["PowerSGD", "BF16"])
def test_a_resumed_server_run_continues_bit_for_bit(cluster, path):
    """5 steps straight against 2, a checkpoint (the model and the consistency state: plain SGD keeps no
    optimizer state), a fresh wrapper and ServerOptimizer, and 3 more: the same parameters, bit for bit."""
    settings = settings_of(path)
    straight = cluster.run(cw.given_server_run, LAYERS, path, STEPS, torch.float32, settings)
    resumed = cluster.run(cw.given_server_run, LAYERS, path, STEPS, torch.float32, settings, 2)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert set(b["outcomes"][2].values()) == {path}, b["outcomes"][2]
        for name, value in a["params"][-1].items():
            assert torch.equal(b["params"][-1][name], value), (rank, name)


def test_fp16_saturates_instead_of_overflowing(cluster):
    """A gradient beyond fp16's range is sent as 65504; the excess stays in the residual (nothing is inf)."""
    results = cluster.run(cw.given_run, (((3,),),), "FP16", 2, torch.float32, 0, None, 0, 1e6)
    assert all(result["grads"][1]["layers.0.p0"].abs().max() <= 65504 for result in results)
    assert_ran(results, "FP16", 2)
    for result in results:
        assert torch.isfinite(result["grads"][1]["layers.0.p0"]).all()
        assert result["state"]["paths"]["FP16"]["residual"]["layers.0.p0"].abs().max() > 1e5


@pytest.mark.parametrize("path", ["PowerSGD", "BF16", "INT8"])
def test_a_late_gradient_is_averaged_exactly_and_leaves_no_residual(cluster, path):
    """The shared layer's bucket syncs on the lossy path, then more gradient arrives: the bucket is
    averaged again, whole and exactly, and the lossy sync's residual is dropped with its average (kept,
    it would be sent later although nothing was left out)."""
    from test_patterns import assert_exact

    results = cluster.run(cw.late_gradient, path)
    assert all(r["late"] for r in results)  # the case under test really happened
    assert all(r["planned"]["shared"] == path for r in results), [r["planned"] for r in results]
    assert_exact(results)
    for r in results:
        kept = r["state"].get("paths", {}).get(path, {}).get("residual", {})
        assert not any(name.startswith("shared.") for name in kept), sorted(kept)


# ---- bytes ----------------------------------------------------------------------------------------------

def powersgd_bytes(shapes: list[tuple[int, ...]], rank: int, world_size: int) -> int:
    """The documented bytes of one rank's PowerSGD sync of a bucket of fp32 ``shapes``: a ring
    all-reduce of [P's | uncompressed | flags], then one of the Q's (none if nothing is compressed)."""
    ring = 2 * (world_size - 1) / world_size
    first, second = len(shapes) + 1, 0
    for shape in shapes:
        r, rows = compressed(shape, rank), shape[0]
        cols = torch.Size(shape).numel() // rows
        first, second = (first + rows * r, second + cols * r) if r else (first + rows * cols, second)
    return int(ring * first * 4) + int(ring * second * 4)


def test_bytes_sent_drop_as_predicted(cluster):
    """PowerSGD: each bucket's bytes are the documented formula's, the plan predicted them, and a bucket
    with a compressed matrix sends less than on PS; BF16: over all ranks, exactly half of what the PS path
    sent for the same buckets in step 0."""
    P = cluster.world_size
    powersgd = cluster.run(cw.given_run, LAYERS, "PowerSGD", 2, torch.float32, 0, {"rank": 2})
    for result in powersgd:
        for index, shapes in enumerate(LAYERS):
            bucket = f"layers.{index}"
            sent = result["bytes"][1][bucket]
            assert sent == powersgd_bytes(list(shapes), 2, P), (bucket, sent)
            predicted = result["predicted"][bucket]["PowerSGD"]
            if any(compressed(shape, 2) for shape in shapes):
                assert abs(predicted[0] - sent) <= 2, (bucket, predicted, sent)
                assert sent < result["predicted"][bucket]["PS"][0] / 2, (bucket, sent)
            else:
                assert predicted is None  # nothing to compress: never chosen by cost
    bf16 = cluster.run(cw.given_run, LAYERS, "BF16", 2, torch.float32)
    for bucket in bf16[0]["bytes"][0]:
        on_ps, on_bf16 = (sum(result["bytes"][step][bucket] for result in bf16) for step in (0, 1))
        assert on_bf16 * 2 == on_ps, (bucket, on_ps, on_bf16)
    total = sum(4 * (torch.Size(s).numel() + 1) for layer in LAYERS for s in layer) + 4 * len(LAYERS)
    assert sum(result["by_path"][0]["PS"] for result in bf16) == 2 * (P - 1) * total


# ---- composing with Pipe-SGD, resuming ------------------------------------------------------------------

def test_powersgd_composes_with_pipe_sgd(cluster):
    """delay=1: step t+1's .grad is bit for bit what BSP with PowerSGD gives at step t (the compression
    runs on the sync's threads, one step later)."""
    bsp = cluster.run(cw.given_run, LAYERS, "PowerSGD", STEPS, torch.float32, 0, settings_of("PowerSGD"))
    piped = cluster.run(cw.given_run, LAYERS, "PowerSGD", STEPS + 1, torch.float32, 0, settings_of("PowerSGD"), 1)
    for rank, (b, p) in enumerate(zip(bsp, piped)):
        assert set(p["outcomes"][2].values()) == {"PowerSGD"} and p["state"]["paths"]["PowerSGD"]["q"]
        for step in range(STEPS):
            for name, grad in b["grads"][step].items():
                assert torch.equal(p["grads"][step + 1][name], grad), (rank, step, name)


SPEC = ModelSpec(conv_channels=(4,), widths=(24, 16), image=5)


@pytest.mark.parametrize("path", ["PowerSGD", "BF16", "INT8"])
def test_a_resumed_run_continues_bit_for_bit(cluster, path):
    """6 steps straight against 3, a checkpoint (model, optimizer, consistency state), a fresh wrapper
    and 3 more: the same parameters on every rank, bit for bit; without the consistency state they
    differ (the residuals and Q matter)."""
    options = {"fusion_bytes": 0, "overrides": {layer.name: path for layer in find_layers(build(SPEC, 0))},
               "compression": {path_class(path).option: {"start_iter": 1}}}
    straight = cluster.run(cw.train, SPEC, options, 6, 3)
    resumed = cluster.run(cw.train, SPEC, options, 6, 3, 3)
    forgot = cluster.run(cw.train, SPEC, options, 6, 3, 3, False)
    for rank, (a, b, c) in enumerate(zip(straight, resumed, forgot)):
        assert set(b["outcomes"][3].values()) == {path}, b["outcomes"][3]  # the resumed engine's first pass
        for name, value in a["params"][-1].items():
            assert torch.equal(b["params"][-1][name], value), (rank, name)
        assert any(not torch.equal(c["params"][-1][n], v) for n, v in a["params"][-1].items()), rank
        for name, value in straight[0]["params"][-1].items():
            assert torch.equal(a["params"][-1][name], value), (rank, name)


def test_a_pipe_sgd_checkpoint_carries_the_plan_its_pass_in_flight_leads_to(cluster):
    """delay=1, INT8 chosen by cost from the 3rd synced pass on (64 rows per rank: SFB does not pay, as it
    would at a few rows, and a resumed engine would not carry it: exact, but it rounds otherwise): the checkpoint after step 3 holds pass 3 in flight,
    whose facts start INT8 for step 4. A checkpoint waits for that pass but leaves its close (the plan) to
    the next pass, so the state it saves must carry the plan that pass leads to: the resumed run takes
    INT8 at step 4, as the straight one, and ends bit for bit where it does."""
    # a link slow enough that the pipelined step is the link's, whatever the backward's speed on this machine
    options = {"delay": 1, "fusion_bytes": 0, "link": LinkModel.from_gbps(1e-4),
               "compression": {"int8": {"start_iter": 3}}}
    straight = cluster.run(cw.train, SPEC, options, 6, 64)
    resumed = cluster.run(cw.train, SPEC, options, 6, 64, 3)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        # a pass's paths are counted when it closes, in the next step
        assert "INT8" not in a["outcomes"][3].values() and set(a["outcomes"][4].values()) == {"INT8"}, a["outcomes"]
        assert b["outcomes"][4] == a["outcomes"][4], (rank, b["outcomes"][4])
        for name, value in a["params"][-1].items():
            assert torch.equal(b["params"][-1][name], value), (rank, name)


def test_a_resumed_run_keeps_the_lossy_paths_until_its_model_is_learned(cluster):
    """INT8 chosen by cost at a few rows, where the FC layers it does not take stay on SFB: a resumed
    engine's first pass plans before it has learned its buckets, so with no model yet it put the layers
    the checkpoint had on INT8 on their blind exact choice (SFB) for the second pass, one pass off the
    straight run's plan. From its second pass on, the resumed run takes every step's paths as the straight
    one (its first runs the FC layers on the default path: SFB is exact, so a checkpoint does not carry it)."""
    options = {"link": LinkModel.from_gbps(1e-4), "compression": {"int8": {"start_iter": 1}}}
    straight = cluster.run(cw.train, SPEC, options, 6, 3)
    resumed = cluster.run(cw.train, SPEC, options, 6, 3, 3)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert "INT8" in a["outcomes"][3].values() and "SFB" in a["outcomes"][3].values(), a["outcomes"][3]
        assert b["outcomes"][4:] == a["outcomes"][4:], (rank, a["outcomes"][4:], b["outcomes"][4:])


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["powersgd", "bf16"])
def test_training_is_deterministic_and_identical_on_every_rank(cluster, compression):
    """Chosen by the coordinator (a slow link given, so it pays; the FC layers may stay on SFB, exact and
    cheaper at 3 rows): the parameters after every step are the same on every rank, and the same in a
    second run."""
    spec = ModelSpec(conv_channels=(16,), widths=(24, 16), image=5)  # the conv kernel (16 x 27) compresses
    options = {"compression": {compression: {"start_iter": 1}}, "link": LinkModel.from_gbps(1e-4)}
    runs = [cluster.run(cw.train, spec, options, 4, 3) for _ in range(2)]
    assert any(compression.upper() in name.upper() for name in runs[0][0]["outcomes"][-1].values()), \
        runs[0][0]["outcomes"][-1]
    for step in range(4):
        reference = runs[0][0]["params"][step]
        for run in runs:
            for rank, result in enumerate(run):
                for name, value in reference.items():
                    assert torch.equal(result["params"][step][name], value), (rank, step, name)


# ---- the coordinator ----------------------------------------------------------------------------------

def plan_of(layers: list[Layer], world_size: int, link: LinkModel, lossy: tuple[str, ...], passes: int = 2,
            ready_s: dict[str, float] | None = None, pipelined_steps: bool = False, pull_values: bool = False):
    """The coordinator's plan after ``passes`` clean passes, every layer alone in a bucket (learned, the
    layers' gradients ready at ``ready_s``: all at the start of backward by default); ``pull_values``: for
    a mode that updates at the owners (a ServerOptimizer)."""
    coordinator = planner(layers, world_size, link, lossy, pipelined_steps)
    coordinator.pull_values = pull_values
    buckets = alone(layers)
    coordinator.buckets_changed(buckets, learned=True,
                                ready_s=ready_s or dict.fromkeys((layer.name for layer in layers), 0.0))
    for _ in range(passes):
        coordinator.observe(torch.zeros(world_size, 1 + 2 * len(buckets), dtype=torch.int64), len(buckets))
    return coordinator.plan(buckets)


def planner(layers: list[Layer], world_size: int, link: LinkModel, lossy: tuple[str, ...],
            pipelined_steps: bool = False) -> Coordinator:
    compression = compression_option({name: {"start_iter": 1} for name in lossy} or None)
    paths = Paths.build(PathEnv(0, world_size, 2 << 20, torch.device("cpu"), settings=compression))
    return Coordinator({}, world_size, link, 50e9, paths=paths, layers=layers, lossy=tuple(compression),
                       memory_bps=10e9, pipelined=pipelined_steps)


def iteration_of(layers: list[Layer], paths: dict[str, str], world_size: int, link: LinkModel,
                 lossy: tuple[str, ...], ready_s: dict[str, float] | None = None) -> float:
    """The BSP timeline's iteration with each layer (a bucket of its own) on ``paths[layer]``: its sync
    as the registered path predicts it (link part on the link, compute on the compute lane), ready at
    ``ready_s`` (all at the start of backward by default)."""
    registered = planner(layers, world_size, link, lossy).paths
    ready = ready_s or dict.fromkeys((layer.name for layer in layers), 0.0)
    order = sorted(layers, key=lambda layer: ready[layer.name])
    steps, jobs, last = [], [], 0.0
    for i, layer in enumerate(order):
        params = [p for _, p in layer.params]
        cost = BucketCost(flat_numel(sum(p.numel() for p in params), len(params)) * 4, layer.nbytes, None,
                          tuple(tuple(p.shape) for p in params), 4)
        predicted = registered[paths[layer.name]].predict(cost, world_size, link, 50e9, 10e9)
        steps.append(LayerProfile(layer.name, layer.nbytes, ready[layer.name] - last))
        last = ready[layer.name]
        jobs.append(Job(layer.name, i, predicted.seconds - predicted.compute_s, predicted.bytes, paths[layer.name],
                        predicted.compute_s))
    return bsp(Profile(tuple(steps), forward_s=1e-9), jobs).iteration_s


def model_of(shapes: cw.Layers) -> list[Layer]:
    return find_layers(cw.Given(shapes, torch.float32))


def alone(layers: list[Layer]) -> list[Bucket]:
    """Every layer in a bucket of its own, in the given order."""
    return build_buckets([[layer] for layer in layers], False, lambda layer: None)


@settings(max_examples=40, deadline=None)
@given(layers=layer_shapes, world_size=st.integers(2, 16), gbps=st.sampled_from([0.001, 0.1, 1.0, 10.0, 1000.0]),
       lossy=st.sampled_from([(), ("powersgd",), ("bf16",), ("powersgd", "fp16"), ("int8",), ("powersgd", "int8")]))
def test_the_coordinator_picks_a_lossy_path_only_when_asked_and_predicted_faster(layers, world_size, gbps, lossy):
    link = LinkModel.from_gbps(gbps, 10.0)
    model = model_of(layers)
    plan = plan_of(model, world_size, link, lossy)
    allowed = {path: path_class(path).option for path in ("PowerSGD", "BF16", "FP16", "INT8")}
    for row in plan.rows:
        shown_lossy = {path for path in row.predictions if path in allowed}
        assert shown_lossy <= {path for path, option in allowed.items() if option in lossy}, row
        if row.path == "PS":
            continue
        assert allowed[row.path] in lossy, row  # never a lossy path unless asked
        assert row.predictions[row.path][1] < row.predictions["PS"][1], row  # its sync predicted faster
    # and never a plan its model predicts slower: the plan's iteration is shorter than all-PS's, or it is all-PS
    planned = iteration_of(model, plan.layer_paths(), world_size, link, lossy)
    exact = iteration_of(model, dict.fromkeys(plan.layer_paths(), "PS"), world_size, link, lossy)
    assert planned < exact if any(row.path != "PS" for row in plan.rows) else planned == exact


def test_the_coordinator_compresses_where_it_pays_and_not_elsewhere():
    """A 1024 x 1024 layer over 0.1 Gbit/s goes on PowerSGD; over an ideal link (no latency, 10 Tbit/s)
    it stays exact; the vector layer stays exact either way; without compression= nothing is lossy."""
    layers = model_of((((1024, 1024),), ((64,),)))
    slow = plan_of(layers, 4, LinkModel.from_gbps(0.1), ("powersgd",)).layer_paths()
    assert slow == {"layers.0": "PowerSGD", "layers.1": "PS"}, slow
    fast = plan_of(layers, 4, LinkModel.from_gbps(10000.0), ("powersgd",)).layer_paths()
    assert fast == {"layers.0": "PS", "layers.1": "PS"}, fast
    assert set(plan_of(layers, 4, LinkModel.from_gbps(0.1), ()).layer_paths().values()) == {"PS"}


@pytest.mark.parametrize("lossy, path", [("int8", "INT8"), ("bf16", "BF16")])
def test_a_cast_compresses_over_a_slow_link_and_not_a_fast_one(lossy, path):
    """With the calibrated compute (module docstrings of paths/int8.py and paths/precision.py; memory at
    10 GB/s here): a 1024 x 1024 layer at 2 ranks goes on the cast over 0.1 Gbit/s and stays exact over
    1 Gbit/s, where its compute (int8: 44 ns per element, bf16: 25) costs more than the bytes it saves (24
    and 16 ns); the uncalibrated counts (4.8 and 3.6 ns) put it on the cast there too."""
    layers = model_of((((1024, 1024),),))
    assert plan_of(layers, 2, LinkModel.from_gbps(0.1), (lossy,)).layer_paths() == {"layers.0": path}
    assert plan_of(layers, 2, LinkModel.from_gbps(1.0), (lossy,)).layer_paths() == {"layers.0": "PS"}


def test_powersgd_compresses_where_its_calibrated_compute_pays():
    """With the calibrated compute (module docstring of paths/powersgd.py; memory at 10 GB/s here): a
    1024 x 1024 layer at 2 ranks goes on PowerSGD over 1 Gbit/s (4.2 MB sent exactly: 34 ms) and stays
    exact over 5 Gbit/s (6.7 ms), where its compute (7.6 ms) costs more than the bytes it saves; the
    earlier count of nine passes (3.8 ms) put it on PowerSGD there too."""
    layers = model_of((((1024, 1024),),))
    assert plan_of(layers, 2, LinkModel.from_gbps(1.0), ("powersgd",)).layer_paths() == {"layers.0": "PowerSGD"}
    assert plan_of(layers, 2, LinkModel.from_gbps(5.0), ("powersgd",)).layer_paths() == {"layers.0": "PS"}


def test_a_server_optimizer_costs_each_path_with_the_pull_of_the_values():
    """With the update at the owners, the exact path's prediction is its own sync (push, then the pull of
    the values); BF16 and INT8 push half their own sync's bytes (its push) and pull the values in fp32;
    PowerSGD syncs as it does and adds the pull: the bytes of the plan's rows, per rank, for a 1024 x 1024
    layer at P = 2 over 0.1 Gbit/s, where each compressed path is chosen."""
    layers = model_of((((1024, 1024),),))
    n = flat_numel(1024 * 1024, 1)
    link = LinkModel.from_gbps(0.1)
    pull = 1024 * 1024 * 4 / 2  # (P - 1) / P of the values
    expected = {"PS": n * 4, "BF16": n * 2 / 2 + pull, "INT8": None, "PowerSGD": None}
    pushed = {"BF16": 0.5, "INT8": 0.5, "PowerSGD": 1.0}  #: of the path's own sync, before the pull
    for lossy, path in (("bf16", "BF16"), ("int8", "INT8"), ("powersgd", "PowerSGD")):
        plain = plan_of(layers, 2, link, (lossy,)).rows[0].predictions
        served = plan_of(layers, 2, link, (lossy,), pull_values=True)
        assert served.layer_paths() == {"layers.0": path}
        row = served.rows[0].predictions
        assert row["PS"][0] == pytest.approx(expected["PS"]) == plain["PS"][0]
        assert row[path][0] == pytest.approx(expected[path] or plain[path][0] * pushed[path] + pull), (path, row[path])


@pytest.mark.parametrize("lossy, path", [("int8", "INT8"), ("powersgd", "PowerSGD")])
def test_a_sync_hidden_under_the_backward_stays_exact(lossy, path):
    """One model of the iteration (issue 48): a 1024 x 1024 layer over 0.1 Gbit/s syncs faster compressed.
    Ready last (its sync exposed at the end of backward) it is compressed; ready first, with 10 s of
    backward still to run, its exact sync hides under that backward, and compressing it only adds compute
    to the compute lane: it stays exact. The plan's predicted iteration is checked against the timeline
    in both cases."""
    layers = model_of((((1024, 1024),), ((64,),)))
    link = LinkModel.from_gbps(0.1)
    exposed = {"layers.0": 1.0, "layers.1": 0.0}
    hidden = {"layers.0": 0.0, "layers.1": 10.0}
    assert plan_of(layers, 2, link, (lossy,), ready_s=exposed).layer_paths()["layers.0"] == path
    assert plan_of(layers, 2, link, (lossy,), ready_s=hidden).layer_paths()["layers.0"] == "PS"
    for ready, faster in ((exposed, True), (hidden, False)):
        compressed = iteration_of(layers, {"layers.0": path, "layers.1": "PS"}, 2, link, (lossy,), ready)
        exact = iteration_of(layers, {"layers.0": "PS", "layers.1": "PS"}, 2, link, (lossy,), ready)
        assert (compressed < exact) == faster, (ready, compressed, exact)


def test_a_pipelined_mode_compresses_only_where_the_link_outlasts_the_compute():
    """With ``delay`` (Pipe-SGD) a step lasts max(communication, compute): a sync shorter than the backward
    costs nothing, so the layer that BSP compresses (exposed at the end of a 1 s backward) stays exact;
    over a link 100 times slower it is compressed there too."""
    layers = model_of((((1024, 1024),), ((64,),)))
    ready = {"layers.0": 1.0, "layers.1": 0.0}
    bsp_plan = plan_of(layers, 2, LinkModel.from_gbps(0.1), ("int8",), ready_s=ready)
    assert bsp_plan.layer_paths()["layers.0"] == "INT8"
    piped = plan_of(layers, 2, LinkModel.from_gbps(0.1), ("int8",), ready_s=ready, pipelined_steps=True)
    assert piped.layer_paths()["layers.0"] == "PS"
    slow = plan_of(layers, 2, LinkModel.from_gbps(0.001), ("int8",), ready_s=ready, pipelined_steps=True)
    assert slow.layer_paths()["layers.0"] == "INT8"


def test_a_lossy_path_waits_for_the_iteration_model():
    """Before the buckets are learned (no readiness times) a lossy path is never chosen: the layer waits,
    alone in its bucket; once they are, the plan already made is made again with the model."""
    layers = model_of((((1024, 1024),),))
    coordinator = planner(layers, 2, LinkModel.from_gbps(0.1), ("int8",))
    coordinator.buckets_changed(alone(layers), learned=False)
    coordinator.observe(torch.zeros(2, 3, dtype=torch.int64), 1)
    assert (coordinator.chosen, coordinator.waiting) == ({}, {"layers.0": "INT8"})
    assert coordinator.wanted_solo() == {"layers.0"}
    coordinator.buckets_changed(alone(layers), learned=True, ready_s={"layers.0": 0.0})
    assert (coordinator.chosen, coordinator.waiting) == ({"layers.0": "INT8"}, {})


def test_a_lossy_path_waits_for_its_start_iter():
    layers = model_of((((1024, 1024),),))
    compression = compression_option({"powersgd": {"start_iter": 3}})
    paths = Paths.build(PathEnv(0, 2, 2 << 20, torch.device("cpu"), settings=compression))
    coordinator = Coordinator({}, 2, LinkModel.from_gbps(0.1), 50e9, paths=paths, layers=layers,
                              lossy=tuple(compression), memory_bps=10e9)
    coordinator.buckets_changed(alone(layers), learned=True, ready_s={"layers.0": 0.0})
    seen = []
    for _ in range(4):
        coordinator.observe(torch.zeros(2, 3, dtype=torch.int64), 1)
        seen.append(dict(coordinator.chosen))
        assert coordinator.wanted_solo() == {"layers.0"}  # kept alone while it waits
    assert seen == [{}, {}, {"layers.0": "PowerSGD"}, {"layers.0": "PowerSGD"}], seen


def test_an_fc_layer_keeps_sfb_while_powersgd_waits():
    """A 1024 x 1024 FC layer at K = 64 over 0.1 Gbit/s: PowerSGD wins by cost, SFB beats PS; until
    PowerSGD's start_iter the layer goes on SFB (the best started path), not on the default PS path."""
    module = nn.Linear(1024, 1024)
    fc = {"layers.0": FCLayer("layers.0", module, fc_spec(module), lambda: False, lambda: False)}
    compression = compression_option({"powersgd": {"start_iter": 3}})
    paths = Paths.build(PathEnv(0, 2, 2 << 20, torch.device("cpu"), settings=compression))
    layers = model_of((((1024, 1024),),))
    coordinator = Coordinator(fc, 2, LinkModel.from_gbps(0.1), 50e9, paths=paths, layers=layers,
                              lossy=tuple(compression), memory_bps=10e9)
    coordinator.buckets_changed(alone(layers), learned=True, ready_s={"layers.0": 0.0})
    seen = []
    for _ in range(4):
        coordinator.observe(torch.tensor([[0, 0, 0, 64, 0]] * 2, dtype=torch.int64), 1)
        seen.append((dict(coordinator.chosen), dict(coordinator.waiting)))
    waiting = ({"layers.0": "SFB"}, {"layers.0": "PowerSGD"})
    started = ({"layers.0": "PowerSGD"}, {})
    assert seen == [waiting, waiting, started, started], seen


def test_a_checkpoint_with_residuals_is_refused_where_it_cannot_resume(cluster):
    """Residuals (and layers on a lossy path) loaded into a wrapper without compression=, into another
    number of ranks, or in another layout: refused by name on every rank, instead of dropped or misread."""
    options = {"fusion_bytes": 0, "overrides": {layer.name: "PowerSGD" for layer in find_layers(build(SPEC, 0))},
               "compression": {"powersgd": {"start_iter": 1}}}
    for errors in cluster.run(cw.refused_states, SPEC, options):
        assert "neither names it in compression= nor forces it" in errors["without compression="], errors
        assert f"saved by {cluster.world_size + 1} ranks and this run has {cluster.world_size}" in \
            errors["other world size"], errors
        assert "'paths' must be {'world_size': P" in errors["old format"], errors
        assert "neither names in compression= nor forces" in errors["coordinator only"], errors


# ---- the option ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, error", [
    ("zip", "ValueError: PoseidonDDP option compression names 'zip'"),
    ({"powersgd": {"rnak": 2}}, "unknown setting(s) ['rnak']"),
    ({"powersgd": {"rank": 0}}, "'rank' must be at least 1"),
    (3, "TypeError: PoseidonDDP option compression must be"),
])
def test_bad_compression_values_are_refused_on_every_rank(cluster, value, error):
    for message in cluster.run(cw.construct, {"compression": value}):
        assert error in message, message


def test_compression_needs_hybrid_and_a_bsp_server_optimizer(cluster):
    for message in cluster.run(cw.construct, {"compression": "bf16", "hybrid": False}):
        assert "compression= chooses paths per layer, which needs hybrid=True" in message, message
    for server in ({"staleness": 1}, {"staleness": None}, {"delay": 1}):
        for message in cluster.run(cw.construct, {"compression": "powersgd"}, server):
            assert message.startswith("NotImplementedError") and "compressed pushes run with the BSP" in message, \
                (server, message)
    for message in cluster.run(cw.construct, {"compression": "int8"}, {}):
        assert message == ""
    for message in cluster.run(cw.construct, {"compression": {"powersgd": {"rank": 2}}}):
        assert message == ""


def test_a_refused_checkpoint_changes_nothing(cluster):
    """A state refused by its last part (PowerSGD's Q saved at rank 1, loaded where rank=2) leaves the
    wrapper as it was: not the Pipe-SGD gradients in flight nor the coordinator's passes, loaded before
    the refusal (the docs promise "refused by name, changing nothing")."""
    spec = ModelSpec(in_features=16, widths=(32, 32), out_features=4)
    overrides = {layer.name: "PowerSGD" for layer in find_layers(build(spec, 0))}
    saved_with = {"fusion_bytes": 0, "delay": 1, "overrides": overrides,
                  "compression": {"powersgd": {"rank": 1, "start_iter": 1}}}
    loaded_with = {**saved_with, "compression": {"powersgd": {"rank": 2, "start_iter": 1}}}
    for error, before, after in cluster.run(cw.refused_load_changes_nothing, spec, saved_with, loaded_with):
        assert error.startswith("path 'PowerSGD': the checkpoint") and " q " in error, error
        assert before.keys() == after.keys(), (before.keys(), after.keys())
        assert len(after["in_flight"]) == len(before["in_flight"]), after["in_flight"]
        assert after.get("coordinator") == before.get("coordinator"), (before, after)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]), st.integers(0, 300),
       st.data())
def test_the_finiteness_check_finds_any_nan_or_inf(dtype, numel, data):
    """``all_finite`` (one min/max pass; it decides whether a sync's residuals are kept) agrees with
    ``isfinite().all()`` wherever a NaN or an infinity stands, and on tensors at the dtype's extremes."""
    from poseidon_torch.paths.lossy import all_finite

    big = torch.finfo(dtype).max
    tensor = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0, -big, big]), min_size=numel,
                                             max_size=numel)), dtype=torch.float64).to(dtype)
    if numel:
        for value in data.draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]), max_size=3)):
            tensor[data.draw(st.integers(0, numel - 1))] = value
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


@pytest.mark.parametrize("path", ["PowerSGD", "INT8", "BF16", "FP16"])
def test_an_overflowed_step_leaves_the_residuals_as_they_were(cluster, path):
    """An inf in one rank's gradient (an fp16 overflow under GradScaler, which skips that step) gives a
    non-finite average on every rank for that step only (INT8: the inf's block scale is inf; BF16 / FP16:
    the inf travels as inf, only finite values saturate): the residuals (and PowerSGD's warm-start Q) stay
    as before it, instead of taking inf or NaN and making every later average non-finite (every later
    step skipped, for good, on the old code). The casts saturated the inf too: a finite average that
    GradScaler did not skip, and an inf residual that saturated every later sync of that entry."""
    for out in cluster.run(cw.overflow_once, LAYERS, path, 5, 2):  # the first pass is exact: no residual yet
        assert out["finite"] == [True, True, False, True, True], out["finite"]
        before, after = out["residuals"]
        assert before.keys() == after.keys()
        for name in [name for name in before if name.startswith("layers.0.")]:  # the inf's bucket (fusion_bytes=0)
            assert torch.equal(before[name], after[name]), name
