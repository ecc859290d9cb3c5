"""``benchmarks/compression_compute.py`` times what it says: each lossy path's own sync, run to its end,
against that path's predicted compute (a smoke run on the tiny language model, a few seconds)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from poseidon_torch.bucket import Bucket
from poseidon_torch.paths import Paths, PathEnv
from poseidon_torch.paths.ps import DEFAULT_CHUNK_BYTES

from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def script():
    with benchmark_script("compression_compute") as module:
        yield module


@pytest.mark.parametrize("name", ["PowerSGD", "INT8", "BF16", "FP16"])
def test_it_times_the_paths_own_sync_to_its_end(script, name):
    """Every parameter's new residual was proposed (the last step of each path's sync), and it is not
    zero: the path compressed (PowerSGD's rank-4 projection of a 32 x 48 matrix, a cast's rounding)."""
    torch.manual_seed(0)
    [layer] = script.layers_of(nn.Sequential(nn.Linear(48, 32, bias=False)))
    paths = Paths.build(PathEnv(0, 1, DEFAULT_CHUNK_BYTES, torch.device("cpu")))
    path, bucket = paths[name], Bucket(0, [layer])
    assert script.seconds_per_sync(path, bucket, syncs=1, repeats=1) > 0
    assert set(path._pending[id(bucket)]) == {id(p) for p in bucket.params}
    residual = path._pending[id(bucket)][id(bucket.params[0])]
    assert residual.abs().max() > 0  # what the path dropped: it compressed


def test_a_smoke_run_prints_a_row_per_layer_and_path(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["compression_compute.py", "--task", "lm", "--tiny", "--syncs", "1",
                                      "--repeats", "1", "--paths", "PowerSGD", "INT8"])
    script.main()
    out = capsys.readouterr().out
    assert "probed: GEMM" in out
    for name in ("PowerSGD", "INT8"):
        section = out.split(f"\n{name}\n")[1].split("\n\n")[0]
        assert section.splitlines()[-1].startswith("all "), section
