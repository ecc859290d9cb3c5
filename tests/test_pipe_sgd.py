"""Pipe-SGD (``PoseidonDDP(delay=k)``): the parameters of k-delayed SGD on the concatenated batch, the
gradient of exactly k steps earlier in ``.grad``, a sync that really runs on after ``backward()``,
checkpoints that carry the gradients in flight, and clear refusals."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import delay_workers as dw
import training
from models import ModelSpec, fc_specs, model_specs
from training import Run

REPO_ROOT = Path(__file__).resolve().parents[1]

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5


def assert_delayed_parity(results: list[dict], reference: dict, what: str) -> None:
    """Every rank's parameters match the single-process k-delayed run and are bit-identical to rank 0's."""
    rank0 = results[0]["state"]
    for name, value in reference["params"].items():
        torch.testing.assert_close(rank0[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {name} vs k-delayed SGD in one process: {m}")
    for rank, result in enumerate(results):
        for name in reference["params"]:
            assert torch.equal(result["state"][name], rank0[name]), f"{what}: rank {rank} diverged on {name}"


MATRIX = [(k, opt, force, engine) for k in (1, 2) for opt in ("sgd", "adamw") for force in (None, "PS", "SFB")
          for engine in ("native", "python")]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [ModelSpec(widths=(8, 5)), ModelSpec(widths=(6,), seq=3, tied=True)],
                         ids=["mlp", "seq-tied"])
def test_matches_k_delayed_sgd_every_path_core_and_optimizer(cluster, spec):
    """k = 1, 2 x SGD momentum, AdamW x hybrid (the coordinator's choice), PS, SFB (forced) x both cores."""
    runs = [Run(delay=k, optimizer=opt, options={"force": force, "engine": engine} if force else {"engine": engine})
            for k, opt, force, engine in MATRIX]
    results = cluster.run(training.train_runs, spec, runs, STEPS, 3, timeout=400)
    for i, (k, opt, force, engine) in enumerate(MATRIX):
        reference = training.pipe_sgd(spec, k, STEPS, 3, cluster.world_size, opt)
        what = f"delay={k} {opt} {force or 'hybrid'} {engine}"
        assert_delayed_parity([r[i] for r in results], reference, what)
        if force:  # the forced path really ran, on every bucket of the last steps
            assert set(results[0][i]["paths"][-1].values()) == {force}, what


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.one_of(model_specs(), fc_specs()), k=st.sampled_from([1, 2]), opt=st.sampled_from(["sgd", "adamw"]),
       force=st.sampled_from([None, "PS", "SFB"]), size=st.integers(1, 4))
def test_generated_models_match_k_delayed_sgd(cluster, spec, k, opt, force, size):
    options = {"force": force} if force else {"fusion_bytes": 512}
    results = cluster.run(training.train, spec, Run(delay=k, optimizer=opt, options=options), STEPS, size, timeout=200)
    assert_delayed_parity(results, training.pipe_sgd(spec, k, STEPS, size, cluster.world_size, opt), str(spec))


@pytest.mark.parametrize("k", [1, 2])
def test_each_step_applies_the_gradient_of_exactly_k_steps_earlier(cluster, k):
    """``.grad`` after backward t is the average of step t-k (None before): neither fresher nor staler."""
    spec = ModelSpec(widths=(7,))
    results = cluster.run(training.train, spec, Run(delay=k), STEPS, 2)
    reference = training.pipe_sgd(spec, k, STEPS, 2, cluster.world_size)
    for rank, result in enumerate(results):
        for step, (ours, theirs) in enumerate(zip(result["grads"], reference["grads"])):
            for name, expected in theirs.items():
                if expected is None:
                    assert ours[name] is None, f"rank {rank} step {step}: {name} has a gradient before step {k}"
                else:
                    torch.testing.assert_close(ours[name], expected, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    fresher = training.pipe_sgd(spec, k - 1, STEPS, 2, cluster.world_size)["grads"]
    assert not torch.allclose(fresher[k]["body.0.weight"], results[0]["grads"][k]["body.0.weight"])


@pytest.mark.parametrize("runs", [[Run(optimizer="adamw"), Run(optimizer="adamw", delay=0)],
                                  [Run(wrapper="server", optimizer="adamw"),
                                   Run(wrapper="server", optimizer="adamw", server={"delay": 0})]],
                         ids=["default", "server"])
def test_delay_zero_is_bit_identical_to_bsp(cluster, runs):
    """``delay=0`` and the argument left out give the same bits (PoseidonDDP, or ServerOptimizer)."""
    spec = ModelSpec(widths=(8, 5))
    results = cluster.run(training.train_runs, spec, runs, STEPS, 3)
    for default, zero in results:
        for name, value in default["state"].items():
            assert torch.equal(value, zero["state"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("server", [False, True], ids=["default", "server"])
def test_backward_returns_while_its_sync_still_runs(cluster, server):
    """Every sync job sleeps 0.4 s. Under BSP ``backward(); step()`` waits for them; with delay=1 both
    return with the jobs still running (it fails if step t's sync is waited for at the end of step t),
    given the rest of an iteration (1 s idle here) for them to end in."""
    bsp = cluster.run(dw.overlap, 0, 0.4, server)
    delayed = cluster.run(dw.overlap, 1, 0.4, server, 1.0)
    for rank in range(cluster.world_size):
        # (the first pass's buckets are rebuilt when it closes: from the second pass on)
        assert all(bsp[rank]["done_at_return"][1:]) and min(bsp[rank]["backward_s"]) >= 0.4, bsp[rank]
        assert not any(delayed[rank]["done_at_return"][1:]), delayed[rank]
        assert max(delayed[rank]["backward_s"][1:]) < 0.3, delayed[rank]


def test_the_next_forward_does_not_wait_for_the_last_sync(cluster):
    """Default mode, delay=1, jobs of 0.4 s and no idle time between steps: the forward of step t+1
    returns at once with step t's jobs still running, and the backward of step t+1 waits for them (before
    its first gradient counts): a step's sync has the next forward and the start of the next backward to
    end in (it fails if the forward waits for it)."""
    for rank, result in enumerate(cluster.run(dw.overlap, 1, 0.4)):
        assert not any(result["done_after_forward"][1:]), (rank, result)
        assert max(result["forward_s"][1:]) < 0.2 and min(result["backward_s"][1:]) > 0.2, (rank, result)


GLOO_LOOP_THREADS = {"gloo_tcp_loop", "pt_gloo_runloop"}  #: gloo's transport threads (torch 2.13, 2.11)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("delay", [0, 1])
def test_the_sync_threads_yield_the_cores_to_the_training_thread_only_under_pipe_sgd(cluster, delay, engine):
    """With delay=1 every thread the wrapper starts (its channels, its gloo groups' transport and worker
    threads) runs 10 nice steps below the training thread, whose own priority is left alone; under BSP
    they all keep the training thread's."""
    for rank, result in enumerate(cluster.run(dw.thread_priorities, delay, engine)):
        training_before, training_after = result["training"]
        assert training_after == training_before, (rank, result)
        names = [name for name, _ in result["started"].values()]
        loops = sum(name in GLOO_LOOP_THREADS for name in names)
        assert loops >= 4, (rank, result)  # control, data, a channel's up and down
        wanted = min(training_before + 10, 19) if delay else training_before
        assert {nice for _, nice in result["started"].values()} == {wanted}, (rank, result)


AFTER_MAIN_RETURNED = """
import os, threading, time
from poseidon_torch.pools import started_at_lower_priority

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

def started_thread_nice():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(nice()))
    thread.start()
    thread.join()
    return seen[0]

def train():
    time.sleep(0.3)  # the main thread has returned: interpreter shutdown has begun
    print("started", started_at_lower_priority(10, started_thread_nice) - nice())

threading.Thread(target=train).start()
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_sync_threads_start_from_a_training_thread_that_outlives_the_main_thread():
    """A training thread still running after the main thread returned starts the sync's threads at the
    lower priority (a ``concurrent.futures`` starter refused to: found by a break-test)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, "-c", AFTER_MAIN_RETURNED], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["started", "10"], done.stderr


FREED_UNCLOSED = """
import atexit, sys, weakref
import torch, torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", init_method=sys.argv[2], rank=int(sys.argv[1]), world_size=2)
kept = {}
# registered before poseidon_torch is imported, so it runs after poseidon_torch's own exit handler
atexit.register(lambda: print("engine", "closed" if kept["engine"].closed else "open",
                              "alive", "local" if kept["alive"]._engine is None else "started", flush=True))
from poseidon_torch import PoseidonDDP

def train():
    model = PoseidonDDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)), delay=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    kept["engine"], kept["wrapper"] = model._engine, weakref.ref(model)

train()
print("wrapper", "freed" if kept["wrapper"]() is None else "alive", flush=True)
kept["alive"] = PoseidonDDP(nn.Linear(8, 2), delay=1)  # one never closed, alive at exit
kept["alive"](torch.randn(4, 8)).sum().backward()
"""


@pytest.mark.slow
def test_the_engine_of_a_wrapper_freed_unclosed_is_closed_before_the_interpreters_teardown(tmp_path):
    """A training function returns without ``close()``: the wrapper is freed, its engine is not (its
    hooks and threads hold it) and the last step's sync and buffer broadcast are still in flight. Left
    to the interpreter's teardown, a collective ending there can abort the process; the exit handler
    closes the engine first, on every rank. A wrapper still alive at exit is closed as ``close()`` does:
    it then runs its module locally."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    init = f"file://{tmp_path / 'store'}"
    ranks = [subprocess.Popen([sys.executable, "-c", FREED_UNCLOSED, str(rank), init], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    for rank, process in enumerate(ranks):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0 and out.split() == ["wrapper", "freed", "engine", "closed", "alive", "local"], \
            f"rank {rank}: exit {process.returncode}\n{out}\n{err[-2000:]}"


@pytest.mark.parametrize("k,opt", [(1, "sgd"), (2, "adamw")])
def test_checkpoint_carries_the_gradients_in_flight(cluster, k, opt):
    for rank, result in enumerate(cluster.run(dw.checkpoint_resume, k, opt)):
        assert result["in_flight"] == k
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), f"rank {rank}: {name} after resuming"


@pytest.mark.parametrize("setup", sorted(dw.CHECKPOINTED_SETUPS))
def test_taking_checkpoints_leaves_the_trajectory_unchanged(cluster, setup):
    """A sync in flight at every step (Pipe-SGD ``delay=2``, a server's ``lazy_pull`` or ``delay=1``,
    periodic averaging with ``delay=1``): ``consistency_state_dict()`` and ``synchronize()`` after every
    step, training on, give the same parameters, bit for bit, as without them. On the old code Pipe-SGD's
    checkpoint closed the pass in flight early: the coordinator planned from its facts before the next
    forward, which committed the FC layers to SFB a step sooner (the trajectories then differ by rounding;
    at 2 ranks: at 3 this run happens to round the same)."""
    for rank, runs in enumerate(cluster.run(dw.checkpointing_keeps_the_trajectory, setup)):
        for name, value in runs["straight"].items():
            assert torch.equal(runs["checkpointed"][name], value), (rank, name)


def test_every_rank_raising_in_backward_drops_that_step_everywhere(cluster):
    """Every rank's backward raises at step 2 (a check every rank runs): all skip the step, the pipeline
    stays the same on every rank, and training continues as k-delayed SGD without that step."""
    spec = ModelSpec(widths=(8, 5))
    results = cluster.run(training.train, spec, Run(delay=1, skip=2), 6, 3)
    for result in results:
        assert result["errors"] == ["ValueError"], result["errors"]
    assert_delayed_parity(results, training.pipe_sgd(spec, 1, 6, 3, cluster.world_size, skip=2), "skip")


def test_one_rank_raising_in_backward_ends_training_everywhere_with_its_name(cluster):
    """With no barrier per step the other ranks return from that backward and step before they can
    learn of the exception, so the step cannot be skipped everywhere: every rank gets a SyncError naming
    the raising rank at its next synced backward, where the step settles (the raising rank after its own
    exception), and the engine refuses to go on after it."""
    last = cluster.world_size - 1
    for rank, events in enumerate(cluster.run(dw.raise_alone, 1)):
        own = [(2, "backward")] if rank == last else []
        assert [(step, where) for step, where, _ in events] == own + [(3, "backward"), (4, "forward")], events
        named = events[-2][2]
        assert named.startswith("SyncError") and f"rank(s) {last} raised" in named and "delay=1" in named, named
        assert "cannot continue after a failed sync" in events[-1][2], events


def test_a_gradient_late_on_every_rank_is_averaged_whole_one_step_late(cluster):
    """Reentrant checkpointing makes part of a layer's gradient arrive after its bucket's sync, on every
    rank: that pass is not deferred (every rank knows at once), is averaged whole and handed out k steps
    later, as k-delayed SGD."""
    results = cluster.run(dw.late_gradient_delayed, 1)
    reference = dw.reference_late_gradient(1, cluster.world_size)
    for rank, result in enumerate(results):
        assert all(result["late"][1:]), (rank, result["late"])  # it happened (from the learned buckets on)
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0, 1])
def test_a_late_rank_holds_the_others_back_only_under_bsp(cluster, delay):
    """The last rank starts step 2 a second late. Under BSP the others wait for it within that step (the
    buffers' broadcast, the facts, the sync); with delay=1 nothing in step t waits for another rank, so
    their step 2 takes what it takes alone. The parameters stay those of k-delayed SGD on every rank."""
    results = cluster.run(dw.late_rank, delay, 1.0)
    for rank, result in enumerate(results[:-1]):
        if delay:
            assert result["step_s"][2] < 0.5, (rank, result["step_s"])
        else:
            assert result["step_s"][2] >= 0.9, (rank, result["step_s"])
    spec = ModelSpec(conv_channels=(4,), batchnorm=True)
    assert_delayed_parity(results, training.pipe_sgd(spec, delay, 5, 2, cluster.world_size), f"delay={delay}")


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("replaced", [False, True], ids=["in-place", "replaced"])
def test_buffers_come_from_rank_0_one_step_late_under_pipe_sgd(cluster, delay, replaced):
    """The buffers as each synced forward starts (BatchNorm's running statistics, updated in place, and
    a buffer the model replaces in every forward): under BSP every rank's are rank 0's of this forward
    (torch DDP's broadcast); with delay=1 they are rank 0's of the forward before (sent then, landed
    now, into the buffers the module holds now), and rank 0's own evolve as they would alone."""
    seen = cluster.run(dw.buffers_at_forward, delay, replaced)
    rank0 = seen[0]
    moving = ["inner.features.1.running_mean", "output_mean"] if replaced else ["features.1.running_mean"]
    for name in moving:
        assert not torch.equal(rank0[1][name], rank0[2][name]), name
    for rank in range(1, cluster.world_size):
        for step, buffers in enumerate(seen[rank]):
            source = rank0[max(step - delay, 0)]
            for name, value in buffers.items():
                assert torch.equal(value, source[name]), f"rank {rank}, forward {step}: {name}"
            if delay and step:
                assert not any(torch.equal(buffers[name], rank0[step][name]) for name in moving)


@pytest.mark.parametrize("force", [None, "SFB"])
def test_no_sync_accumulation_is_one_delayed_step(cluster, force):
    """Three micro-batches per step, two under ``no_sync()``: their sum is the step's gradient, applied
    one step late (an SFB layer falls back to PS for the accumulated part, exactly)."""
    spec = ModelSpec(widths=(8, 5))
    options = {"force": force} if force else {}
    results = cluster.run(training.train, spec, Run(delay=1, options=options, accumulate=3), 4, 2)
    reference = training.pipe_sgd(spec, 1, 4, 2, cluster.world_size, accumulate=3)
    assert_delayed_parity(results, reference, f"no_sync {force}")


@pytest.mark.parametrize("what,message", [
    ("negative", "delay must be an int >= 0"), ("bool", "delay must be an int >= 0"),
    ("differs", "options differ"), ("join", "not supported with delay=1"),
    ("server", "not supported yet"), ("wrong_state", "saved with delay=2"),
    ("server_negative", "delay must be an int >= 0"), ("server_differs", "differs between rank 0 and rank 1: delay: "),
])
def test_misuse_is_refused_clearly(cluster, what, message):
    for error in cluster.run(dw.refused, what):
        assert message in error, error


# ---- parameter-server mode: ServerOptimizer(..., delay=k) ------------------------------------------

SERVER_MATRIX = [(k, opt, force, engine) for k in (1, 2) for opt in ("sgd", "adamw") for force in (None, "PS", "SFB")
                 for engine in ("native", "python")]


def assert_server_delayed(results: list[dict], reference: dict, what: str) -> None:
    """Every forward read w_{t-k} (neither fresher nor staler), the newest values are those of the
    recurrence w_{t+1} = opt(w_t, g_t(w_{max(t-k, 0)})), on every rank, bit-identical between ranks."""
    assert_delayed_parity(results, reference, what)
    for rank, result in enumerate(results):
        for step, (ours, theirs) in enumerate(zip(result["read"], reference["read"])):
            for name, value in theirs.items():
                torch.testing.assert_close(ours[name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{what}: rank {rank} forward {step} read {name}: {m}")
        newest = dict(result["in_flight"]["held"][-1][1])
        for name, value in reference["newest"].items():
            torch.testing.assert_close(newest[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what}: rank {rank} newest {name}: {m}")


@pytest.mark.slow
def test_server_delay_follows_the_pipe_sgd_recurrence(cluster):
    """k = 1, 2 x SGD momentum, AdamW x hybrid, PS, SFB (forced) x both cores."""
    spec = ModelSpec(widths=(8, 5))
    runs = [Run(wrapper="server", server={"delay": k}, optimizer=opt,
                options={"force": force, "engine": engine} if force else {"engine": engine})
            for k, opt, force, engine in SERVER_MATRIX]
    results = cluster.run(training.train_runs, spec, runs, STEPS, 3, timeout=400)
    for i, (k, opt, force, engine) in enumerate(SERVER_MATRIX):
        what = f"server delay={k} {opt} {force or 'hybrid'} {engine}"
        reference = training.server_pipe_sgd(spec, k, STEPS, 3, cluster.world_size, opt)
        assert_server_delayed([r[i] for r in results], reference, what)
        if force:
            assert set(results[0][i]["paths"][-1].values()) == {force}, what


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.one_of(model_specs(), fc_specs()), k=st.sampled_from([1, 2]), opt=st.sampled_from(["sgd", "adamw"]),
       force=st.sampled_from([None, "PS", "SFB"]))
def test_server_delay_generated_models(cluster, spec, k, opt, force):
    options = {"force": force} if force else {"fusion_bytes": 512}
    run = Run(wrapper="server", server={"delay": k}, optimizer=opt, options=options)
    results = cluster.run(training.train, spec, run, STEPS, 2, timeout=200)
    reference = training.server_pipe_sgd(spec, k, STEPS, 2, cluster.world_size, opt)
    assert_server_delayed(results, reference, str(spec))


@pytest.mark.parametrize("k", [1, 2])
def test_server_checkpoint_carries_the_values_in_flight(cluster, k):
    for rank, result in enumerate(cluster.run(dw.server_checkpoint_resume, k)):
        straight, resumed = result["straight"]["held"], result["resumed"]["held"]
        assert [offset for offset, _ in straight] == [offset for offset, _ in resumed] and len(straight) == k
        for (_, ours), (_, theirs) in zip(resumed, straight):
            for name, value in theirs.items():
                assert torch.equal(ours[name], value), f"rank {rank}: {name} in flight after resuming"
        for name, value in result["straight"]["state"].items():
            assert torch.equal(result["resumed"]["state"][name], value), f"rank {rank}: {name} after resuming"


# ---- what a break-test found: misuse refused, the last step's exception, the final model ---------------

@pytest.mark.parametrize("loop", ["accumulate_without_no_sync", "retained_graph", "previous_steps_graph",
                                  "never_zero_grad"])
def test_more_than_one_synced_backward_per_step_is_refused(cluster, loop):
    """Each synced backward is one step of the pipeline: a loop that runs two per optimizer step (or
    never clears the handed-out gradient) would sync a mix of steps; it gets a clear error on every rank."""
    for error in cluster.run(dw.misused_loop, loop):
        assert "synced backward" in error and ("no_sync()" in error), error


@pytest.mark.parametrize("delay", [0, 1])
def test_an_exception_in_the_last_step_is_named_at_once(cluster, delay):
    """The raising rank closes its wrapper after the last step: its close runs the aborted pass's
    collectives, so the others get the SyncError naming it at once, not a timeout."""
    results = cluster.run(dw.raise_in_last_step, delay)
    last = cluster.world_size - 1
    for rank, result in enumerate(results):
        if rank == last:
            assert result["outcome"].startswith("ValueError"), result
        elif delay:  # the others' backward returned; their close() finds it
            assert f"rank(s) {last}" in result["closed"] and result["close_s"] < 20, result
        else:
            assert f"rank(s) {last}" in result["outcome"] and result["waited_s"] < 20, result


@pytest.mark.parametrize("k", [1, 2])
def test_server_parameters_are_what_the_next_forward_reads_and_finish_lands_the_newest(cluster, k):
    reference = training.server_pipe_sgd(ModelSpec(widths=(8, 5)), k, dw.STEPS_FINAL, 3, cluster.world_size)
    for rank, result in enumerate(cluster.run(dw.server_final_model, k)):
        for name, value in reference["params"].items():  # the forward of step STEPS_FINAL would read these
            torch.testing.assert_close(result["after"][name], value, rtol=RTOL, atol=ATOL)
            assert torch.equal(result["after_eval"][name], result["after"][name]), f"rank {rank}: eval moved {name}"
            assert torch.equal(result["finished"][name], result["newest"][name]), f"rank {rank}: finish() {name}"


@pytest.mark.parametrize("order", ["model,consistency", "consistency,model"])
def test_server_resume_in_either_order_and_bad_states_change_nothing(cluster, order):
    for result in cluster.run(dw.server_resume_order, order):
        assert len(result["errors"]) == 4, result["errors"]
        assert "saved by PoseidonDDP(delay=k)" in result["errors"][0]
        assert "delay=True" in result["errors"][1] and "'x'" in result["errors"][2] and "(2, 2)" in result["errors"][3]
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("server", [False, True], ids=["default-mode", "server-mode"])
def test_a_dead_peer_ends_training_within_the_timeout_and_close_returns(fresh_cluster, server):
    outcomes = fresh_cluster.run_outcomes(dw.peer_exits_under_delay, server, timeout=90)
    assert 1 not in outcomes and fresh_cluster.exit_code(1) == 3
    survivor = outcomes[0]
    assert survivor.ok, survivor.value
    r = survivor.value
    assert r["error_type"] in ("SyncError", "SyncTimeout"), r
    assert r["elapsed"] < 2 * dw.DEAD_PEER_TIMEOUT_S + 5, r  # the step in flight and the next wait at most
    assert "cannot continue after a failed sync" in r["after"], r
    assert r["closed"] == "" and r["close_s"] < 5, r

