"""An emulated cluster on one Linux machine: one network namespace per host, a bridge as the switch, tc shaping.

Topology for N hosts (prefix ``ptb-``)::

    ptb-h0 [veth0 10.213.0.1/24] ── p0 ┐
    ptb-h1 [veth0 10.213.0.2/24] ── p1 ┼─ br0 in namespace ptb-sw (the switch)
    ...                                ┘

Links use jumbo frames (``mtu``, default 9000): with 1500-byte frames the per-packet cost of veth +
bridge + tbf caps a flow at ~1.6 Gbit/s on a 2-core machine, far below a 10gbit rate; at 9000 a flow
reaches ~9.9 Gbit/s there.

Shaping, per host link and per direction: a ``tbf`` at the egress of the host-side ``veth0`` (host ->
switch) and at the egress of the switch-side ``pI`` (switch -> host), so every host can send and receive
at most ``rate`` at once, as with a full-duplex NIC on a non-blocking switch (``host_rates`` gives chosen
hosts another rate: a slow link). ``burst`` is 1 ms of traffic at ``rate``, at least one frame (``mtu``
plus the Ethernet header; tbf cuts a larger GSO packet into frames), so no payload passes faster than
the rate: the floor of 128 KiB used until 2026-11-27 let 100 KB through a 10 Mbit/s link at once (0.08 s
at the rate) and 1 MB through 100 Mbit/s at 106 Mbit/s. ``limit`` (the queue) is ``burst`` plus 10 ms of
traffic at ``rate``, at least 256 KiB (29 jumbo frames): 10 ms alone is 2-3 frames at 10 Mbit/s, and the
TCP losses that follow cut a 2.5 MB transfer to 7.3 Mbit/s. Measured with these settings (one TCP
transfer between 2 hosts): 2.5 MB at 10 Mbit/s and 12.5 MB at 100 Mbit/s within 2% of the rate; from
1 Gbit/s up the settings are the old ones (1 ms is at least 125 KB, 10 ms at least 1.25 MB).
An optional one-way ``delay`` is a ``netem`` qdisc at the host-side egress (parent of that ``tbf``), so a
host-to-host round trip takes twice ``delay``; on a kernel without ``sch_netem`` the delay is dropped,
``delay`` becomes None and the reason is appended to ``warnings``.

Invariants:
- Needs root / CAP_NET_ADMIN; :class:`NetnsUnavailable` is raised if a namespace cannot be created.
- Only namespaces named with :data:`PREFIX` are created, entered or deleted; the root namespace's
  interfaces, addresses and routes are never touched (veth pairs are created inside the host namespace
  with their peer moved straight to the switch namespace), and only addresses in :data:`SUBNET` are used.
- :class:`EmulatedCluster` is a context manager: on exit (normal, exception, Ctrl-C) it kills every process
  still inside its namespaces and deletes them (which destroys the veths and qdiscs); stale namespaces with
  the prefix, left by a crashed earlier run, are removed the same way before setting up.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from typing import Iterator

from poseidon_torch.bench.scoped import Scoped
from poseidon_torch.link import parse_rate

PREFIX = "ptb-"
SUBNET = "10.213.0"
HOST_IFACE = "veth0"
BRIDGE = "br0"
ETHERNET_HEADER = 14  #: bytes a frame adds to the MTU on a veth (no FCS)
_BURST_SECONDS, _QUEUE_SECONDS, _MIN_QUEUE_BYTES = 1e-3, 10e-3, 256 * 1024


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no CAP_NET_ADMIN, no ``ip``)."""


def parse_delay(delay: str) -> str:
    """Validate a netem delay such as ``0.2ms`` or ``50us``; returned unchanged."""
    if not re.fullmatch(r"\d+(?:\.\d+)?(?:us|ms|s)", delay.strip()):
        raise ValueError(f"bad latency {delay!r}: expected e.g. 0.2ms, 50us")
    return delay.strip()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM/SIGHUP for the duration (cleanup must not be cut short); main thread only."""
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str) -> None:
    _ip("netns", "exec", namespace, "tc", *args)


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix``."""
    try:
        listing = _ip("netns", "list", check=False)
    except FileNotFoundError:
        return []
    names = (line.split()[0] for line in listing.splitlines() if line.strip())
    return [name for name in names if name.startswith(prefix)]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (all of them were started by this harness) and reap-wait."""
    for _ in range(50):
        pids = [int(pid) for pid in _ip("netns", "pids", namespace, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def delete_namespaces(names: list[str]) -> None:
    """Kill what runs inside each namespace, then delete it (its veth ends and qdiscs go with it)."""
    with signals_deferred():
        for name in names:
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces left with ``prefix`` by an earlier run; the names removed."""
    stale = list_namespaces(prefix)
    delete_namespaces(stale)
    return stale


def tbf_args(rate_bps: int, mtu: int) -> list[str]:
    """``tbf`` parameters for ``rate_bps`` on a link of ``mtu``: burst of 1 ms of traffic, at least one frame;
    queue limit of the burst plus 10 ms of traffic, at least 256 KiB (the module docstring says why)."""
    bytes_per_s = rate_bps / 8
    burst = max(int(bytes_per_s * _BURST_SECONDS), mtu + ETHERNET_HEADER)
    limit = burst + max(int(bytes_per_s * _QUEUE_SECONDS), _MIN_QUEUE_BYTES)
    return ["tbf", "rate", str(rate_bps), "burst", str(burst), "limit", str(limit)]


class EmulatedCluster(Scoped):
    """``hosts`` namespaces joined by a shaped bridge; use as ``with EmulatedCluster(2, "1gbit") as c: ...``."""

    def __init__(self, hosts: int, rate: str, delay: str | None = None, mtu: int = 9000,
                 prefix: str = PREFIX, host_rates: dict[int, str] | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        unknown = sorted(set(host_rates or {}) - set(range(hosts)))
        if unknown:
            raise ValueError(f"host_rates names host(s) {unknown}, the cluster has hosts 0..{hosts - 1}")
        self.hosts, self.mtu, self.prefix = hosts, mtu, prefix
        #: a host's link rate in bit/s, both directions: ``rate`` unless ``host_rates`` names the host
        self.host_rate_bps = {host: parse_rate((host_rates or {}).get(host, rate)) for host in range(hosts)}
        self.delay = parse_delay(delay) if delay else None
        self.switch = f"{prefix}sw"
        self.warnings: list[str] = []
        self._created: list[str] = []

    def namespace(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs, so the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def _build(self) -> None:
        cleanup_stale(self.prefix)
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for host in range(self.hosts):
            self._add_host(host)

    def close(self) -> None:
        """Delete every namespace this cluster created (idempotent)."""
        delete_namespaces(self._created)
        self._created = []

    def _add_namespace(self, name: str) -> None:
        try:
            _ip("netns", "add", name)
        except (RuntimeError, FileNotFoundError) as exc:
            raise NetnsUnavailable(f"cannot create network namespace {name} (needs root / CAP_NET_ADMIN "
                                   f"and iproute2): {exc}") from exc
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("netns", "exec", name, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1")

    def _add_host(self, host: int) -> None:
        ns, port = self.namespace(host), f"p{host}"
        self._add_namespace(ns)
        _ip("-n", ns, "link", "add", HOST_IFACE, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "mtu", str(self.mtu), "master", BRIDGE)
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", ns, "link", "set", HOST_IFACE, "mtu", str(self.mtu))
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", HOST_IFACE)
        _ip("-n", ns, "link", "set", HOST_IFACE, "up")
        shaper = tbf_args(self.host_rate_bps[host], self.mtu)
        if self.delay and self._add_netem(ns):
            _tc(ns, "qdisc", "add", "dev", HOST_IFACE, "parent", "1:1", "handle", "10:", *shaper)
        else:
            _tc(ns, "qdisc", "add", "dev", HOST_IFACE, "root", *shaper)
        _tc(self.switch, "qdisc", "add", "dev", port, "root", *shaper)

    def _add_netem(self, ns: str) -> bool:
        """Root ``netem delay`` on the host's veth; False (and a warning) if the kernel has no netem."""
        try:
            _tc(ns, "qdisc", "add", "dev", HOST_IFACE, "root", "handle", "1:", "netem", "delay", self.delay)
        except RuntimeError as exc:
            self.warnings.append(f"latency {self.delay} NOT applied (netem unavailable: {exc})")
            self.delay = None
            return False
        return True
