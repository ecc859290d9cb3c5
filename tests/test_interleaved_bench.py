"""``benchmarks/interleaved.py`` pairs what it says: a round's time is the slowest rank's, CPU is summed
over the ranks, and each ratio pairs torch DDP with the mode within one round (no processes started)."""
from __future__ import annotations

import argparse

import pytest

from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def script():
    with benchmark_script("interleaved") as module:
        yield module


def test_rounds_pair_the_slowest_ranks_and_sum_the_cpu(script):
    args = argparse.Namespace(modes=["torch-ddp", "poseidon-ps"], workload="gpt2")
    # per rank, per round: {mode: (seconds per iteration, CPU seconds per iteration)}
    rank0 = [{"torch-ddp": (1.0, 1.0), "poseidon-ps": (0.5, 0.9)}, {"torch-ddp": (2.0, 1.0), "poseidon-ps": (2.0, 1.0)},
             {"torch-ddp": (1.0, 1.0), "poseidon-ps": (1.0, 1.0)}]
    rank1 = [{"torch-ddp": (1.0, 1.0), "poseidon-ps": (0.8, 0.9)}, {"torch-ddp": (1.0, 1.0), "poseidon-ps": (4.0, 1.0)},
             {"torch-ddp": (1.0, 1.0), "poseidon-ps": (1.0, 1.0)}]
    summary = script.summarise(args, [rank0, rank1])
    ps = summary["modes"]["poseidon-ps"]
    # rounds: DDP 1.0 / 0.8 (rank 1 was slower), 2.0 / 4.0 (rank 0's DDP, rank 1's PS), 1.0 / 1.0
    assert (ps["vs_ddp_min"], ps["vs_ddp_median"], ps["vs_ddp_max"]) == pytest.approx((0.5, 1.0, 1.25))
    assert ps["iter_ms"] == pytest.approx(1000.0)  # median of 0.8, 4.0, 1.0
    assert ps["cpu_s_per_iter"] == pytest.approx(2.0)  # median of 1.8, 2.0, 2.0
    assert summary["modes"]["torch-ddp"]["vs_ddp_median"] == 1.0


def test_modes_must_start_with_torch_ddp(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["interleaved.py", "--modes", "poseidon-ps,torch-ddp"])
    with pytest.raises(SystemExit) as refused:
        script.parse_args()
    assert refused.value.code == 2 and "starts with torch-ddp" in capsys.readouterr().err
