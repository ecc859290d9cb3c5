"""A pool of P long-lived gloo ranks for tests, so hypothesis examples do not each pay process start-up.

``Cluster.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the per-rank
results. Every wait has a deadline: a rank that raises, dies or overruns fails the call with the rank's
traceback or exit code, never a hang. Every call is numbered: a result that a rank sends after its call
timed out is dropped, never taken for a later call's.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp

import placement


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: object  # the result, or the formatted traceback
    call: int  # the number of the call it answers


class ClusterError(RuntimeError):
    pass


def _serve(rank: int, world_size: int, port: int, jobs, results) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash of a rank prints its stacks instead of dying silently

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        placement.place_rank(rank)
        unplaced = None
    except RuntimeError:  # every job answers with it, so the test says why instead of timing out
        unplaced = traceback.format_exc()
    while (job := jobs.get()) is not None:
        fn, args, env, call = job
        if unplaced is not None:
            results.put(RankOutcome(rank, False, unplaced, call))
            continue
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            results.put(RankOutcome(rank, True, placement.to_host(fn(rank, world_size, *args)), call))
        except BaseException:
            results.put(RankOutcome(rank, False, traceback.format_exc(), call))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class Cluster:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._calls = 0
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, world_size, port, self._jobs[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run_outcomes(self, fn, *args, timeout: float = 120.0, env: dict[str, str] | None = None
                     ) -> dict[int, RankOutcome]:
        """Run ``fn`` on every rank (with ``env`` set in its environment for the call); outcomes of the
        ranks that answered before the deadline or death."""
        self._calls += 1
        for q in self._jobs:
            q.put((fn, args, dict(env or {}), self._calls))
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            try:
                outcome = self._results.get(timeout=0.2)
                if outcome.call == self._calls:  # an earlier call's late answer is dropped
                    outcomes[outcome.rank] = outcome
            except queue.Empty:
                if self._all_silent_ranks_dead(outcomes):
                    break
        return outcomes

    def _all_silent_ranks_dead(self, outcomes) -> bool:
        silent = [r for r in range(self.world_size) if r not in outcomes]
        return all(not self._procs[r].is_alive() for r in silent)

    def run(self, fn, *args, timeout: float = 120.0, env: dict[str, str] | None = None) -> list:
        outcomes = self.run_outcomes(fn, *args, timeout=timeout, env=env)
        problems = []  # every rank's, not only the first: the root cause may be a peer's
        for rank in range(self.world_size):
            outcome = outcomes.get(rank)
            if outcome is None:
                code = self._procs[rank].exitcode
                problems.append(f"rank {rank} gave no result within {timeout}s (exit code {code})")
            elif not outcome.ok:
                problems.append(f"rank {rank} raised:\n{outcome.value}")
        if problems:
            raise ClusterError("\n".join(problems))
        return [outcomes[r].value for r in range(self.world_size)]

    def exit_code(self, rank: int, timeout: float = 10.0) -> int | None:
        self._procs[rank].join(timeout)
        return self._procs[rank].exitcode

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave; kill what is still alive ``grace_s`` later (a rank whose peer died
        may hang in gloo's teardown)."""
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(None)
            q.cancel_join_thread()  # jobs queued for a dead rank must not hold this process's exit
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
