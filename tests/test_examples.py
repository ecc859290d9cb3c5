"""The README's runnable examples still run (2 ranks under torchrun, few steps)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import free_port

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "examples" / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("server", [[], ["--server"]], ids=["default-mode", "server-mode"])
def test_lightning_example(server):
    pytest.importorskip("lightning")
    assert "loss:" in torchrun("lightning_train.py", "--steps", "4", *server)


@pytest.mark.parametrize("server", [[], ["--server"]], ids=["default-mode", "server-mode"])
def test_hf_example(server):
    pytest.importorskip("transformers")
    assert "loss:" in torchrun("hf_train.py", "--steps", "5", *server)


@pytest.mark.parametrize("staleness", [["2"], ["none"], ["none", "--push-every", "2", "--fetch-every", "3"]],
                         ids=["ssp2", "async", "downpour"])
def test_train_example_with_staleness(staleness):
    out = torchrun("train.py", "--steps", "6", "--warmup", "2", "--server", "--staleness", *staleness, "--compare-ddp")
    assert "PoseidonDDP speed vs torch DDP" in out and "loss" in out


@pytest.mark.parametrize("server", [[], ["--server"]], ids=["default-mode", "server-mode"])
def test_train_example_with_pipe_sgd(server):
    out = torchrun("train.py", "--steps", "6", "--warmup", "2", "--delay", "1", "--compare-ddp", *server)
    assert "PoseidonDDP speed vs torch DDP" in out and "loss" in out
