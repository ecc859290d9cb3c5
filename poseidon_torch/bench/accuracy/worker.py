"""One rank of one time-to-accuracy run: train a task in one mode, snapshot the model at fixed steps,
evaluate the snapshots after training, report JSON.

Usage (normally launched by ``python -m poseidon_torch.bench.accuracy``)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m poseidon_torch.bench.accuracy.worker --task lm --mode torch-ddp --steps 200 \\
        --eval-every 20 --result out.json [--time-budget S] [--straggler persistent:factor=2] [--tiny]

Modes are the throughput benchmark's (:data:`poseidon_torch.bench.worker.MODES`); ``compute-only`` trains
each rank alone on its own shard (never syncs: the wrong answer the parity check must catch); ``one-host``
is one process alone (a world of one) reading the shard of rank 0 among ``--shards`` hosts.

Invariants:
- A step is: straggler pause, zero_grad, forward, loss, backward, optimizer step. Each rank reads its own
  shard through a ``DistributedSampler`` (seeded, ``set_epoch`` every epoch), so every mode sees the same
  data in the same order.
- The training clock starts after a barrier; times are rank 0's clock. At step 0, every ``--eval-every``
  steps and at the end, rank 0 waits for its parameters to be current (``PoseidonDDP.synchronize()``:
  lazy pulls land; counted, as the next forward would have waited for them) and copies its module's
  ``state_dict`` (not counted on rank 0's clock; another rank of a synchronous mode may wait for it at
  its next sync). Validation runs after training, on rank 0, on those copies, with every core rank 0
  may use (the others wait); ``--timeout`` covers it.
- Local SGD (``torch-ddp-localsgd``) evaluates the model every host would hold after averaging: at an
  evaluation point between two averages every rank averages a copy of its parameters (torch's
  ``average_parameters``, collective) and rank 0 evaluates that average, while training goes on from each
  rank's own parameters, as without evaluations. The average counts in that point's time (delivering that
  model costs it) but not in the training after it, and its bytes are not counted. After the last step
  every rank averages its own parameters (counted: the job ends with one model), unless that step did.
  PoseidonDDP's periodic modes (``poseidon-localsgd``, ``poseidon-diloco``: ``sync_every`` =
  ``--localsgd-period``) are evaluated the same way; their ranks agree after every H-th step (DiLoCo's
  model there is the outer optimizer's), and between syncs, and after a last step that did not sync,
  the model every host would hold is taken as the average of their parameters (no outer step).
- Bytes per step: what each rank sends while it trains, evaluations and progress lines left out: its
  interface's ``tx_bytes`` with ``--wire-iface`` (netns mode, headers included), else what its process
  writes (``/proc/self/io``'s ``wchar``: its socket writes, payload only).
- ``--compute-s``: the straggler's calibration taken from an earlier mode of the run, so every mode
  gets the same straggler; without it the rank calibrates.
- ``--time-budget``: modes without a barrier per step (``compute-only``, ``one-host``, SSP and asynchronous
  SGD) stop each rank on its own clock, once it has trained that long (SSP's and asynchronous SGD's
  ``finish()`` then lands the owners' newest values everywhere). Every other mode stops every rank after
  the same step: when rank 0's clock passes the budget after ``n`` steps, it publishes in the run's store
  the first step that no rank can have passed yet, and every rank stops after it: ``n + 1`` where no rank
  finishes a step before every rank's backward of that step (DDP, its hooks, the BSP modes); ``n + 2``
  under Pipe-SGD and lazy pulls, where a rank waits for a step's sync only in the next step, so it may
  finish one step more than another and have started the next before rank 0 publishes; and local SGD's
  (torch's or PoseidonDDP's periodic modes') next step that syncs (their ranks meet only there).
- Rank 0 writes the result; any error or running past ``--timeout`` ends the process non-zero.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from poseidon_torch.bench.accuracy.stragglers import Straggler, parse_straggler
from poseidon_torch.bench.accuracy.tasks import TASKS, Task
from poseidon_torch.bench.baselines import LOCALSGD, ONE_HOST, Baselines, LocalSGDConsensus, \
    add_baseline_arguments, baselines_from
from poseidon_torch.bench.launch import exit_worker, worker_main
from poseidon_torch.bench.worker import DELAY_MODES, MODES, PERIODIC_MODES, POSEIDON_MODES, STALE_MODES, delay_for, \
    fragments_for, make_optimizer, read_tx_bytes, wrapper_for, written_bytes

DATA_SEED = 97
CALIBRATION_STEPS = 5
#: modes without a barrier per step: each rank stops on its own clock
OWN_CLOCK_MODES = ("compute-only", ONE_HOST, *STALE_MODES)
#: modes whose ranks wait for a step's sync only in the next step: one may be a step ahead of another
ONE_STEP_AHEAD_MODES = (*DELAY_MODES, "poseidon-server-lazy", "poseidon-server-lazy-priority")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m poseidon_torch.bench.accuracy.worker",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, help="steps per rank (with --time-budget: at most)")
    parser.add_argument("--time-budget", type=float, help="seconds of training on rank 0's clock")
    parser.add_argument("--eval-every", type=int, required=True, help="snapshot every this many steps")
    parser.add_argument("--straggler", default="none")
    parser.add_argument("--compute-s", type=lambda text: [float(x) for x in text.split(",")],
                        help="each rank's calibrated step seconds (from an earlier mode of the run), comma-separated")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--shards", type=int, help="one-host: the hosts whose shards the data is cut into")
    parser.add_argument("--wire-iface", help="count the bytes sent from this interface's tx_bytes")
    add_baseline_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps is None and args.time_budget is None:
        parser.error("give --steps, --time-budget or both")
    if (args.shards is not None) != (args.mode == ONE_HOST):
        parser.error("--shards goes with --mode one-host, and only with it")
    return args


class Clock:
    """What ``read`` counts (default: seconds) since :meth:`start`, not counting what :meth:`excluded`
    spans or :meth:`exclude` names."""

    def __init__(self, read: Callable[[], float] = time.perf_counter) -> None:
        self.read = read
        self._start = self._excluded = 0.0

    def start(self) -> None:
        self._start, self._excluded = self.read(), 0.0

    def elapsed(self) -> float:
        return self.read() - self._start - self._excluded

    def exclude(self, amount: float) -> None:
        self._excluded += amount

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        start = self.read()
        try:
            yield
        finally:
            self.exclude(self.read() - start)


def sent_bytes_reader(wire_iface: str | None) -> Callable[[], float] | None:
    """This rank's sent bytes so far: its interface's, or its process's writes (module docstring); None
    where neither can be read."""
    if wire_iface:
        return lambda: read_tx_bytes(wire_iface)
    return written_bytes if written_bytes() is not None else None


def batches(task: Task, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of the training set, epoch after epoch, as ``DistributedSampler`` deals it."""
    sampler = DistributedSampler(task.train_set, num_replicas=world, rank=rank, shuffle=True, seed=DATA_SEED,
                                 drop_last=True)
    loader = DataLoader(task.train_set, batch_size=task.batch_size, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def calibrate(task: Task, data: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds of one training step without sync (zero_grad, forward, backward, optimizer step) on a copy of
    the model: the fastest of a few after one untimed step (the least disturbed by other processes)."""
    model = task.build_model()
    optimizer = task.optimizer[0](model.parameters(), **task.optimizer[1])
    times = []
    for (x, y), _ in zip(data, range(CALIBRATION_STEPS + 1)):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def copy_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the (wrapped) module's current parameters and buffers."""
    module = getattr(model, "module", model)
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class StopRule:
    """When to stop: after ``--steps``; or, with ``--time-budget``, on the rank's own clock (modes without a
    barrier per step), or after the step that rank 0 publishes once its clock passes the budget:
    ``meeting(n)``, the first step no rank can have passed when rank 0 has done ``n``."""

    def __init__(self, args: argparse.Namespace, store: dist.Store, rank: int, clock: Clock,
                 meeting: Callable[[int], int]) -> None:
        self.steps, self.budget, self.store, self.rank, self.clock = args.steps, args.time_budget, store, rank, clock
        self.meeting, self.own_clock = meeting, args.mode in OWN_CLOCK_MODES
        self.stop_at: int | None = None

    def done(self, steps_done: int) -> bool:
        if self.steps is not None and steps_done >= self.steps:
            return True
        if self.budget is None:
            return False
        if self.own_clock:
            return self.clock.elapsed() >= self.budget
        if self.stop_at is None and self.rank == 0 and self.clock.elapsed() >= self.budget:
            self.stop_at = self.meeting(steps_done)
            self.store.set("stop_at", str(self.stop_at))
        if self.stop_at is None and self.store.check(["stop_at"]):
            self.stop_at = int(self.store.get("stop_at"))
        return self.stop_at is not None and steps_done >= self.stop_at

    def describe(self) -> str:
        if self.budget is None:
            return "steps"
        return "own clock" if self.own_clock else "rank 0's clock, every rank after the same step"


class PeriodicConsensus(LocalSGDConsensus):
    """:class:`LocalSGDConsensus` for PoseidonDDP(sync_every=H) with H the local SGD period: the ranks agree
    at the start and after every H-th step (the sync runs inside that step). With ``delay`` d they agree
    only at the start (each keeps its d steps on top of what lands), and a rank finishes step kS + d only
    once every rank finished step kS (the sync it lands was sent by all; S = H / fragments, the steps
    between two syncs): once rank 0 has done n steps, no rank has finished step kS + d for the first
    kS > n, but one may have started it (its backward sending that step's sync) before it reads the
    published stop, so every rank stops after kS + d (after kS + d - 1 a rank that had started kS + d
    waited at its close for a sync the others never sent: the CI failure of 2026-11-29)."""

    def __init__(self, baselines: Baselines, delay: int = 0, fragments: int = 1) -> None:
        super().__init__(baselines)
        self.delay, self.spacing = delay, self.period // fragments

    def _syncs(self, step: int) -> bool:
        return step == 0 if self.delay else step % self.period == 0

    def next_meeting(self, steps_done: int) -> int:
        if not self.delay:
            return super().next_meeting(steps_done)
        return (steps_done // self.spacing + 1) * self.spacing + self.delay


def consensus_for(mode: str, baselines: Baselines) -> LocalSGDConsensus | None:
    """When the ranks of ``mode`` agree, for the modes whose ranks meet only every few steps."""
    if mode == LOCALSGD:
        return LocalSGDConsensus(baselines)
    if mode not in PERIODIC_MODES:
        return None
    return PeriodicConsensus(baselines, delay_for(mode, baselines), fragments_for(mode, baselines))


def meeting_rule(mode: str, consensus: LocalSGDConsensus | None) -> Callable[[int], int]:
    """The first step every rank can still stop after, once rank 0 has done ``n`` (module docstring)."""
    if consensus is not None:
        return consensus.next_meeting
    ahead = 1 if mode in ONE_STEP_AHEAD_MODES else 0
    return lambda steps_done: steps_done + 1 + ahead


def digest(module: nn.Module) -> str:
    """A fingerprint of the module's parameters: equal on two ranks iff they hold the same bits."""
    sha = hashlib.sha256()
    for tensor in module.parameters():
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def train(args: argparse.Namespace, task: Task, straggler: Straggler, store: dist.Store, rank: int,
          world: int) -> dict:
    """The training loop of this rank; its raw record (rank 0's includes the snapshots)."""
    data = batches(task, rank, args.shards or world)
    if args.compute_s:
        compute_s = args.compute_s[rank]
    else:
        compute_s = calibrate(task, batches(task, rank, args.shards or world)) if straggler.needs_calibration else 0.0
    baselines = baselines_from(args)
    model = wrapper_for(args.mode, args.timeout, baselines=baselines)(task.build_model())
    module = getattr(model, "module", model)
    optimizer = make_optimizer(args.mode, model, *task.optimizer, baselines)
    consensus = consensus_for(args.mode, baselines)
    read_sent = sent_bytes_reader(args.wire_iface)
    clock, sent = Clock(), Clock(read_sent or (lambda: 0.0))
    snapshots, step_end_s, losses, pauses, digests = [], [], [], [], {}
    stop = StopRule(args, store, rank, clock, meeting_rule(args.mode, consensus))
    last_snapshot = -1

    def take_snapshot(steps_done: int) -> None:
        nonlocal last_snapshot
        last_snapshot, state, averaging_s = steps_done, None, 0.0
        if consensus is not None:  # every rank: the average every host would hold (collective)
            with sent.excluded():
                start = time.perf_counter()
                state = consensus.averaged_copy(copy_state(model), module, steps_done)
                averaging_s = time.perf_counter() - start
        if rank == 0:
            if args.mode in POSEIDON_MODES:
                model.synchronize()  # lazy pulls land: training time (the next forward would wait for them)
            at, start = clock.elapsed(), time.perf_counter()
            with sent.excluded():
                snapshots.append((steps_done, at, state if state is not None else copy_state(model)))
                print(f"progress: step {steps_done}, {at:.1f} s" + (f", train loss {losses[-1]:.3f}" if losses else ""),
                      flush=True)
            clock.exclude(time.perf_counter() - start)
        clock.exclude(averaging_s)

    dist.barrier()
    clock.start()
    sent.start()
    take_snapshot(0)
    while not stop.done(len(step_end_s)):
        x, y = next(data)
        pauses.append(straggler.pause_s(rank, len(step_end_s), compute_s))
        straggler.wait_out(pauses[-1])
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_end_s.append(clock.elapsed())
        if len(step_end_s) % args.eval_every == 0:
            take_snapshot(len(step_end_s))
    if hasattr(optimizer, "staleness") and optimizer.stale:  # SSP/async: the owners' newest values, everywhere
        optimizer.finish()  # waiting for the others is training time: the snapshot's clock includes it
        take_snapshot(len(step_end_s))
    if consensus is not None:  # the job ends with one model: every rank averages, on the clock
        digests["before_final_average"] = digest(module)
        consensus.average_in_place(module, len(step_end_s))
    if last_snapshot != len(step_end_s):
        take_snapshot(len(step_end_s))
    sent_bytes = sent.elapsed() if read_sent else None
    if args.mode in POSEIDON_MODES:
        model.close()
    digests["final"] = digest(module)
    return {"step_end_s": step_end_s, "train_losses": losses, "pauses_s": pauses, "compute_s": compute_s,
            "sent_bytes": sent_bytes, "param_digests": digests, "stop_rule": stop.describe(),
            "snapshots": snapshots}


def evaluate(task: Task, snapshots: list[tuple[int, float, dict]]) -> list[dict]:
    """Validation metrics of every snapshot, with its step and training time."""
    model, points = task.build_model(), []
    for steps_done, at, state in snapshots:
        model.load_state_dict(state)
        points.append({"step": steps_done, "time_s": at, **task.evaluate(model)})
    return points


def summarise(args: argparse.Namespace, task: Task, straggler: Straggler, records: list[dict],
              points: list[dict]) -> dict:
    steps = [len(r["step_end_s"]) for r in records]
    train_time = points[-1]["time_s"]  # rank 0's clock, as every point's (its last step is done by then)
    return {
        "mode": args.mode, "task": args.task, "tiny": args.tiny, "world_size": len(records),
        "batch_per_rank": task.batch_size, "metric": task.metric, "optimizer": task.optimizer[0].__name__,
        "optimizer_args": task.optimizer[1], "data": task.data, "straggler": straggler.describe(),
        "steps_by_rank": steps, "train_time_s": train_time,
        "samples_per_s": sum(steps) * task.batch_size / train_time if train_time else 0.0,
        "compute_s_by_rank": [r["compute_s"] for r in records],
        "pause_s_by_rank": [sum(r["pauses_s"]) for r in records],
        "step_end_s_by_rank": [r["step_end_s"] for r in records],
        "train_loss_rank0": records[0]["train_losses"], "evals": points,
        "s_per_step": train_time / steps[0] if steps[0] else None, "stop_rule": records[0]["stop_rule"],
        "data_shards": args.shards or len(records), **sent_per_step(args, records),
        "param_digests_by_rank": [r["param_digests"] for r in records],
    }


def sent_per_step(args: argparse.Namespace, records: list[dict]) -> dict:
    """Bytes each rank sent per step of its own, their mean over the ranks, and where they were read."""
    if any(r["sent_bytes"] is None for r in records):
        return {"bytes_per_step_per_host": None, "bytes_source": None}
    per_rank = [r["sent_bytes"] / max(len(r["step_end_s"]), 1) for r in records]
    return {"bytes_per_step_by_rank": per_rank, "bytes_per_step_per_host": sum(per_rank) / len(per_rank),
            "bytes_source": "wire" if args.wire_iface else "sent"}


def init_process_group(timeout: float) -> tuple[dist.Store, int, int]:
    """The gloo group of RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, on a store this run keeps."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    return store, rank, world


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    store, rank, world = init_process_group(args.timeout)
    try:
        task = TASKS[args.task](args.tiny)
        straggler = parse_straggler(args.straggler, args.shards or world)  # one-host: host 0 of the cluster
        record = train(args, task, straggler, store, rank, world)
        if rank == 0:  # off the clock, the other ranks waiting: every core this rank may use
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        points = evaluate(task, record.pop("snapshots")) if rank == 0 else []
        records = [None] * world
        dist.all_gather_object(records, record)
        if rank == 0:
            args.result.write_text(json.dumps(summarise(args, task, straggler, records, points), indent=1))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(lambda: run(args), args.timeout, f"{args.mode}/{args.task}")


if __name__ == "__main__":
    exit_worker(main())
