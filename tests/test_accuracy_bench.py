"""The time-to-accuracy benchmark (``python -m poseidon_torch.bench.accuracy``) is honest.

- BSP modes compute DDP's gradients, so their validation loss against steps coincides with torch DDP's
  (same seeds, same data order); a mode that never syncs (``compute-only``) must fail the same check.
- A persistent straggler's steps really take about ``factor`` times as long; transient pauses follow
  their seeded draw; a slow link is shaped at its own rate, and a link of 100 Mbit/s or 10 Mbit/s carries
  a known payload at that rate (netns, root only).
- The command runs end to end on tiny settings (CI smoke): table, figure, results.json, progress lines,
  and a time budget that stops every rank after the same step.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from poseidon_torch.bench.accuracy.__main__ import parse_args as parse_accuracy_args
from poseidon_torch.bench.accuracy.report import divergence_from, slowest_level_speedup, time_to, value_at
from poseidon_torch.bench.accuracy.stragglers import Straggler, parse_straggler
from poseidon_torch.bench.launch import RankFailure, run_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 480  # the digits smoke run: eight modes, up to two worker processes each, on a shared machine
#: a module-scoped run is set up inside its first test: that test's limit must cover it
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)
BSP_MODES = ("poseidon-ps", "poseidon-hybrid", "poseidon-server-lazy")
BASELINES = ("torch-ddp-powersgd", "torch-ddp-localsgd", "one-host")
PERIODIC = ("poseidon-localsgd", "poseidon-diloco")
#: fp32 noise of a differently ordered gradient sum, after a dozen AdamW steps, is ~1e-7 relative
BSP_TOLERANCE = 1e-5


def run_accuracy(out: Path, *args: str, tiny: bool = True) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    command = [sys.executable, "-m", "poseidon_torch.bench.accuracy", "--mode", "localhost", "--hosts", "2",
               *["--tiny"] * tiny, "--timeout", "120", "--out", str(out), *args]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    results = out / "results.json"
    assert results.is_file(), f"no results.json; exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done, json.loads(results.read_text())


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("accuracy")
    done, report = run_accuracy(out, "--task", "digits", "--steps", "12", "--eval-every", "3",
                                "--straggler", "transient:p=0.3,delay=5ms,seed=3", "--powersgd-start-iter", "2",
                                "--modes", ",".join(("torch-ddp", *BSP_MODES, "compute-only", *BASELINES, *PERIODIC)))
    return done, report, out


def _ok(report: dict, mode: str) -> dict:
    run = report["modes"][mode]
    assert "error" not in run, run.get("error", "") + "\n" + run.get("log_tail", "")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", BSP_MODES)
def test_bsp_modes_follow_torch_ddp_against_steps(digits_run: tuple, mode: str) -> None:
    _, report, _ = digits_run
    ddp, run = _ok(report, "torch-ddp"), _ok(report, mode)
    assert [p["step"] for p in run["evals"]] == [0, 3, 6, 9, 12]
    assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"]  # it trained
    assert divergence_from(ddp["evals"], run["evals"], "val_loss") <= BSP_TOLERANCE
    assert run["divergence_from_ddp"] <= BSP_TOLERANCE
    np.testing.assert_allclose(run["train_loss_rank0"], ddp["train_loss_rank0"], rtol=BSP_TOLERANCE)


@pytest.mark.slow
def test_a_run_that_never_syncs_fails_the_parity_check(digits_run: tuple) -> None:
    _, report, _ = digits_run
    ddp, alone = _ok(report, "torch-ddp"), _ok(report, "compute-only")
    assert divergence_from(ddp["evals"], alone["evals"], "val_loss") > 10 * BSP_TOLERANCE


@pytest.mark.slow
def test_transient_pauses_follow_their_seeded_draw(digits_run: tuple) -> None:
    _, report, _ = digits_run
    spec = parse_straggler("transient:p=0.3,delay=5ms,seed=3", 2)
    expected = [sum(spec.pause_s(rank, step, 0.0) for step in range(12)) for rank in range(2)]
    assert expected[0] + expected[1] > 0  # the draw paused someone: the check below is not 0 == 0
    for mode in ("torch-ddp", *BSP_MODES):
        assert _ok(report, mode)["pause_s_by_rank"] == pytest.approx(expected)


@pytest.mark.slow
def test_the_smoke_run_writes_table_figure_and_progress(digits_run: tuple) -> None:
    done, report, out = digits_run
    assert done.returncode == 0, done.stderr
    assert (out / "results.png").stat().st_size > 0
    assert "| torch-ddp | 12 |" in done.stdout and "s to" in done.stdout
    assert "[poseidon-ps] step 12" in done.stderr
    assert report["target"] == _ok(report, "torch-ddp")["evals"][-1]["val_loss"]
    assert _ok(report, "torch-ddp")["time_to_target_s"] is not None
    assert report["config"]["straggler_spec"]["kind"] == "transient"


@pytest.mark.slow
def test_powersgd_follows_ddp_until_it_compresses_then_sends_fewer_bytes(digits_run: tuple) -> None:
    """torch's PowerSGD hook, started at step 2: its first two steps all-reduce plainly, so the losses of
    steps 1-3 are DDP's bit for bit; from step 3 on it sends rank-4 factors: different losses, and (bytes
    each rank's process wrote while training) a third fewer bytes per step than DDP on this small CNN,
    whose convolutions and last layer are too small to compress."""
    _, report, _ = digits_run
    ddp, power = _ok(report, "torch-ddp"), _ok(report, "torch-ddp-powersgd")
    assert power["train_loss_rank0"][:3] == ddp["train_loss_rank0"][:3]
    assert power["train_loss_rank0"][3:] != ddp["train_loss_rank0"][3:]
    assert power["bytes_source"] == ddp["bytes_source"] == "sent"
    assert all(p < 0.8 * d for p, d in zip(power["bytes_per_step_by_rank"], ddp["bytes_per_step_by_rank"]))
    assert report["config"]["baselines"]["torch-ddp-powersgd"]["start_powerSGD_iter"] == 2


@pytest.mark.slow
def test_local_sgd_ranks_differ_between_averages_and_agree_after_the_final_one(digits_run: tuple) -> None:
    """Period 4, no warm-up: steps 1, 5 and 9 average the parameters; after step 12 the ranks hold
    different ones, the final average gives every rank the same bits (BSP's ranks agree throughout), and it
    sent about a quarter of DDP's bytes per step."""
    _, report, _ = digits_run
    local, ddp = _ok(report, "torch-ddp-localsgd"), _ok(report, "torch-ddp")
    before = [d["before_final_average"] for d in local["param_digests_by_rank"]]
    after = [d["final"] for d in local["param_digests_by_rank"]]
    assert before[0] != before[1] and after[0] == after[1]
    assert len({d["final"] for d in ddp["param_digests_by_rank"]}) == 1
    assert all(0.15 * d < b < 0.5 * d for b, d in zip(local["bytes_per_step_by_rank"], ddp["bytes_per_step_by_rank"]))
    assert [p["step"] for p in local["evals"]] == [0, 3, 6, 9, 12]


@pytest.mark.slow
@pytest.mark.parametrize("mode", PERIODIC)
def test_periodic_modes_sync_every_local_sgd_period(digits_run: tuple, mode: str) -> None:
    """PoseidonDDP(sync_every=4): steps 4 and 8 sync, so after step 12 (which syncs too) the ranks agree,
    with no final average needed (digests equal before it); about a quarter of DDP's bytes per step; the
    same evaluation grid as the others."""
    _, report, _ = digits_run
    run, ddp = _ok(report, mode), _ok(report, "torch-ddp")
    digests = run["param_digests_by_rank"]
    assert digests[0]["before_final_average"] == digests[1]["before_final_average"] == digests[0]["final"]
    assert all(0.15 * d < b < 0.5 * d for b, d in zip(run["bytes_per_step_by_rank"], ddp["bytes_per_step_by_rank"]))
    assert [p["step"] for p in run["evals"]] == [0, 3, 6, 9, 12]
    assert run["train_loss_rank0"][:1] == ddp["train_loss_rank0"][:1]  # the same start, then its own path


@pytest.mark.slow
def test_one_host_trains_alone_on_its_shard(digits_run: tuple) -> None:
    """One process, no peer, nothing sent; it reads host 0's shard of the two: its losses are those of
    compute-only's rank 0 (the same shard, alone) bit for bit, and so are its final parameters."""
    done, report, _ = digits_run
    alone, compute_only = _ok(report, "one-host"), _ok(report, "compute-only")
    assert alone["world_size"] == 1 and alone["data_shards"] == 2 and alone["bytes_per_step_by_rank"] == [0.0]
    assert alone["train_loss_rank0"] == compute_only["train_loss_rank0"]
    assert alone["param_digests_by_rank"][0] == compute_only["param_digests_by_rank"][0]
    assert alone["speedup_over"]["one-host"] in (None, {"x": 1.0, "at_least": False})
    assert "| vs DDP | vs one-host |" in done.stdout and "- one-host: host 0 alone on its shard" in done.stdout


@pytest.mark.slow
def test_a_time_budget_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """Lockstep modes stop every rank after the step rank 0 publishes; local SGD after a step that
    averages (its ranks meet only there), with one model on every rank; PoseidonDDP's local SGD with
    ``delay=3`` after step 4k + 3, the last one a rank may start before the sync sent after step 4k lands
    (streaming, a fragment per step landing one step later: any step, the ranks a step apart at most; the
    same on int8 pseudo-gradients, sending less than half its bytes);
    compute-only, which never syncs, stops each rank on its own clock, at its first step that ends past
    the budget."""
    budget = 1.5
    done, report = run_accuracy(tmp_path, "--task", "lm", "--time-budget", str(budget), "--eval-every", "5",
                                "--modes", "torch-ddp,poseidon-ps,torch-ddp-localsgd,poseidon-localsgd-delay3,poseidon-streaming,"
                                "poseidon-streaming-int8,compute-only")
    assert done.returncode == 0, done.stderr
    for mode in ("torch-ddp", "poseidon-ps", "torch-ddp-localsgd", "poseidon-localsgd-delay3", "poseidon-streaming",
                 "poseidon-streaming-int8"):
        run = _ok(report, mode)
        steps = run["steps_by_rank"]
        assert steps[0] == steps[1] > 1, steps
        assert run["train_time_s"] >= budget and run["stop_rule"] == "rank 0's clock, every rank after the same step"
        assert run["evals"][-1]["step"] == steps[0] and run["evals"][-1]["val_bits_per_byte"] < 8.2
    local = _ok(report, "torch-ddp-localsgd")
    assert (local["steps_by_rank"][0] - 1) % 4 == 0  # a step that averaged: period 4, no warm-up
    assert len({d["final"] for d in local["param_digests_by_rank"]}) == 1
    delayed = _ok(report, "poseidon-localsgd-delay3")
    assert delayed["steps_by_rank"][0] % 4 == 3 and len({d["final"] for d in delayed["param_digests_by_rank"]}) == 1
    assert len({d["before_final_average"] for d in delayed["param_digests_by_rank"]}) == 2  # each its own drift
    streaming, int8 = _ok(report, "poseidon-streaming"), _ok(report, "poseidon-streaming-int8")
    assert len({d["final"] for d in streaming["param_digests_by_rank"]}) == 1
    assert len({d["final"] for d in int8["param_digests_by_rank"]}) == 1
    assert 0 < max(int8["bytes_per_step_by_rank"]) < 0.5 * min(streaming["bytes_per_step_by_rank"])
    alone = _ok(report, "compute-only")
    assert alone["stop_rule"] == "own clock"
    for ends in alone["step_end_s_by_rank"]:  # each rank's own clock
        assert ends[-2] < budget <= ends[-1] + 0.05, ends[-3:]  # + the few lines between its end and the check


@pytest.mark.slow
def test_a_persistent_straggler_computes_factor_times_slower(tmp_path: Path) -> None:
    """Host 1 computes 3x slower: each of its steps takes (3 - 1) x its step compute longer than host 0's.

    Asserted on the added time, not on the ratio: on a loaded machine both hosts' compute slows alike while
    the pause does not, so the ratio shrinks for reasons that are not the straggler's."""
    factor = 3.0
    _, report = run_accuracy(tmp_path, "--task", "lm", "--steps", "12", "--eval-every", "12",
                             "--straggler", f"persistent:factor={factor},rank=1", "--modes", "compute-only,torch-ddp",
                             tiny=False)
    run = _ok(report, "compute-only")
    assert _ok(report, "torch-ddp")["compute_s_by_rank"] == run["compute_s_by_rank"]  # one straggler for all modes
    step = [statistics.median(np.diff([0.0, *ends])[2:]) for ends in run["step_end_s_by_rank"]]  # skip warm-up
    compute = run["compute_s_by_rank"][1]
    assert 0.3 < compute / step[0] < 1.5, (compute, step)  # the calibration measured a real step
    added = step[1] - step[0]  # the upper bound is loose: another process may slow one host's compute more
    assert 0.8 * (factor - 1) * compute < added < 1.6 * (factor - 1) * compute + 0.02, (added, compute, step)
    assert run["pause_s_by_rank"][0] == 0
    assert run["pause_s_by_rank"][1] == pytest.approx(12 * (factor - 1) * compute)


@pytest.mark.parametrize("text, message", [
    ("sometimes", "unknown straggler"), ("persistent", "required"), ("persistent:factor=0.5", "factor must be"),
    ("persistent:factor=2,rank=2", "rank must be in 0..1"), ("transient:p=2,delay=1ms", "probability"),
    ("transient:p=0.1,delay=fast", "delay must be"), ("slow-link:rate=slow", "bad rate"),
    ("transient:p=0.1,delay=1ms,color=red", "takes"), ("persistent:factor=nan", "factor must be"),
    ("transient:p=0.1,delay=1ms,by=nap", "by must be one of sleep, load"), ("slow-link:rate=1mbit,by=load", "takes"),
    ("persistent:factor=inf", "factor must be"), ("slow-link:rate=0bit", "rate must be above 0"),
    ("persistent:factor=2,factor=3", "names a field twice"),
])
def test_a_bad_straggler_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_straggler(text, hosts=2)


@pytest.mark.parametrize("args, message", [
    (("--straggler", "slow-link:rate=100mbit"), "needs --mode netns"),
    (("--modes", "torch-ddp,torch-ddp"), "names a mode twice"),
    (("--time-budget", "-1"), "positive seconds"), (("--timeout", "0"), "positive seconds"),
    (("--target", "nan"), "must be numbers"), (("--budget", "-5"), "--budget must be positive seconds"),
    (("--powersgd-start-iter", "1"), "--powersgd-start-iter: must be >= 2 (torch's PowerSGD"),
    (("--localsgd-period", "0"), "--localsgd-period: must be >= 1"),
    (("--localsgd-period", "4", "--streaming-fragments", "3"), "(3) must divide --localsgd-period (4)"),
    (("--localsgd-period", "8", "--streaming-fragments", "4", "--streaming-delay", "3"),
     "--streaming-delay (3) must be between 1 and period / fragments (2)"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path, args: tuple, message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    """The command's parser refuses them (exit status 2, the reason on stderr), in process: the smoke runs
    above go through ``python -m``, and a parser that let one through fails here at once."""
    with pytest.raises(SystemExit) as refused:
        parse_accuracy_args(["--steps", "2", *args, "--out", str(tmp_path)])
    stderr = capsys.readouterr().err
    assert refused.value.code == 2 and message in stderr, stderr


def test_the_streaming_modes_take_their_fragments_and_the_others_none() -> None:
    """``--streaming-fragments`` reaches PoseidonDDP's ``fragments`` in the streaming modes only (default:
    one per step of the period), and the results record it; the compressed streaming modes are local SGD
    on pseudo-gradients (an outer SGD of lr 1) through their lossy path, with ``delay=1``."""
    from poseidon_torch.bench.baselines import Baselines
    from poseidon_torch.bench.worker import compression_for, delay_for, periodic_for

    outer = (object, {})
    sixteen = Baselines(localsgd_period=16, streaming_fragments=8)
    assert periodic_for("poseidon-streaming", sixteen, outer) == {"sync_every": 16, "outer": None, "fragments": 8}
    assert periodic_for("poseidon-streaming-int8", Baselines(localsgd_period=8), outer)["fragments"] == 8
    for mode, option in (("poseidon-streaming-int8", "int8"), ("poseidon-streaming-bf16", "bf16")):  # pseudo-gradients
        assert periodic_for(mode, sixteen, outer) == {"sync_every": 16, "outer": (torch.optim.SGD, {"lr": 1.0}),
                                                      "fragments": 8}
        assert compression_for(mode, sixteen) == {option: None} and delay_for(mode, sixteen) == 1
    assert periodic_for("poseidon-diloco", sixteen, outer) == {"sync_every": 16, "outer": outer, "fragments": 1}
    assert periodic_for("poseidon-hybrid", sixteen, outer) == {}
    assert sixteen.describe(["poseidon-streaming", "torch-ddp"]) == {"poseidon-streaming": {"sync_every": 16,
                                                                                           "fragments": 8, "delay": 1}}
    later = Baselines(localsgd_period=16, streaming_fragments=8, streaming_delay=2)
    assert [delay_for(mode, later) for mode in ("poseidon-streaming", "poseidon-streaming-bf16", "poseidon-localsgd-delay3",
                                                "poseidon-delay1", "poseidon-hybrid")] == [2, 2, 3, 1, 0]
    with pytest.raises(ValueError, match=r"--streaming-delay \(3\) must be between 1 and period / fragments \(2\)"):
        Baselines(localsgd_period=16, streaming_fragments=8, streaming_delay=3)


def test_a_streaming_run_stops_at_a_step_of_its_own_fragment_schedule() -> None:
    """The stop rule of a streaming mode meets where its syncs land: with 16 steps in 8 fragments and
    ``delay=1``, a sync every 2 steps, so once rank 0 has done n steps every rank can still stop after the
    first 2k > n, + delay (a rank may have started step 2k + 1, not finished it). The rule had used one
    fragment per step whatever --streaming-fragments said (stop after n + 1), a step a rank ahead by the
    schedule may already have run past, so the ranks could stop after different steps and miss each
    other's last syncs; then it stopped one step early (2k + delay - 1), where a rank that had started
    2k + delay waited at its close for a sync the others never sent (a CI failure of this test)."""
    from poseidon_torch.bench.accuracy.worker import consensus_for
    from poseidon_torch.bench.baselines import Baselines

    eight = consensus_for("poseidon-streaming-int8", Baselines(localsgd_period=16, streaming_fragments=8))
    assert [eight.next_meeting(n) for n in (189, 190, 191, 192)] == [191, 193, 193, 195]
    per_step = consensus_for("poseidon-streaming", Baselines(localsgd_period=16))
    assert [per_step.next_meeting(n) for n in (190, 191)] == [192, 193]
    two_in_flight = consensus_for("poseidon-streaming", Baselines(localsgd_period=16, streaming_fragments=8,
                                                                  streaming_delay=2))
    assert [two_in_flight.next_meeting(n) for n in (189, 190, 191)] == [192, 194, 194]


@pytest.mark.slow
def test_a_rank_past_its_timeout_is_named_as_such(tmp_path: Path) -> None:
    done, report = run_accuracy(tmp_path, "--task", "lm", "--steps", "100000", "--timeout", "3",
                                "--modes", "torch-ddp")
    assert done.returncode == 1
    assert "ran past its --timeout" in report["modes"]["torch-ddp"]["error"], report["modes"]["torch-ddp"]["error"]


def test_a_timed_out_rank_is_blamed_not_the_peer_that_lost_it(tmp_path: Path) -> None:
    """The peer of a rank killed by its watchdog fails at once with a lost connection and may be polled
    first (the lower rank): the report must still name the rank whose watchdog fired."""
    logs = [tmp_path / "r0.log", tmp_path / "r1.log"]
    commands = [["sh", "-c", "sleep 0.2; echo 'RuntimeError: Connection closed by peer'; exit 1"],
                ["sh", "-c", "sleep 0.4; echo 'Timeout (0:00:03)!'; echo 'File \"<frozen runpy>\"'; exit 1"]]
    with pytest.raises(RankFailure) as failure:
        run_ranks(commands, [dict(os.environ)] * 2, logs, timeout=30)
    assert str(failure.value).startswith("rank 1 exited with status 1: Timeout (0:00:03)!"), str(failure.value)
    assert "ran past its --timeout" in str(failure.value)


@pytest.mark.slow
def test_the_default_target_of_a_run_shorter_than_the_grid_is_its_final_point(tmp_path: Path) -> None:
    _, report = run_accuracy(tmp_path, "--task", "digits", "--steps", "3", "--eval-every", "20",
                             "--modes", "torch-ddp,poseidon-ps")
    ddp = _ok(report, "torch-ddp")
    assert [p["step"] for p in ddp["evals"]] == [0, 3]
    assert report["target"] == ddp["evals"][-1]["val_loss"] < ddp["evals"][0]["val_loss"]
    assert report["budget_s"] == min(_ok(report, m)["train_time_s"] for m in ("torch-ddp", "poseidon-ps"))
    for mode in ("torch-ddp", "poseidon-ps"):  # a run's final point counts at its own training time
        run = _ok(report, mode)
        assert run["evals"][-1]["time_s"] == run["train_time_s"]
    assert _ok(report, "poseidon-ps")["time_to_target_s"] == _ok(report, "poseidon-ps")["train_time_s"]


def test_transient_pauses_are_reproducible_and_as_frequent_as_asked() -> None:
    spec = Straggler("transient", probability=0.1, delay="0.5", seed=7)
    draws = [spec.pause_s(rank, step, 0.2) for rank in range(2) for step in range(5000)]
    assert draws == [spec.pause_s(rank, step, 0.2) for rank in range(2) for step in range(5000)]
    assert set(draws) == {0.0, 0.1}  # half of the 0.2 s step
    assert abs(draws.count(0.1) / len(draws) - 0.1) < 0.01


@pytest.mark.parametrize("by", ["sleep", "load"])
def test_a_pause_lasts_as_asked_and_a_loaded_host_keeps_its_cpu(by: str) -> None:
    spec = parse_straggler(f"transient:p=1,delay=0.2s,by={by}", 2)
    wall, cpu = time.perf_counter(), time.process_time()
    spec.wait_out(spec.pause_s(0, 0, 1.0))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.2 <= wall < 0.4
    assert (cpu > 0.1) if by == "load" else (cpu < 0.05)


def test_the_target_counts_at_the_first_point_that_reaches_it() -> None:
    evals = [{"step": 0, "time_s": 0.0, "m": 3.0}, {"step": 5, "time_s": 2.0, "m": 1.9},
             {"step": 10, "time_s": 4.0, "m": 2.1}, {"step": 15, "time_s": 6.0, "m": 1.5}]
    assert time_to(evals, "m", 2.0)["time_s"] == 2.0
    assert time_to(evals, "m", 1.0) is None
    assert value_at(evals, "m", 5.0) == 2.1 and value_at(evals, "m", -1.0) is None
    with pytest.raises(ValueError, match="fewer than two"):
        divergence_from(evals[:1], evals, "m")


def _curve(points: list[tuple[float, float]], train_time_s: float = 100.0) -> dict:
    return {"evals": [{"step": 10 * i, "time_s": t, "m": v} for i, (t, v) in enumerate(points)],
            "train_time_s": train_time_s}


def test_the_slowest_level_is_found_among_every_value_below_the_first_evaluation() -> None:
    """One host alone against a mode: the speed-up at each value either curve evaluated below both first
    evaluations is the ratio of their first times at or below it; the smallest is reported, the first
    evaluation (one grid step apart by construction) is left out, and a value the mode never reaches is 0."""
    one_host = _curve([(0, 8.0), (4, 5.0), (8, 4.0), (12, 3.5), (16, 3.0)])
    ahead = _curve([(0, 8.0), (5, 5.2), (6, 4.5), (7, 3.9), (8, 3.4), (9, 2.9)])
    # levels below 5.0, one host's first time over the mode's: 4.5 (8/6), 4.0 (8/7), 3.9 (12/7), 3.5 (12/8),
    # 3.4 (16/8), 3.0 (16/9), 2.9 (one host never: at least 100/9); the slowest is 4.0, at 8/7
    assert slowest_level_speedup(one_host, ahead, "m") == pytest.approx(
        {"x": 8 / 7, "value": 4.0, "at_least": False, "levels": 7})
    behind_once = _curve([(0, 8.0), (5, 5.2), (6, 4.5), (13, 3.9), (14, 2.9)])
    assert slowest_level_speedup(one_host, behind_once, "m")["x"] == pytest.approx(8 / 13)
    short = _curve([(0, 8.0), (3, 4.9), (4, 3.6)])  # levels below 4.9: 4.0, 3.6, 3.5 and 3.0; never 3.5
    assert slowest_level_speedup(one_host, short, "m") == {"x": 0.0, "value": 3.5, "at_least": False, "levels": 4}
    assert slowest_level_speedup(one_host, _curve([(0, 8.0)]), "m") is None


def test_the_summary_recomputes_the_slowest_level_of_runs_written_before_it_existed(tmp_path: Path) -> None:
    from poseidon_torch.bench.accuracy.summary import summarise

    config = {"task": "lm", "hosts": 2, "link": "100mbit", "cpus_per_host": None, "straggler": "none",
              "time_budget_s": 20.0, "steps": None, "eval_every": 10}
    modes = {"one-host": _curve([(0, 8.0), (4, 5.0), (8, 4.0), (12, 3.5), (16, 3.0)], 16.0),
             "mode": _curve([(0, 8.0), (5, 5.2), (6, 4.5), (13, 3.9), (14, 2.9)], 14.0)}
    for run in modes.values():
        run.update(metric="m", steps_by_rank=[40, 40])
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": config, "modes": modes}))
    row = summarise([path])[0]["summary"]["modes"]["mode"]
    assert row["slowest_level_vs_one_host"]["median"] == pytest.approx(8 / 13)


def test_a_slow_link_is_shaped_at_its_own_rate() -> None:
    from poseidon_torch.bench.netns import EmulatedCluster, NetnsUnavailable

    try:
        with EmulatedCluster(2, "1gbit", host_rates={1: "100mbit"}, prefix="ptt-") as cluster:
            shown = [subprocess.run(["ip", "netns", "exec", cluster.namespace(h), "tc", "qdisc", "show", "dev", "veth0"],
                                    capture_output=True, text=True, check=True).stdout for h in range(2)]
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    assert "rate 1Gbit" in shown[0] and "rate 100Mbit" in shown[1], shown


RECEIVER = """
import socket
server = socket.create_server(("0.0.0.0", 5201))
print("ready", flush=True)
for _ in range(2):
    conn, _ = server.accept()
    got = 0
    while chunk := conn.recv(1 << 20):
        got += len(chunk)
    conn.sendall(str(got).encode())
    conn.close()
"""
SENDER = """
import json, socket, sys, time
def tx():
    with open("/sys/class/net/veth0/statistics/tx_bytes") as f:
        return int(f.read())
for size in map(int, sys.argv[2:]):
    time.sleep(0.5)  # idle: the shaper's bucket fills up to its burst
    before = tx()
    conn = socket.create_connection((sys.argv[1], 5201))
    start = time.perf_counter()
    conn.sendall(bytes(size))
    conn.shutdown(socket.SHUT_WR)
    got = int(conn.recv(64))
    seconds = time.perf_counter() - start
    conn.close()
    print(json.dumps({"size": size, "received": got, "seconds": seconds, "wire_bytes": tx() - before}), flush=True)
"""


@pytest.mark.parametrize("rate", ["100mbit", "10mbit"])
def test_a_slow_link_is_shaped_at_its_own_rate_on_the_wire(rate: str) -> None:
    """A known payload from host 0 to host 1 over TCP: 1.5 s of traffic at the rate, then 50 ms of it,
    each after an idle half second. The wire carries the payload and its headers (0-5% more bytes, read
    from host 0's veth; TCP resends a frame now and then); the long transfer takes 0.97-1.25 times
    payload / rate (a loaded machine may slow a transfer, it cannot speed one up); and no transfer ends
    sooner than 0.97 times what its wire bytes take at the rate beyond one burst of 1 ms of traffic or
    one jumbo frame, whichever is more (all a shaper's bucket holds after an idle link). With the burst
    of 128 KiB used until 2026-11-27, the long transfer through 10 Mbit/s took 1.41 s (1.5 s at the
    rate; it passed at 100 Mbit/s, where 128 KiB is 10 ms of traffic)."""
    from poseidon_torch.bench.netns import EmulatedCluster, NetnsUnavailable, parse_rate

    rate_bps = parse_rate(rate)
    sizes = [int(rate_bps / 8 * seconds) for seconds in (1.5, 0.05)]
    try:
        with EmulatedCluster(2, rate, prefix="ptt-") as cluster:
            receiver = subprocess.Popen(cluster.command(1, [sys.executable, "-c", RECEIVER]), stdout=subprocess.PIPE,
                                        text=True)
            try:
                assert receiver.stdout.readline().strip() == "ready"
                sender = subprocess.run(cluster.command(0, [sys.executable, "-c", SENDER, cluster.address(1),
                                                            *map(str, sizes)]),
                                        capture_output=True, text=True, timeout=60)
            finally:
                receiver.kill()
                receiver.wait()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here (needs root and iproute2): {exc}")
    assert sender.returncode == 0, sender.stderr
    long, short = [json.loads(line) for line in sender.stdout.splitlines()]
    for transfer in (long, short):
        assert transfer["received"] == transfer["size"]
        assert transfer["size"] <= transfer["wire_bytes"] <= 1.05 * transfer["size"], transfer
    ideal_s = long["size"] * 8 / rate_bps
    assert 0.97 * ideal_s <= long["seconds"] <= 1.25 * ideal_s, (long, ideal_s)
    free_bytes = max(rate_bps / 8 * 1e-3, 9000 + 14)
    for transfer in (long, short):
        assert transfer["seconds"] >= 0.97 * (transfer["wire_bytes"] - free_bytes) * 8 / rate_bps, transfer


def _summary_run(time_to_target: float | None, at_budget: float, over_ddp: dict | None = None) -> dict:
    return {"steps_by_rank": [10, 10], "s_per_step": 1.0, "bytes_per_step_per_host": 2e6, "value_at_budget": at_budget,
            "time_to_target_s": time_to_target, "speedup_over": {"torch-ddp": over_ddp}}


def test_the_summary_takes_medians_over_repeats_and_a_run_short_of_the_target_counts_as_never() -> None:
    """Three repeats of one cell: the medians and ranges are the runs' own numbers; a mode that reached the
    target in one run of three ranks behind one that reached it late every time, and its failed run shows."""
    from poseidon_torch.bench.accuracy.summary import markdown, summarise_cell

    config = {"task": "lm", "hosts": 2, "link": "100mbit", "cpus_per_host": None, "straggler": "none",
              "time_budget_s": 60.0, "steps": None}
    reports = [{"config": config, "modes": {
        "torch-ddp": _summary_run(60.0 + i, 3.0, {"x": 1.0, "at_least": False}),
        "steady": _summary_run(50.0 - i, 2.9, {"x": 1.2, "at_least": False}),
        "lucky": _summary_run(10.0 if i == 0 else None, 3.5, {"x": 6.0, "at_least": False} if i == 0 else None),
    }} for i in range(3)]
    reports[2]["modes"]["steady"] = {"error": "rank 1 exited with status 1"}
    cell = summarise_cell(reports)
    assert cell["ranking"] == ["steady", "torch-ddp", "lucky"]
    steady = cell["modes"]["steady"]
    assert steady["time_to_target_s"] == {"median": 49.5, "min": 49.0, "max": 50.0, "missing": 0}
    assert steady["failed"] == 1 and cell["modes"]["lucky"]["time_to_target_s"]["missing"] == 2
    text = markdown([{"title": "t", "summary": cell}])
    assert "| steady (1 failed) | 10 | 1.000 | 2.000 | 2.900 | 49.5 (49.0-50.0) | 1.20 |" in text
    assert "**steady** reaches the target first: 50.0 s (the median of its runs, one that failed" in text
    assert "1.20x sooner than torch-ddp, 1.22x sooner than the runner-up torch-ddp" in text  # 61 / 50


def test_a_target_the_initial_model_meets_gives_no_speedup_and_no_winner() -> None:
    """Every mode starts from the same model, so a target at or above its value is met at step 0 in every
    mode, at the snapshot's few microseconds: a ratio of those is noise (it read 0.29x), not a speed-up."""
    from poseidon_torch.bench.accuracy.report import add_derived, table
    from poseidon_torch.bench.accuracy.summary import summarise_cell, winner_line

    config = {"task": "lm", "hosts": 2, "link": "localhost", "cpus_per_host": None, "straggler": "none",
              "time_budget_s": None, "steps": 12, "eval_every": 4}
    modes = {"torch-ddp": _curve([(0.0002, 8.0), (4, 5.0), (8, 4.0)], 8.0),
             "one-host": _curve([(0.0007, 8.0), (2, 5.5), (4, 4.5)], 4.0)}
    for run in modes.values():
        run.update(metric="m", steps_by_rank=[20, 20], samples_per_s=1.0)
    report = {"config": config, "modes": modes}
    add_derived(report, 9.0, None)
    assert all(run["time_to_target_s"] is not None and run["speedup_over"] == {"torch-ddp": None, "one-host": None}
               for run in modes.values()), [run["speedup_over"] for run in modes.values()]
    assert report["target_met_untrained"]
    assert "the target 9 is met by the initial model (m 8 at step 0)" in table(report)
    assert winner_line(summarise_cell([report])).startswith("No winner: the initial model meets the target in 1 of 1")
    add_derived(report, 4.5, None)  # a target reached by training: speed-ups as before
    assert not report["target_met_untrained"] and modes["one-host"]["speedup_over"]["torch-ddp"]["x"] == 2.0


def test_a_mode_absent_from_most_runs_cannot_win_and_its_absence_shows() -> None:
    """A mode run once in three repeats (a results file from an older run without it) reached the target
    sooner in that run: it still reached it in fewer than half the repeats, so it cannot win the cell."""
    from poseidon_torch.bench.accuracy.summary import markdown, summarise_cell

    config = {"task": "lm", "hosts": 2, "link": "100mbit", "cpus_per_host": None, "straggler": "none",
              "time_budget_s": 60.0, "steps": None}
    reports = [{"config": config, "modes": {"steady": _summary_run(50.0, 2.9)}} for _ in range(3)]
    reports[0]["modes"]["once"] = _summary_run(10.0, 3.5)
    cell = summarise_cell(reports)
    assert cell["ranking"] == ["steady", "once"] and cell["modes"]["once"]["absent"] == 2
    assert "| once (2 absent) |" in markdown([{"title": "t", "summary": cell}])


def test_the_summary_refuses_a_results_file_named_twice(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each file is a run: naming one twice (a shell glob plus the file again) would count it as two repeats."""
    from poseidon_torch.bench.accuracy.summary import main

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {"task": "lm"}, "modes": {}}))
    with pytest.raises(SystemExit) as refused:
        main([str(path), str(tmp_path / "." / "results.json")])
    assert refused.value.code == 2 and "named more than once" in capsys.readouterr().err


def test_runs_at_another_local_sgd_period_are_another_cell_not_a_repeat(tmp_path: Path) -> None:
    """Runs that differ only in ``--localsgd-period`` (or in another baseline option, or the task's size)
    run different algorithms: the summary keeps them apart instead of taking their median. A results file
    written before the options were recorded is read by its description of the baselines; a run whose
    modes read no option is a repeat of the first cell it agrees with."""
    from poseidon_torch.bench.accuracy.summary import summarise

    base = {"task": "lm-wide", "tiny": False, "hosts": 2, "link": "100mbit", "latency": None, "cpus_per_host": None,
            "straggler": "none", "time_budget_s": 120.0, "steps": None, "eval_every": 10}
    described = {"torch-ddp-localsgd": {"period": 8, "warmup_steps": 0}}
    configs = {"p8": {**base, "baseline_options": {"powersgd_rank": 4, "powersgd_start_iter": 1000,
                                                   "localsgd_period": 8, "localsgd_warmup": 0}},
               "p8-old": {**base, "baselines": described},
               "p16": {**base, "baseline_options": {"powersgd_rank": 4, "powersgd_start_iter": 1000,
                                                    "localsgd_period": 16, "localsgd_warmup": 0}},
               "p8-tiny": {**base, "tiny": True, "baselines": described},
               "no-option-read": {**base, "baseline_options": {}}}  # a run of modes that read none: a repeat
    paths = []
    for name, config in configs.items():
        run = _curve([(0.001, 8.0), (5, 5.0)], 5.0)
        run.update(metric="m", steps_by_rank=[10, 10])
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"config": config, "modes": {"torch-ddp-localsgd": run}}))
    titles = sorted((entry["title"], entry["summary"]["runs"]) for entry in summarise(paths))
    assert titles == [("lm-wide (tiny), 2 hosts, 100mbit, 120 s per mode, --localsgd-period 8, 1 run", 1),
                      ("lm-wide, 2 hosts, 100mbit, 120 s per mode, --localsgd-period 16, 1 run", 1),
                      ("lm-wide, 2 hosts, 100mbit, 120 s per mode, --localsgd-period 8, 3 runs", 3)], titles


def test_the_matrix_script_takes_a_rate_with_a_decimal_point(tmp_path: Path) -> None:
    """``RATES="1.5mbit 10Mbit"`` are rates the benchmark takes; the script once built the variable name
    ``EVAL_1.5mbit`` from it, which bash refuses as a fatal error: the matrix stopped at that cell, without
    its summary; and it took 10Mbit's grid for another rate's, the default of 10 steps where 10mbit has 3.
    Run with a stand-in ``python`` that records its arguments (no namespaces, no root)."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", RATES="1.5mbit 10Mbit",
               FOUR_HOST_RATE="", CPUS_PER_HOST="0.5", REPEATS="1", EVAL_1_5mbit="7", MODES="torch-ddp")
    done = subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "accuracy_matrix.sh"), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [call.split("--eval-every ")[1].split()[0] for call in calls] == ["7", "3"], calls


def test_one_host_listed_first_gets_the_calibration_of_the_other_modes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A straggler's pause is calibrated once, by a mode on every host, and handed to every other mode.
    ``one-host`` listed first once calibrated itself (6.9 ms where the others got 8.5 ms for host 0): its
    straggler paused less. Now a mode on every host runs first; the table keeps the order asked for."""
    from types import SimpleNamespace

    import poseidon_torch.bench.accuracy.__main__ as accuracy

    handed = {}

    def fake_run(args, placement, mode, calibration):
        handed[mode] = calibration
        world = 1 if mode == "one-host" else 2
        return {"world_size": world, "compute_s_by_rank": calibration or [0.0085, 0.0066][:world], "metric": "m",
                "train_time_s": 1.0, "evals": [{"step": 0, "time_s": 0.0, "m": 2.0}, {"step": 2, "time_s": 1.0, "m": 1.0}]}

    monkeypatch.setattr(accuracy, "run_mode", fake_run)
    args = accuracy.parse_args(["--modes", "one-host,torch-ddp,torch-ddp-localsgd", "--steps", "2",
                                "--straggler", "persistent:factor=3,rank=0", "--out", str(tmp_path)])
    placement = SimpleNamespace(kind="localhost", latency=None, cpus_per_host=None, warnings=[], wire_iface=None)
    report = accuracy.run_all(args, placement)
    assert handed == {"torch-ddp": None, "one-host": [0.0085, 0.0066], "torch-ddp-localsgd": [0.0085, 0.0066]}
    assert list(report["modes"]) == ["one-host", "torch-ddp", "torch-ddp-localsgd"]


def test_runs_without_a_target_say_why_instead_of_no_mode_reaching_it(tmp_path: Path) -> None:
    """Without torch DDP (it failed or was not asked for) and without ``--target`` there is no target: the
    table and the summary say so and how to give one, instead of reading as if no mode reached it."""
    from poseidon_torch.bench.accuracy.report import add_derived, table
    from poseidon_torch.bench.accuracy.summary import summarise_cell, winner_line

    run = _curve([(0.001, 8.0), (4, 5.0)], 4.0)
    run.update(metric="m", steps_by_rank=[10], samples_per_s=1.0)
    report = {"config": {"eval_every": 10}, "modes": {"one-host": run, "torch-ddp": {"error": "rank 1 exited"}}}
    add_derived(report, None, None)
    assert report["target"] is None and "- no target, so no time to it and no speed-up" in table(report)
    assert winner_line(summarise_cell([report])).startswith("No winner: no target")


def test_the_results_record_the_baseline_options_the_modes_read_and_warn_of_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--localsgd-period`` reaches torch's local SGD and PoseidonDDP's periodic modes, ``--powersgd-rank``
    torch's PowerSGD and ``poseidon-powersgd``: an option no mode of the run reads is said to be ignored,
    and the results record only what the modes read (the summary's cells compare those)."""
    from poseidon_torch.bench.accuracy.__main__ import options_read, parse_args

    args = parse_args(["--steps", "2", "--modes", "torch-ddp,poseidon-streaming", "--localsgd-period", "8",
                       "--powersgd-rank", "2", "--out", str(tmp_path)])
    assert options_read(args) == {"localsgd_period": 8, "streaming_fragments": None, "streaming_delay": 1}
    assert "warning: --powersgd-rank 2: no mode of --modes reads it" in capsys.readouterr().err
    parse_args(["--steps", "2", "--modes", "poseidon-localsgd", "--streaming-fragments", "2", "--out", str(tmp_path)])
    assert "warning: --streaming-fragments 2: no mode of --modes reads it" in capsys.readouterr().err
    args = parse_args(["--steps", "2", "--modes", "poseidon-powersgd,torch-ddp-localsgd", "--out", str(tmp_path)])
    assert options_read(args) == {"localsgd_period": 4, "localsgd_warmup": 0, "powersgd_rank": 4,
                                  "powersgd_start_iter": 1000}
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    (json.dumps({"config": {}, "workloads": {}}), "not the results.json of a time-to-accuracy run (a throughput"),
])
def test_the_summary_refuses_a_file_that_is_not_a_runs_results(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                               content: str, message: str) -> None:
    """A throughput benchmark's results.json (the same name) or a broken file: an error naming the file,
    where a KeyError or JSONDecodeError traceback came out."""
    from poseidon_torch.bench.accuracy.summary import main

    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as refused:
        main([str(path)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"{path} " in err and message in err, err
