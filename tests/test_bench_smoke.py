"""Smoke test of ``python -m poseidon_torch.bench`` in localhost mode: 2 ranks, tiny model, 4 timed iterations.

Runs the real runner in a subprocess with a hard timeout (pytest-timeout may be absent), then checks that
results.json holds every mode, torch DDP's, PoseidonDDP's and the slow-network baselines' alike, with
positive times, that the table and the plot were produced, and that the baselines send what their
algorithms send: PowerSGD far fewer bytes than DDP, local SGD a period's share of them, one host nothing.
A mode that failed fails its test (nothing is skipped).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("torch-ddp-powersgd", "torch-ddp-localsgd", "one-host")
MODES = ("compute-only", "torch-ddp", "poseidon-ps", "poseidon-hybrid", "poseidon-server-bf16", *BASELINES)
ITERS = 4  # a whole period of local SGD's averaging (every 4 steps)
RUN_TIMEOUT_S = 600  # eight modes, up to two worker processes each, on a slow, shared 2-core machine
#: the module-scoped run is set up inside its first test: that test's limit must cover it
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    command = [sys.executable, "-m", "poseidon_torch.bench", "--mode", "localhost", "--hosts", "2",
               "--bandwidth", "1gbit", "--workload", "fc_heavy", "--tiny", "--iters", str(ITERS), "--warmup", "2",
               "--timeout", "120", "--modes", ",".join(MODES), "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    results = out / "results.json"
    assert results.is_file(), f"no results.json; exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done, json.loads(results.read_text()), out


def _check_mode(result: dict) -> None:
    assert "error" not in result, result.get("error", "") + "\n" + result.get("log_tail", "")
    assert result["iter_s"] > 0
    assert len(result["iter_times_s"]) == ITERS and all(t > 0 for t in result["iter_times_s"])
    assert result["samples_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mode_has_positive_times(bench_run: tuple, mode: str) -> None:
    _, report, _ = bench_run
    _check_mode(report["workloads"]["fc_heavy"]["modes"][mode])


@pytest.mark.slow
def test_report_shape(bench_run: tuple) -> None:
    done, report, out = bench_run
    entry = report["workloads"]["fc_heavy"]
    assert set(entry["modes"]) == set(MODES)
    assert report["config"]["mode"] == "localhost" and report["config"]["hosts"] == 2
    assert entry["lower_bound_s"] >= entry["modes"]["compute-only"]["iter_s"] > 0
    assert entry["modes"]["torch-ddp"]["bytes_source"] == "analytic"
    assert entry["modes"]["torch-ddp"]["bytes_per_iter_per_host"] == entry["profile"]["param_bytes"]
    assert (out / "results.png").stat().st_size > 0
    assert "torch-ddp" in done.stdout and "x bound" in done.stdout and "CPU floor ms" in done.stdout
    assert "torch's powerSGD_hook, rank 4" in done.stdout and "plain all-reduce for the first 2 steps" in done.stdout
    assert report["config"]["baselines"]["torch-ddp-powersgd"]["start_powerSGD_iter"] == 2  # --warmup
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_baselines_send_what_their_algorithms_send(bench_run: tuple) -> None:
    """Bytes each rank's process wrote over the timed loop (its socket writes): DDP's match the ring
    all-reduce of the gradients; PowerSGD's rank-4 factors are a small part of them; local SGD averages
    the parameters (as many bytes) once in its 4 timed steps; one host alone, a world of one, sends nothing."""
    _, report, _ = bench_run
    modes = report["workloads"]["fc_heavy"]["modes"]
    ddp = modes["torch-ddp"]["sent_bytes_per_iter_by_rank"]
    assert ddp[0] == pytest.approx(report["workloads"]["fc_heavy"]["profile"]["param_bytes"], rel=0.01)
    for mode, low, high in (("torch-ddp-powersgd", 0.0, 0.2), ("torch-ddp-localsgd", 0.24, 0.27)):
        result = modes[mode]
        assert result["bytes_source"] == "sent"
        assert all(low * d < sent <= high * d for sent, d in zip(result["sent_bytes_per_iter_by_rank"], ddp)), mode
    one_host = modes["one-host"]
    assert one_host["world_size"] == 1 and one_host["sent_bytes_per_iter_by_rank"] == [0.0]
    assert one_host["samples_per_s"] == pytest.approx(one_host["batch_per_rank"] / one_host["iter_s"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_no_mode_runs_faster_than_its_cpu_floor(bench_run: tuple, mode: str) -> None:
    """The CPU floor is all ranks' CPU seconds spread over the cores they share: a physical bound, so a
    floor above the iteration time means CPU and time were measured over different windows, or the
    floor was spread over the wrong number of cores."""
    _, report, _ = bench_run
    result, cores = report["workloads"]["fc_heavy"]["modes"][mode], report["config"]["shared_cores"]
    assert cores == len(os.sched_getaffinity(0))
    hosts_share = cores * result["world_size"] / report["config"]["hosts"]  # one-host: one host's cores
    assert result["cpu_floor_s"] == pytest.approx(result["cpu_s_per_iter"] / hosts_share)
    assert 0 < result["cpu_floor_s"] <= result["iter_s"] * 1.05 + 0.002


@pytest.mark.parametrize("workload", ["resnet18", "gpt2"])
def test_batch_scale_joins_consecutive_batches_of_the_same_data(workload: str) -> None:
    """``--batch-scale K``: step s's batch is the workload's batches of steps sK .. sK+K-1, joined."""
    import torch

    from poseidon_torch.bench.workloads import build, placed

    base = build(workload, tiny=True)
    scaled = placed(base, torch.device("cpu"), 3)
    assert scaled.batch_size == 3 * base.batch_size
    x, y = scaled.make_batch(1, 2)
    parts = [base.make_batch(1, 6 + i) for i in range(3)]
    assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    assert not torch.equal(x, scaled.make_batch(0, 2)[0])  # still a function of the rank


def test_the_iteration_time_is_the_jobs_throughput_not_the_longest_rank_of_every_step():
    """Two ranks without a barrier per step whose long iterations alternate (1 s, 3 s, ... and 3 s, 1 s,
    ...): each loop took 8 s for 4 iterations, so the job ran at 2 s per iteration. The longest rank of
    each step (3 s every time) is what the old headline (``median_iter_s``) reported."""
    import argparse

    from poseidon_torch.bench.worker import summarise
    from poseidon_torch.bench.workloads import build

    args = argparse.Namespace(mode="torch-ddp", workload="fc_heavy", tiny=True, compile=False, threads=1, iters=4,
                              warmup=0, optimizer="sgd", wire_iface=None)
    rank = {"cpu_s_per_iter": 0.1, "losses": [0.0] * 4, "optimizer_state_bytes": 0, "api_bytes_per_iter": 0.0,
            "sent_bytes_per_iter": None}
    records = [dict(rank, times=[1.0, 3.0, 1.0, 3.0], loop_s=8.0), dict(rank, times=[3.0, 1.0, 3.0, 1.0], loop_s=8.0)]
    result = summarise(args, records, build("fc_heavy", tiny=True), param_bytes=1000)
    assert result["iter_s"] == pytest.approx(2.0) and result["median_iter_s"] == pytest.approx(3.0)
    assert result["samples_per_s"] == pytest.approx(2 * result["batch_per_rank"] / 2.0)


def test_the_report_refuses_results_written_before_iter_s(tmp_path: Path):
    """An older results file has only ``median_iter_s``, another metric: the report says so by name
    instead of mixing the two in one table."""
    from poseidon_torch.bench import report

    old = tmp_path / "results.json"
    old.write_text(json.dumps({"config": {"hosts": 2, "bandwidth": "1gbit", "bandwidth_enforced": True},
                               "workloads": {"gpt2": {"modes": {"torch-ddp": {"median_iter_s": 1.0}}}}}))
    with pytest.raises(SystemExit, match="written before 2026-11-26, without iter_s"):
        report.main([str(old)])


@pytest.mark.parametrize("args, message", [
    (("--modes", "compute-only,torch-ddp,torch-ddp-powersgd", "--warmup", "1"), "give --warmup 2 or more"),
    (("--modes", "compute-only,torch-ddp,torch-ddp-localsgd", "--iters", "6"), "a multiple of it"),
    (("--modes", "compute-only,torch-ddp", "--powersgd-rank", "0"), "--powersgd-rank: must be >= 1"),
])
def test_the_baselines_refuse_settings_that_would_time_something_else(args: tuple, message: str,
                                                                      capsys: pytest.CaptureFixture) -> None:
    from poseidon_torch.bench.__main__ import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--iters", "4", "--warmup", "2", *args])
    stderr = capsys.readouterr().err
    assert refused.value.code == 2 and message in stderr, stderr


@pytest.mark.parametrize("warmup", ["0", "1"])
def test_a_short_warmup_without_torch_powersgd_hands_the_workers_options_they_accept(tmp_path: Path,
                                                                                       warmup: str) -> None:
    """``--warmup`` 0 or 1 is fine without ``torch-ddp-powersgd``: the workers must accept the options the
    runner hands them (they once got ``--powersgd-start-iter 1`` and every mode failed), and PowerSGD in
    PoseidonDDP's mode starts where torch's could."""
    from poseidon_torch.bench.__main__ import parse_args, worker_argv
    from poseidon_torch.bench.worker import parse_args as parse_worker_args

    args = parse_args(["--iters", "4", "--warmup", warmup, "--modes", "compute-only,torch-ddp,poseidon-powersgd",
                       "--out", str(tmp_path)])
    argv = worker_argv(args, "torch-ddp", "fc_heavy", tmp_path / "r.json", 1, None, None)
    worker = parse_worker_args(argv[3:])  # after: python -m poseidon_torch.bench.worker
    assert worker.warmup == int(warmup) and worker.powersgd_start_iter == 2


def test_one_host_is_not_measured_against_the_bound_of_the_multi_host_job() -> None:
    """The lower bound is the P-host job's, its sync over the link included: one host alone has no sync,
    so on a slow link it runs well under that bound, and a ratio below 1 would read as beating it."""
    from poseidon_torch.bench.__main__ import add_derived

    profile = {"param_bytes": 4_000_000, "linear": []}
    run = {"batch_per_rank": 8, "cpu_s_per_iter": 0.1}
    entry = {"modes": {"compute-only": dict(run, mode="compute-only", iter_s=0.1, world_size=2, profile=profile),
                       "torch-ddp": dict(run, mode="torch-ddp", iter_s=0.5, world_size=2, samples_per_s=32.0),
                       "one-host": dict(run, mode="one-host", iter_s=0.1, world_size=1, samples_per_s=80.0)}}
    add_derived(entry, hosts=2, bandwidth_bps=100_000_000, cores=2.0)
    assert entry["lower_bound_s"] == pytest.approx(4e6 * 8 / 1e8)  # the sync of 2 hosts at 100 Mbit/s: 0.32 s
    assert entry["modes"]["torch-ddp"]["ratio_to_lower_bound"] == pytest.approx(0.5 / 0.32)
    assert entry["modes"]["one-host"]["ratio_to_lower_bound"] is None
