"""Launching ranks for the benchmarks: where they run (localhost or an emulated cluster), their
environment, and waiting for them with a deadline.

Shared by the throughput runner (:mod:`poseidon_torch.bench.__main__`) and the time-to-accuracy runner
(:mod:`poseidon_torch.bench.accuracy`).

Invariants:
- Every rank runs in its own process group; :func:`run_ranks` always stops them (SIGTERM, then SIGKILL)
  on return, failure, exceptions and Ctrl-C; SIGTERM / SIGHUP unwind like Ctrl-C once
  :func:`install_signal_handlers` ran, so namespaces are deleted by the placement's context manager.
- A rank that exits non-zero, or a run past its deadline, raises :class:`RankFailure` with the culprit's
  log tail.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import faulthandler
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn

import torch

from poseidon_torch.bench.cpuquota import HostCpuQuota
from poseidon_torch.bench.netns import HOST_IFACE, EmulatedCluster, NetnsUnavailable, signals_deferred

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_GRACE_S = 60.0
STOP_GRACE_S = 3.0
#: after a rank fails, how long its peers may take to fail too before the culprit is chosen
FAILURE_SETTLE_S = 1.0


@dataclass
class Placement:
    """Where ranks run: ``kind`` is the mode actually used; ``wrap(host, argv)`` is the command for a host."""
    kind: str
    master_addr: str
    gloo_iface: str
    wire_iface: str | None
    wrap: Callable[[int, list[str]], list[str]]
    latency: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: each host's CPU quota (:mod:`~poseidon_torch.bench.cpuquota`), None: hosts share the machine's cores
    cpus_per_host: float | None = None


class RankFailure(RuntimeError):
    """A rank exited non-zero or the run passed its deadline; ``log_tail`` holds the culprit's last lines."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived; raised from the handler so that the stack unwinds as with Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def install_signal_handlers() -> None:
    """SIGTERM / SIGHUP unwind like Ctrl-C does, so every ``finally`` and context manager cleans up."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)


def localhost_placement() -> Placement:
    return Placement("localhost", "127.0.0.1", "lo", None, lambda _host, argv: argv)


def _positive_cpus(text: str) -> float:
    cpus = float(text)
    if not (math.isfinite(cpus) and cpus > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of cores, got {text}")
    return cpus


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the ranks run: localhost or an emulated cluster, its links, and each host's CPU."""
    parser.add_argument("--mode", choices=("localhost", "netns"), default="localhost")
    parser.add_argument("--hosts", type=int, default=2, help="ranks, one per (emulated) host")
    parser.add_argument("--bandwidth", default="1gbit", help="link rate per host and direction, e.g. 1gbit, 10gbit")
    parser.add_argument("--latency", help="one-way host-to-host delay (netns mode, needs sch_netem), e.g. 0.2ms")
    parser.add_argument("--mtu", type=int, default=9000, help="link MTU in netns mode")
    parser.add_argument("--cpus-per-host", type=_positive_cpus,
                        help="cap each host's CPU at this many cores (a cgroup quota per host, needs root), so a "
                             "paused host cannot lend its CPU to the others; e.g. 0.5 for 4 hosts on 2 cores")


def open_placement(args: argparse.Namespace, stack: contextlib.ExitStack,
                   host_rates: dict[int, str] | None = None) -> Placement:
    """The emulated cluster in netns mode (entered on ``stack``; ``host_rates`` shape some hosts' links
    to other rates than ``args.bandwidth``), else, or if it cannot be built, localhost; with
    ``args.cpus_per_host``, every host's command runs under its CPU quota (raises
    :class:`~poseidon_torch.bench.cpuquota.CpuQuotaUnavailable` where it cannot)."""
    placement = _open_network(args, stack, host_rates)
    if args.cpus_per_host is None:
        return placement
    quota = stack.enter_context(HostCpuQuota(args.hosts, args.cpus_per_host))
    return dataclasses.replace(placement, wrap=lambda host, argv: quota.command(host, placement.wrap(host, argv)),
                               cpus_per_host=args.cpus_per_host)


def _open_network(args: argparse.Namespace, stack: contextlib.ExitStack,
                  host_rates: dict[int, str] | None) -> Placement:
    if args.mode == "netns":
        try:
            cluster = stack.enter_context(EmulatedCluster(args.hosts, args.bandwidth, args.latency, args.mtu,
                                                          host_rates=host_rates))
        except NetnsUnavailable as exc:
            print(f"netns mode unavailable: {exc}\nFalling back to localhost mode.", file=sys.stderr)
        else:
            return Placement("netns", cluster.address(0), HOST_IFACE, HOST_IFACE, cluster.command,
                             cluster.delay, list(cluster.warnings))
    return localhost_placement()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_per_rank(hosts: int) -> int:
    return 1 if hosts > 1 else (os.cpu_count() or 1)


def rank_env(placement: Placement, rank: int, world: int, port: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=placement.master_addr, MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME=placement.gloo_iface, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    return env


def _log_text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(_log_text(log).splitlines()[-lines:])


def _watchdog_line(log: Path) -> str | None:
    """The watchdog's ``Timeout (h:mm:ss)!`` line, if it fired in this rank."""
    return next((line.strip() for line in _log_text(log).splitlines() if line.startswith("Timeout (")), None)


def _reason(log: Path) -> str:
    """Why a rank failed, from its log: the watchdog's line if it fired (the stack dump after it ends in
    runpy's frames), else the last non-empty line."""
    timeout = _watchdog_line(log)
    if timeout:
        return f"{timeout} the rank ran past its --timeout"
    lines = [line.strip() for line in _log_text(log).splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _culprit(procs: list[subprocess.Popen], logs: list[Path]) -> int:
    """The rank to blame once some rank failed: its peers usually fail a moment later with a lost
    connection, and may be polled first, so wait briefly for them and prefer a rank whose own watchdog
    fired; else the lowest failed rank."""
    deadline = time.monotonic() + FAILURE_SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    failed = [rank for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
    return next((rank for rank in failed if _watchdog_line(logs[rank])), failed[0])


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank's process group, SIGKILL what is left after a grace period, reap all."""
    with signals_deferred():
        live = [p for p in procs if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float,
             on_poll: Callable[[], None] | None = None) -> None:
    """Return when every rank exited 0; raise :class:`RankFailure` at the first failure or at the deadline.
    ``on_poll`` runs at every poll (e.g. to echo progress from a log)."""
    deadline = time.monotonic() + timeout
    while True:
        if on_poll:
            on_poll()
        codes = [p.poll() for p in procs]
        if any(code not in (None, 0) for code in codes):
            rank = _culprit(procs, logs)
            raise RankFailure(f"rank {rank} exited with status {procs[rank].returncode}: {_reason(logs[rank])}",
                              _log_tail(logs[rank]))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            tail = _log_tail(logs[codes.index(None)])
            raise RankFailure(f"timed out after {timeout:.0f} s", tail)
        time.sleep(0.05)


def run_ranks(commands: list[list[str]], envs: list[dict[str, str]], logs: list[Path], timeout: float,
              on_poll: Callable[[], None] | None = None) -> None:
    """Start one process per rank (own process group, output to its log) and wait for all of them."""
    procs: list[subprocess.Popen] = []
    try:
        for command, env, log in zip(commands, envs, logs):
            with log.open("w") as out:
                procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        wait_all(procs, logs, timeout, on_poll)
    finally:
        stop(procs)


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path




def run_placed(args: argparse.Namespace, run_all: Callable[[Placement], dict],
               host_rates: dict[int, str] | None = None) -> dict | int:
    """Create ``args.out``'s ``runs`` and ``logs``, open the placement and ``run_all`` on it; the report, or
    the exit status ``128 + signal`` after Ctrl-C / SIGTERM / SIGHUP (workers stopped, namespaces gone)."""
    install_signal_handlers()
    for sub in ("runs", "logs"):
        (args.out / sub).mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").unlink(missing_ok=True)  # an earlier run's must not pass for this one's
    try:
        with contextlib.ExitStack() as stack:
            return run_all(open_placement(args, stack, host_rates))
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}; workers stopped, namespaces removed", file=sys.stderr)
        return 128 + signum


def write_report(out: Path, report: dict, plot: Callable[[dict, Path], None], table: Callable[[dict], str]) -> None:
    """``out/results.json`` and ``out/results.png``; the table on stdout."""
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "results.png")
    print(table(report))
    print(f"\nwrote {out / 'results.json'} and {out / 'results.png'}")


def worker_main(run: Callable[[], None], timeout: float, label: str) -> int:
    """A rank's body: ``run()`` under a watchdog that dumps every thread's stack and exits after ``timeout``;
    0, or 1 with the traceback and a one-line reason naming ``label`` and the rank. Subnormal floats are
    flushed to zero: on CPU they cost 5-8x per operation (the ``gpt2`` workload's SGD steps make some,
    and its iterations then took 6 s instead of 0.8 s for a few steps), which would time the numerics of
    one trajectory instead of the modes: every mode of every benchmark runs with the same setting."""
    torch.set_flush_denormal(True)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        run()
    except Exception as exc:
        traceback.print_exc()
        print(f"worker {label} rank {os.environ.get('RANK', '0')} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


def exit_worker(status: int) -> NoReturn:
    """End a rank once its result is written and its groups destroyed, skipping the interpreter's teardown,
    in which torch's gloo backend now and then aborts ("terminate called without an active exception",
    seen in compute-only runs too, which use no PoseidonDDP)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
