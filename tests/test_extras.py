"""The core install (torch and numpy) runs the wrapper, the server optimizer, the tracer's recording and
summary and the simulator's prediction; plotting and the benchmark harness say which extra they need.

One subprocess with every optional package made unimportable, as if it were not installed (``None`` in
``sys.modules``: an import raises ModuleNotFoundError, ``importlib.util.find_spec`` says it is absent)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("matplotlib", "sklearn", "scipy", "lightning", "pytorch_lightning", "transformers", "accelerate")

WITHOUT_EXTRAS = """
import sys

sys.modules.update(dict.fromkeys(OPTIONAL))

import contextlib, io, os, tempfile
import torch, torch.distributed as dist
from torch import nn

from poseidon_torch import PoseidonDDP, ServerOptimizer
from poseidon_torch.trace import load_spans, main as trace_main, summarize
from poseidon_torch.simulate import predict
from poseidon_torch.simulate.cli import main as simulate_main
from poseidon_torch.simulate.paper import vgg19_22k
from poseidon_torch.link import LinkModel

out = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
wrapped = PoseidonDDP(model, trace_dir=out, trace_skip=1, trace_iters=2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    opt.zero_grad()
    wrapped(torch.randn(4, 8)).sum().backward()
    opt.step()
wrapped.close()
summary = summarize(load_spans(f"{out}/trace_rank0.json"))
print("traced", len(summary["layers"]) > 0)

served = PoseidonDDP(nn.Linear(8, 2))
server = ServerOptimizer(served, torch.optim.AdamW, lr=0.01)
for _ in range(2):
    served(torch.randn(4, 8)).sum().backward()
    server.step()
    server.zero_grad()
server.consolidate_state_dict(to=0)
print("server", sorted(server.state_dict()["state"]) == [0, 1])
served.close()

rows = predict(vgg19_22k(), ["poseidon"], [1, 8], LinkModel.from_gbps(10.0, 50.0))
print("predicted", len(rows) == 2)

for name, run in (("trace-plot", lambda: trace_main(["plot", f"{out}/trace_rank0.json", "-o", f"{out}/t.png"])),
                  ("simulate-plot", lambda: simulate_main(["vgg19-22k", "--hosts", "1,2", "--bandwidth", "10gbit",
                                                           "--plot", f"{out}/s.png"]))):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = run()
    print(name, status, "poseidon-torch[plot]" in err.getvalue())

from poseidon_torch.extras import MissingExtra
from poseidon_torch.bench.accuracy.tasks import load_digits_tensors
from poseidon_torch.bench.__main__ import plot as bench_plot
for name, run in (("digits", load_digits_tensors), ("bench-plot", lambda: bench_plot({}, f"{out}/b.png"))):
    try:
        run()
        print(name, "ran")
    except MissingExtra as exc:
        print(name, "poseidon-torch[bench]" in str(exc))
print("imported", sorted(m for m in OPTIONAL if sys.modules[m] is not None))
"""


def test_the_core_runs_without_the_extras_and_plots_name_the_extra_they_need(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    script = f"OPTIONAL = {OPTIONAL!r}\n" + WITHOUT_EXTRAS
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "traced True", "server True", "predicted True", "trace-plot 2 True", "simulate-plot 2 True", "digits True",
        "bench-plot True", "imported []"], done.stdout + done.stderr[-3000:]
