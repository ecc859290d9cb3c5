"""The coordinator's view of the hardware: an alpha-beta model of the link, the GEMM rate, and the
memory bandwidth (what a compressing path's passes over a gradient cost).

The link is probed with all-reduces of several sizes, each repeated; the fit takes the median per size
and a Theil-Sen line through them (the median of pairwise slopes), which a few slow repeats on a
loaded machine cannot drag. A fit outside a sanity range (bandwidth or latency no real link has) is
rejected: the model then falls back to a stated default, and a warning says so and how to give the
real figures (``link=``, ``POSEIDON_BANDWIDTH_GBPS``, ``POSEIDON_LATENCY_US``).

Invariants: every rank gets the same numbers (each size's time is the slowest rank's; the GEMM rate and
the memory bandwidth are the slowest rank's), so every rank plans identically; probes are cached per set of ranks, backend and
device.
"""
from __future__ import annotations

import math
import re
import statistics
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

import torch
import torch.distributed as dist

from .env import from_env
from .pools import Collectives

DEFAULT_PROBE_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)
#: What a fit may say and still be believed: the bandwidth of a real link (down to 1 Mbit/s: a shaped
#: 10 Mbit/s link measures 9.25 and was refused at a floor of 10, so compression= never paid there),
#: per-message latency from a loopback to a slow WAN.
BANDWIDTH_RANGE_GBPS = (0.001, 400.0)
LATENCY_RANGE_S = (0.0, 0.05)
#: Used when the fit is unusable (and said so in a warning).
DEFAULT_BANDWIDTH_GBPS = 10.0
DEFAULT_LATENCY_US = 50.0
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(rate: str) -> int:
    """A tc rate such as ``1gbit`` or ``100mbit`` in bits per second (decimal units, like tc)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"bad rate {rate!r}: expected e.g. 1gbit, 10gbit, 500mbit")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of one rank's link: ``seconds = alpha * messages + beta * bytes``."""

    alpha_s: float
    beta_s_per_byte: float
    source: str = "given"  #: "given", "probed", "environment" or "default (...)"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"a link's latency must be finite and >= 0 (link= or POSEIDON_LATENCY_US), "
                             f"got {self.alpha_s * 1e6} us")
        if not (math.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte >= 0):
            raise ValueError(f"a link's seconds per byte must be finite and >= 0 (link= or "
                             f"POSEIDON_BANDWIDTH_GBPS), got {self.beta_s_per_byte}")

    @classmethod
    def from_gbps(cls, bandwidth_gbps: float, latency_us: float = 0.0, source: str = "given") -> LinkModel:
        """From a bandwidth in Gbit/s (as Ethernet is rated) and a per-message latency in µs."""
        if not bandwidth_gbps > 0 or not latency_us >= 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {bandwidth_gbps} Gbit/s, "
                             f"{latency_us} us")
        return cls(latency_us * 1e-6, 8.0 / (bandwidth_gbps * 1e9), source)

    @property
    def bandwidth_gbps(self) -> float:
        return float("inf") if self.beta_s_per_byte == 0 else 8.0 / self.beta_s_per_byte / 1e9

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return self.alpha_s * messages + self.beta_s_per_byte * nbytes

    def __str__(self) -> str:
        return (f"alpha {self.alpha_s * 1e6:.3g} us, bandwidth {self.bandwidth_gbps:.3g} Gbit/s "
                f"({self.source})")


@dataclass(frozen=True)
class LinkFit:
    model: LinkModel | None  #: None when the timings do not grow with the size
    usable: bool
    reason: str = ""


def fit_link(sizes: Sequence[int], seconds: Sequence[Sequence[float]], world_size: int) -> LinkFit:
    """Fit a :class:`LinkModel` to all-reduce timings (``seconds[i]``: repeated timings of a float32
    all-reduce of ``sizes[i]`` bytes).

    A ring all-reduce of S bytes over P ranks takes 2(P-1) steps and sends 2(P-1)/P S bytes per rank:
    ``t(S) = a + b S`` with ``a = 2(P-1) alpha`` and ``b = 2(P-1)/P beta``. b is the median of the
    slopes between every pair of sizes, a the median of ``t - b S``; a negative a is clipped to 0.
    The fit is unusable when b is not positive or either term leaves its sanity range."""
    if world_size == 1:
        return LinkFit(LinkModel(0.0, 0.0, "single rank"), True)
    if len(sizes) != len(seconds) or len(set(sizes)) < 2 or any(not s for s in seconds):
        raise ValueError("fit_link needs timings for at least two distinct sizes")
    a, b = theil_sen(sizes, [statistics.median(s) for s in seconds])
    a = max(a, 0.0)
    steps = 2 * (world_size - 1)
    if not b > 0:
        return LinkFit(None, False, "the timings do not grow with the size")
    model = LinkModel(a / steps, b * world_size / steps, "probed")
    low, high = BANDWIDTH_RANGE_GBPS
    if not low <= model.bandwidth_gbps <= high:
        return LinkFit(model, False, f"bandwidth {model.bandwidth_gbps:.3g} Gbit/s is outside {low}..{high}")
    if not LATENCY_RANGE_S[0] <= model.alpha_s <= LATENCY_RANGE_S[1]:
        return LinkFit(model, False, f"latency {model.alpha_s * 1e6:.3g} us is outside "
                                     f"0..{LATENCY_RANGE_S[1] * 1e6:.0f} us")
    return LinkFit(model, True)


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the Theil-Sen line: the median of the slopes between every pair of points
    with distinct x, and the median of ``y - slope x``. Needs two distinct x."""
    points = sorted(zip(xs, ys))
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in combinations(points, 2) if x2 != x1]
    if not slopes:
        raise ValueError("a line needs points at two distinct x")
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in points), slope


def default_link(reason: str) -> LinkModel:
    return LinkModel.from_gbps(DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US, f"default: {reason}")


_LINK_CACHE: dict[tuple, LinkModel] = {}


def probe_link(collectives: Collectives, key: Hashable, sizes: Sequence[int] = DEFAULT_PROBE_SIZES,
               repeats: int = 5, *, device: str | torch.device = "cpu") -> LinkModel:
    """The link model of the ranks of ``collectives``: from the environment (``POSEIDON_BANDWIDTH_GBPS``,
    with ``POSEIDON_LATENCY_US``), else measured once per ``key`` (the ranks and backend) and device,
    and cached. Collective unless the environment sets the bandwidth."""
    bandwidth = from_env("BANDWIDTH_GBPS", float)
    latency = from_env("LATENCY_US", float)
    if bandwidth is not None:
        return LinkModel.from_gbps(bandwidth, latency or 0.0, "environment")
    device = torch.device(device)
    if (key, str(device)) not in _LINK_CACHE:
        _LINK_CACHE[key, str(device)] = _measure_link(collectives, sizes, repeats, device)
    model = _LINK_CACHE[key, str(device)]
    return model if latency is None else replace(model, alpha_s=latency * 1e-6, source="probed, latency from environment")


def _measure_link(collectives: Collectives, sizes: Sequence[int], repeats: int, device: torch.device) -> LinkModel:
    world_size = collectives.size
    if world_size == 1:
        return LinkModel(0.0, 0.0, "single rank")
    timings = [_all_reduce_seconds(size, repeats, device, collectives) for size in sizes]
    slowest = agree([t for per_size in timings for t in per_size], dist.ReduceOp.MAX, collectives, device)
    per_size = [slowest[i * repeats:(i + 1) * repeats] for i in range(len(sizes))]
    fit = fit_link(sizes, per_size, world_size)
    if fit.usable:
        return fit.model
    if collectives.rank == 0:
        warnings.warn(f"PoseidonDDP: the link probe gave an unusable fit ({fit.reason}); the cost model "
                      f"assumes {DEFAULT_BANDWIDTH_GBPS:g} Gbit/s and {DEFAULT_LATENCY_US:g} us instead. "
                      "Give the real figures with PoseidonDDP(link=LinkModel.from_gbps(...)) or "
                      "POSEIDON_BANDWIDTH_GBPS / POSEIDON_LATENCY_US.", stacklevel=3)
    return default_link(fit.reason)


def agree(values: list[float], op, collectives: Collectives | None, device: torch.device) -> list[float]:
    """``values`` reduced element-wise with ``op`` over the ranks, so every rank holds the same numbers
    (unchanged without ``collectives``)."""
    if collectives is None:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    collectives.all_reduce(tensor, op)
    return tensor.tolist()


def _all_reduce_seconds(nbytes: int, repeats: int, device: torch.device, collectives: Collectives) -> list[float]:
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    collectives.all_reduce(buffer)  # warm-up: connection setup, allocator
    return [timed(lambda: collectives.all_reduce(buffer), device) for _ in range(repeats)]


def timed(work: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


_GEMM_CACHE: dict[tuple, float] = {}


def probe_gemm_flops(device: str | torch.device = "cpu", collectives: Collectives | None = None,
                     key: Hashable = None) -> float:
    """Measured float32 matmul rate of ``device`` in FLOP/s (median over 256^3..512^3 products): the
    slowest rank's when ``collectives`` is given; cached per (device, ``key``)."""
    device = torch.device(device)
    if (str(device), key) not in _GEMM_CACHE:
        (_GEMM_CACHE[str(device), key],) = agree([_measure_gemm_flops(device)], dist.ReduceOp.MIN, collectives, device)
    return _GEMM_CACHE[str(device), key]


def _measure_gemm_flops(device: torch.device) -> float:
    """Operands filled without torch's random generator: wrapping a model must not change the user's
    random stream (dropout masks would differ from a torch DDP run with the same seed)."""
    rates = []
    for size in (256, 384, 512):
        a = torch.linspace(-1.0, 1.0, size * size, device=device).view(size, size)
        b = a.t().contiguous()
        a @ b  # warm-up
        rates += [2.0 * size**3 / timed(lambda: a @ b, device) for _ in range(3)]
    return statistics.median(rates)


_MEMORY_CACHE: dict[tuple, float] = {}
#: elements of each operand of the memory probe (fp32: 8 MiB, beyond a CPU's last-level cache per core)
_MEMORY_PROBE_ELEMENTS = 2 * 1024 * 1024


def probe_memory_bandwidth(device: str | torch.device = "cpu", collectives: Collectives | None = None,
                           key: Hashable = None) -> float:
    """Measured bytes per second of a streaming add (two operands read, one written) on ``device``: the
    slowest rank's when ``collectives`` is given; cached per (device, ``key``)."""
    device = torch.device(device)
    if (str(device), key) not in _MEMORY_CACHE:
        (_MEMORY_CACHE[str(device), key],) = agree([_measure_memory_bandwidth(device)], dist.ReduceOp.MIN,
                                                   collectives, device)
    return _MEMORY_CACHE[str(device), key]


def _measure_memory_bandwidth(device: torch.device) -> float:
    """Operands filled without torch's random generator (see :func:`_measure_gemm_flops`)."""
    a = torch.linspace(-1.0, 1.0, _MEMORY_PROBE_ELEMENTS, device=device)
    b, out = a.flip(0), torch.empty_like(a)
    torch.add(a, b, out=out)  # warm-up
    moved = 3 * a.numel() * a.element_size()
    return statistics.median(moved / timed(lambda: torch.add(a, b, out=out), device) for _ in range(7))
