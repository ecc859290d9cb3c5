"""Each emulated host's CPU, as a CFS quota on a cgroup of its own, so hosts cannot lend each other cores.

When a machine emulates more hosts than it has cores, the hosts' ranks share the cores: a host that
pauses (a straggler asleep) hands its CPU time to the others, which then run faster while it waits, so a
synchronous mode loses far less to the pause than on hosts with cores of their own (measured: 4 emulated
hosts on 2 cores, BSP ran 310 steps in 100 s without a straggler and 304 with every host pausing 5-10 s).
With ``cpus`` per host, each host's processes run in a cgroup whose quota is ``cpus`` CPUs per period, so
a paused host's share stays idle, as a real host's cores do.

Invariants:
- only cgroups named with the prefix (``ptb-`` by default) are created, entered or removed, directly under
  the cpu controller's root (cgroup v1 ``cpu.cfs_quota_us``, tested; or v2 ``cpu.max``, which needs the
  controller enabled for the root's children and is not tested here: this machine mounts v1);
- a command joins its host's cgroup before it execs, so every thread and child it starts is in it;
- :class:`HostCpuQuota` is a context manager: on exit it kills what still runs in its cgroups and removes
  them; stale ones left by a crashed run are removed the same way on entry;
- :class:`CpuQuotaUnavailable` is raised where no writable cpu controller exists (not root, no cgroups).
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from poseidon_torch.bench.scoped import Scoped

PREFIX = "ptb-"
#: a short CFS period: a host throttled within it stalls at most this long at a time
PERIOD_US = 10_000
_REMOVE_TRIES = 50


class CpuQuotaUnavailable(RuntimeError):
    """No writable cgroup cpu controller here."""


def cpu_controller_root(mounts: str = "/proc/mounts") -> tuple[Path, int]:
    """Where the cpu controller is mounted, and its cgroup version (1 or 2)."""
    with open(mounts) as lines:
        entries = [line.split() for line in lines]
    for _dev, where, kind, options, *_ in entries:
        if kind == "cgroup" and "cpu" in options.split(","):
            return Path(where), 1
    for _dev, where, kind, *_ in entries:
        controllers = Path(where) / "cgroup.controllers"
        if kind == "cgroup2" and controllers.exists() and "cpu" in controllers.read_text().split():
            return Path(where), 2
    raise CpuQuotaUnavailable("no cgroup cpu controller is mounted (cgroup v1 'cpu' or v2 with 'cpu')")


def _kill_and_remove(group: Path) -> None:
    """SIGKILL every process of ``group`` and remove it once they are gone."""
    for _ in range(_REMOVE_TRIES):
        procs = (group / "cgroup.procs").read_text().split() if group.exists() else []
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while killed processes are reaped
            time.sleep(0.02)
    raise RuntimeError(f"cgroup {group} still busy after its processes were killed")


class HostCpuQuota(Scoped):
    """``hosts`` cgroups of ``cpus`` CPUs each; ``command(host, argv)`` runs ``argv`` in host's cgroup."""

    def __init__(self, hosts: int, cpus: float, prefix: str = PREFIX) -> None:
        if not cpus > 0:
            raise ValueError(f"cpus per host must be positive, got {cpus}")
        self.hosts, self.cpus, self.prefix = hosts, cpus, prefix
        self.quota_us = max(1000, round(cpus * PERIOD_US))  # the kernel's smallest quota is 1 ms
        self.root, self.version = cpu_controller_root()
        self._created: list[Path] = []

    def group(self, host: int) -> Path:
        return self.root / f"{self.prefix}h{host}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` after the shell that runs it has joined ``host``'s cgroup (``exec``: same pid)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.group(host) / "cgroup.procs"), *argv]

    def _build(self) -> None:
        for stale in self.root.glob(f"{self.prefix}*"):
            _kill_and_remove(stale)
        for host in range(self.hosts):
            self._add(self.group(host))

    def close(self) -> None:
        """Kill what still runs in the cgroups and remove them (idempotent)."""
        for group in self._created:
            _kill_and_remove(group)
        self._created = []

    def _add(self, group: Path) -> None:
        try:
            group.mkdir()
        except OSError as exc:
            raise CpuQuotaUnavailable(f"cannot create cgroup {group} (needs root): {exc}") from exc
        self._created.append(group)
        if self.version == 1:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        elif (group / "cpu.max").exists():
            (group / "cpu.max").write_text(f"{self.quota_us} {PERIOD_US}")
        else:
            raise CpuQuotaUnavailable(f"the cpu controller is not enabled for {self.root}'s children "
                                      f"(add it to {self.root / 'cgroup.subtree_control'})")
