"""Lightning, accelerate and the HF Trainer on PoseidonDDP give the parameters of the framework's own DDP
path (bit-identical at P = 2, where the two averages are the same arithmetic; within rtol 1e-5 where
the server clips or sums in another order), default mode and ServerOptimizer, with clipping and
gradient accumulation (issue 19); and they do what the user asked of the framework (issue 44): its
mixed precision, compile and DDP arguments, exact Pipe-SGD resumes, consistent ranks after a
ServerOptimizer's fit, no double wrapping."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import integration_workers

RTOL, ATOL = 1e-5, 1e-6

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def hf_train(cluster, wrapper: str, server, root, steps: int = 4, save_every: int = 0, stop_at: int = 0,
             resume: bool = False, training: dict | None = None, poseidon: dict | None = None, network: str = "gpt2",
             timeout: float = 180) -> list:
    return cluster.run(integration_workers.hf_train, wrapper, server, str(root), steps, save_every, stop_at, resume,
                       training, poseidon, network, timeout=timeout)


def assert_same(ours: dict, theirs: dict, exact: bool) -> None:
    for name, value in theirs.items():
        if exact:
            assert torch.equal(ours[name], value), f"{name}: max diff {(ours[name] - value).abs().max()}"
        else:
            torch.testing.assert_close(ours[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("server, clip", [(False, 1.0), (True, 1.0), (True, 0.0)],
                         ids=["default-mode", "server-mode", "server-mode-no-clipping"])
def test_hf_trainer_matches_hf_ddp(cluster, tmp_path, server, clip):
    """Without clipping the Trainer still logs the norm (of the averaged gradients, under DDP): in server
    mode the owners compute it too (issue 44 item 10: the local norm was logged)."""
    training = {"max_grad_norm": clip}
    theirs = hf_train(cluster, "ddp", False, tmp_path, training=training)
    ours = hf_train(cluster, "poseidon", server, tmp_path, training=training)
    for mine, ref in zip(ours, theirs):
        assert_same(mine["params"], ref["params"], exact=not server and cluster.world_size == 2)
        assert len(mine["norms"]) == len(ref["norms"]) == 4
        torch.testing.assert_close(torch.tensor(mine["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=0)


@pytest.mark.slow
def test_hf_trainer_checkpoint_with_server_optimizer_resumes_exactly(cluster, tmp_path):
    """The Trainer's own checkpoint (optimizer.pt gathered from the shards on the main process) and its
    resume give the parameters of an uninterrupted run."""
    whole = hf_train(cluster, "poseidon", True, tmp_path / "whole")
    hf_train(cluster, "poseidon", True, tmp_path / "cut", 4, 2, 2)
    resumed = hf_train(cluster, "poseidon", True, tmp_path / "cut", 4, 2, 0, True)
    for mine, ref in zip(resumed, whole):
        assert_same(mine["params"], ref["params"], exact=False)


# ---- issue 44: what the user asked of the framework ----------------------------------------------------

def test_lightning_server_optimizer_fit_ends_consistent_and_can_be_saved(cluster, tmp_path):
    """Items 4, 6, 7 in one fit: PoseidonStrategy(timeout=60) in seconds reaches PoseidonDDP and Lightning
    (as the timedelta its process group takes); after fit with ServerOptimizer(staleness=2) every rank
    holds the same parameters (finish() at the end of fit), and trainer.save_checkpoint works after fit:
    the file holds those parameters and AdamW's whole state, gathered from the shards."""
    results = cluster.run(integration_workers.lightning_server_lifecycle, str(tmp_path), timeout=180)
    for result in results:
        assert result["poseidon timeout"] == 60.0
        assert result["process group timeout"] == timedelta(seconds=60)
        assert result["saved"] == "saved", result["saved"]
    final = results[0]["params"]
    assert any(not torch.equal(final[n], results[0]["initial"][n]) for n in final)  # it trained
    for result in results[1:]:
        assert_same(result["params"], final, exact=True)
    checkpoint = results[0]["checkpoint"]
    assert_same(checkpoint["params"], final, exact=True)
    state = checkpoint["optimizer"]["state"]
    assert sorted(state) == list(range(len(results[0]["shapes"])))
    for key, shape in enumerate(results[0]["shapes"]):
        assert tuple(state[key]["exp_avg"].shape) == shape and tuple(state[key]["exp_avg_sq"].shape) == shape


@pytest.mark.parametrize("timeout", ["60", -1, 0, float("inf"), float("nan"), timedelta(seconds=-5), timedelta(0)])
def test_lightning_strategy_refuses_a_bad_timeout_by_name(timeout):
    """A timeout Lightning's process group and PoseidonDDP cannot take is refused at construction, naming
    the option (inf raised OverflowError, a timedelta <= 0 was accepted)."""
    from poseidon_torch.integrations.lightning import PoseidonStrategy

    with pytest.raises(TypeError, match="PoseidonStrategy option timeout"):
        PoseidonStrategy(timeout=timeout)


@pytest.mark.parametrize("first", ["first", "first-saved-after-fit"], ids=["ModelCheckpoint", "save_checkpoint-after-fit"])
def test_lightning_pipe_sgd_resumes_exactly(cluster, tmp_path, first):
    """Item 3: PoseidonStrategy(delay=1) interrupted after its first epoch (Lightning's ModelCheckpoint,
    or trainer.save_checkpoint once fit returned and teardown closed the wrapper) and resumed gives the
    uninterrupted run's parameters bit for bit: the checkpoint carries the averaged gradients in flight
    (saved after fit, it lacked them: 2.4e-2 away). That state is the same on every rank, so rank 0's
    file serves all."""
    whole = cluster.run(integration_workers.lightning_pipe_sgd_resume, str(tmp_path / "whole"), "whole", timeout=180)
    cut = str(tmp_path / "cut")
    first = cluster.run(integration_workers.lightning_pipe_sgd_resume, cut, first, timeout=180)
    resumed = cluster.run(integration_workers.lightning_pipe_sgd_resume, cut, "resume", timeout=180)
    in_flight = first[0]["in_flight"]["in_flight"]
    assert len(in_flight) == 1 and in_flight[0]
    for other in first[1:]:
        for name, grad in in_flight[0].items():
            assert torch.equal(grad, other["in_flight"]["in_flight"][0][name]), name
    for mine, ref in zip(resumed, whole):
        assert_same(mine["params"], ref["params"], exact=True)


def test_lightning_refuses_a_pipe_sgd_checkpoint_in_another_mode_saying_what_to_do(cluster, tmp_path):
    """A delay=1 checkpoint resumed with delay=0 would drop the pending step: refused on every rank, naming
    both delays and the two ways out (resume with delay=1, or delete the checkpoint's entry)."""
    cut = str(tmp_path / "cut")
    cluster.run(integration_workers.lightning_pipe_sgd_resume, cut, "first", timeout=180)
    for outcome in cluster.run(integration_workers.lightning_pipe_sgd_resume, cut, "resume-bsp", timeout=180):
        error = outcome["error"]
        assert error is not None and "delay=1" in error and "delay=0" in error, error
        assert "resume with delay=1" in error and "'poseidon_consistency'" in error, error


def _periodic_reference(results: list[dict], accumulate: int, sync_every: int, delay: int) -> list[dict]:
    """Local SGD in one process on the batches each rank trained on: one replica per rank from the same
    start, AdamW on the mean over its ``accumulate`` micro-batches per step (Lightning divides each
    micro-batch's loss by it), the parameters averaged (summed in rank order, / P) after every
    ``sync_every``-th step and landing ``delay`` steps later with the steps taken meanwhile on top."""
    replicas = []
    for result in results:
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        net.load_state_dict({name.removeprefix("net."): value for name, value in result["initial"].items()})
        replicas.append((net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05), result["batches"]))
    landing = None
    for step in range(len(results[0]["batches"]) // accumulate):
        for net, opt, batches in replicas:
            opt.zero_grad()
            for x, y in batches[step * accumulate:(step + 1) * accumulate]:
                (F.mse_loss(net(x), y) / accumulate).backward()
            opt.step()
        with torch.no_grad():
            if landing is not None and landing[0] == step + 1:
                for (net, _, _), sent in zip(replicas, landing[2]):
                    for p, average, was in zip(net.parameters(), landing[1], sent):
                        drift = p - was
                        p.copy_(average).add_(drift)
                landing = None
            if (step + 1) % sync_every == 0:
                columns = list(zip(*(list(net.parameters()) for net, _, _ in replicas)))
                averages = [sum(column[1:], column[0].clone()) / len(column) for column in columns]
                sent = [[p.detach().clone() for p in net.parameters()] for net, _, _ in replicas]
                landing = (step + 1 + delay, averages, sent)
                if not delay:
                    for net, _, _ in replicas:
                        for p, average in zip(net.parameters(), averages):
                            p.copy_(average)
                    landing = None
    return [{"net." + name: p.detach().clone() for name, p in net.named_parameters()} for net, _, _ in replicas]


@pytest.mark.parametrize("accumulate, delay", [(1, 0), (2, 0), (1, 1)], ids=["plain", "accumulate-2", "delay-1"])
def test_lightning_periodic_averaging_equals_the_simulation(cluster, tmp_path, accumulate, delay):
    """PoseidonStrategy(sync_every=2) for 6 optimizer steps: every rank's parameters equal local SGD in one
    process on the batches that rank saw (rtol 1e-5), with optimizer steps counted, not batches (Lightning's
    gradient accumulation), and with delay=1; syncs after steps 2, 4 and 6 (with a delay counted when they
    land, the last one when fit ends)."""
    options = {"sync_every": 2, "delay": delay}
    results = cluster.run(integration_workers.lightning_periodic, str(tmp_path), accumulate, options)
    reference = _periodic_reference(results, accumulate, 2, delay)
    for rank, (result, expected) in enumerate(zip(results, reference)):
        assert len(result["batches"]) == 6 * accumulate
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        steps = [(b + 1) // accumulate for b in range(6 * accumulate)]  # optimizer steps after each batch
        assert result["syncs"] == [len([k for k in (2, 4, 6) if k + delay <= s]) for s in steps], result["syncs"]
    same = torch.equal(results[0]["params"]["net.0.weight"], results[1]["params"]["net.0.weight"])
    assert same == (delay == 0)  # the last sync lands in step 6, or (delay=1) never: each rank keeps its own


@pytest.mark.parametrize("steps", [4, 3])
def test_hf_trainer_honours_sync_every(cluster, tmp_path, steps):
    """poseidon_options={"sync_every": 2} under the Trainer's gradient accumulation (2 micro-batches per
    step): it syncs after every 2nd optimizer step, not micro-batch (2 syncs in 4 steps, 1 in 3), the ranks
    hold the same parameters after a step that synced and their own after one that did not, and the
    result is not BSP's."""
    ours = hf_train(cluster, "poseidon", False, tmp_path, steps=steps, poseidon={"timeout": 60, "sync_every": 2})
    bsp = hf_train(cluster, "poseidon", False, tmp_path / "bsp", steps=steps)
    assert all(result["syncs"] == steps // 2 for result in ours), [result["syncs"] for result in ours]
    assert all(result["options"].periodic.sync_every == 2 for result in ours)
    same = all(torch.equal(value, ours[1]["params"][name]) for name, value in ours[0]["params"].items())
    assert same == (steps % 2 == 0)
    assert any(not torch.equal(value, bsp[0]["params"][name]) for name, value in ours[0]["params"].items())


def test_pytorch_lightning_takes_the_strategy_by_name(cluster, tmp_path):
    """Item 8: under the pytorch_lightning package name, strategy="poseidon" (registered when
    poseidon_torch.integrations.pytorch_lightning is imported) trains as lightning's own DDP does."""
    kwargs = dict(clip=0.5, accumulate=2, root=str(tmp_path))
    theirs = cluster.run(integration_workers.lightning_fit, "ddp", False, *kwargs.values(), timeout=180)
    ours = cluster.run(integration_workers.lightning_fit, "poseidon-by-name", False, *kwargs.values(),
                       "pytorch_lightning", timeout=180)
    for mine, ref in zip(ours, theirs):
        assert mine["strategy"] == "poseidon_torch.integrations.pytorch_lightning" and mine["unwrapped"]
        assert_same(mine["params"], ref["params"], exact=False)  # SFB may be chosen: rounding-level


@pytest.mark.slow
def test_hf_trainer_honours_bf16_and_the_ddp_arguments(cluster, tmp_path):
    """Item 1: bf16=True trains under bf16 autocast as the Trainer's DDP does (bf16 rounding apart, and
    clearly apart from fp32), and ddp_broadcast_buffers, ddp_bucket_cap_mb, ddp_timeout reach PoseidonDDP."""
    bf16 = {"bf16": True, "ddp_broadcast_buffers": False, "ddp_bucket_cap_mb": 1, "ddp_timeout": 123}
    theirs = hf_train(cluster, "ddp", False, tmp_path, training=bf16)
    ours = hf_train(cluster, "poseidon", False, tmp_path, training=bf16, poseidon={})
    fp32 = hf_train(cluster, "poseidon", False, tmp_path)
    for mine, ref, full in zip(ours, theirs, fp32):
        same = max(float((mine["params"][n] - ref["params"][n]).abs().max()) for n in ref["params"])
        apart = max(float((mine["params"][n] - full["params"][n]).abs().max()) for n in full["params"])
        print(f"bf16: {same:.3g} from DDP's bf16 run, {apart:.3g} from fp32")
        assert apart > 1e-3, apart
        assert same == 0 if cluster.world_size == 2 else same < apart / 10, same
        options = mine["options"]
        assert (options.broadcast_buffers, options.fusion_bytes, options.timeout) == (False, 1 << 20, 123.0)


@pytest.mark.slow
def test_hf_trainer_compiles_as_the_trainers_ddp_does(cluster, tmp_path):
    """Item 1: torch_compile=True compiles the model under PoseidonDDP into as many graphs as under the
    Trainer's DDP (dynamo splits both at the bucket cap), and trains to the same parameters. A small
    language model rather than GPT-2: dynamo traces it in seconds (aot_eager: no code generation)."""
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    theirs = hf_train(cluster, "ddp", False, tmp_path, 2, training=compiled, network="tiny")
    ours = hf_train(cluster, "poseidon", False, tmp_path, 2, training=compiled, network="tiny")
    for mine, ref in zip(ours, theirs):
        assert mine["graphs"] == ref["graphs"] > 0
        assert_same(mine["params"], ref["params"], exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("server, poseidon", [(False, {"timeout": 60, "delay": 1}), ({"delay": 1}, {"timeout": 60})],
                         ids=["PoseidonDDP-delay", "ServerOptimizer-delay"])
def test_hf_trainer_pipe_sgd_resumes_exactly(cluster, tmp_path, server, poseidon):
    """Item 3: interrupted after step 2 and resumed from its checkpoint, a delay=1 run (PoseidonDDP's,
    or the ServerOptimizer's: both run under the Trainer) gives the uninterrupted run's parameters,
    bit for bit for PoseidonDDP at P = 2; the checkpoint carries the state in flight."""
    whole = hf_train(cluster, "poseidon", server, tmp_path / "whole", poseidon=poseidon)
    first = hf_train(cluster, "poseidon", server, tmp_path / "cut", 4, 2, 2, poseidon=poseidon)
    assert "poseidon_consistency.pt" in first[0]["files"]
    resumed = hf_train(cluster, "poseidon", server, tmp_path / "cut", 4, 2, 0, True, poseidon=poseidon)
    for mine, ref in zip(resumed, whole):
        assert_same(mine["params"], ref["params"], exact=not server and cluster.world_size == 2)


def test_hf_trainer_runs_ssp_and_async_and_refuses_what_it_cannot_do(cluster, tmp_path):
    """Item 9: server_optimizer={"staleness": 2} (SSP) and {"staleness": None, "push_every": 2} (Downpour)
    train (no clipping: no averaged gradient exists there, so no norm is logged) and end with every rank
    on the owners' newest values; a ServerOptimizer option given to PoseidonDDP, a ServerOptimizer built
    by hand, and SSP with clipping are refused, each saying what to do."""
    for server in ({"staleness": 2}, {"staleness": None, "push_every": 2}):
        results = hf_train(cluster, "poseidon", server, tmp_path, training={"max_grad_norm": 0.0})
        initial = integration_workers.tiny_gpt2().state_dict()
        assert any(not torch.equal(results[0]["params"][n], initial[n]) for n in results[0]["params"]), server
        for result in results[1:]:
            assert_same(result["params"], results[0]["params"], exact=True)
        assert all(result["norms"] == [] for result in results)
    for said in cluster.run(integration_workers.hf_refusals, str(tmp_path / "refusals"), timeout=180):
        assert said["staleness in poseidon_options"].startswith("ValueError") and \
            "server_optimizer={'staleness': 2}" in said["staleness in poseidon_options"]
        assert "server_optimizer=True" in said["ServerOptimizer in optimizers="]
        assert "max_grad_norm=0" in said["staleness with clipping"]


def test_accelerate_trains_on_poseidon_ddp_and_refuses_the_double_wrap(cluster):
    """Item 2: PoseidonAccelerator (accumulation 2 and clipping through accelerate) gives accelerate's own
    DDP run's parameters and norms, bit for bit at P = 2, and unwraps to the model; plain accelerate given
    a PoseidonDDP wraps it in torch DDP, which PoseidonDDP refuses at the first forward, naming the fix."""
    theirs = cluster.run(integration_workers.accelerate_train, "ddp", timeout=180)
    ours = cluster.run(integration_workers.accelerate_train, "poseidon", timeout=180)
    double = cluster.run(integration_workers.accelerate_train, "double", timeout=180)
    for mine, ref, twice in zip(ours, theirs, double):
        assert ref["outcome"] == mine["outcome"] == "trained" and mine["unwrapped"] and ref["unwrapped"]
        assert mine["wrapped in"] == "PoseidonDDP" and len(mine["norms"]) == len(ref["norms"]) > 0
        assert_same(mine["params"], ref["params"], exact=cluster.world_size == 2)
        torch.testing.assert_close(torch.tensor(mine["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=0)
        assert twice["wrapped in"] == "DistributedDataParallel"
        assert "PoseidonAccelerator" in twice["outcome"] and "synced twice" in twice["outcome"]
        assert "prepare the plain model" in twice["refused"]


def test_accelerate_save_state_with_server_optimizer_resumes(cluster, tmp_path):
    """accelerate's save_state asks every rank's optimizer for its state_dict(): with server_optimizer=True
    the state is gathered from the shards on every rank first (it raised on every rank, and on rank 1
    also after consolidate_state_dict(to=0)), and load_state continues the uninterrupted run."""
    for result in cluster.run(integration_workers.accelerate_server_save_state, str(tmp_path), timeout=180):
        assert result["saved"] == "saved", result["saved"]
        assert_same(result["resumed"], result["whole"], exact=False)
