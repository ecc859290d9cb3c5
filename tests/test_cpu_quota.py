"""Each emulated host's CPU quota (``--cpus-per-host``, :mod:`poseidon_torch.bench.cpuquota`) holds.

- Two busy children of a command under a quota of 0.25 cores get about a quarter of a core's time
  between them, where without it each gets most of a core.
- Leaving the context kills what still runs in the cgroups and removes them; a bad value is refused.
Skipped where cgroups cannot be written (not root).
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from poseidon_torch.bench.__main__ import parse_args as parse_bench_args
from poseidon_torch.bench.cpuquota import CpuQuotaUnavailable, HostCpuQuota

#: a second of busy work, then the process's CPU seconds (one write: two of them share stdout)
BUSY = ("import os, time\n"
        "end = time.monotonic() + 1.0\n"
        "while time.monotonic() < end: pass\n"
        "t = os.times(); os.write(1, (str(t.user + t.system) + chr(10)).encode())\n")


def quota_or_skip(hosts: int, cpus: float) -> HostCpuQuota:
    try:
        return HostCpuQuota(hosts, cpus, prefix="ptt-").__enter__()
    except CpuQuotaUnavailable as exc:
        pytest.skip(f"no writable cgroup cpu controller here: {exc}")


def cpu_seconds_of(argv: list[str]) -> float:
    """The summed CPU seconds the busy processes that ``argv`` starts report."""
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    return sum(float(seconds) for seconds in out.split())


def test_a_host_gets_only_its_quota_of_cpu_its_children_included() -> None:
    busy = f"{sys.executable} -c '{BUSY}'"
    two_children = ["sh", "-c", f"{busy} & {busy} & wait"]
    quota = quota_or_skip(2, 0.25)
    try:
        capped = cpu_seconds_of(quota.command(1, two_children))
    finally:
        quota.close()
    free = cpu_seconds_of(two_children)
    # each child spins for 1 s of wall time; under the quota both share a quarter of a core, without it
    # each gets what the machine spares (most of a core when quiet; a loaded machine gives less to both)
    assert capped < 0.5, capped
    assert free > 2 * capped and free > 0.6, (free, capped)


def test_leaving_kills_what_still_runs_and_removes_the_cgroups() -> None:
    quota = quota_or_skip(2, 0.5)
    groups = [quota.group(host) for host in range(2)]
    sleeper = subprocess.Popen(quota.command(0, ["sleep", "60"]))
    deadline = time.monotonic() + 10
    while str(sleeper.pid) not in (groups[0] / "cgroup.procs").read_text().split():
        assert time.monotonic() < deadline, "the command never joined its host's cgroup"
        time.sleep(0.01)
    quota.close()
    assert sleeper.wait(timeout=10) != 0
    assert not any(group.exists() for group in groups)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "many"])
def test_a_bad_cpu_count_is_refused_before_anything_runs(tmp_path, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as refused:  # the benchmark's own parser, in process
        parse_bench_args(["--cpus-per-host", value, "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert "--cpus-per-host" in capsys.readouterr().err
