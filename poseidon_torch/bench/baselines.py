"""What a user whose network is the bottleneck picks today, built from torch's own implementations, and one
host training alone: the baselines every mode of this project must beat on a slow link.

Modes (in both benchmarks):

- ``torch-ddp-powersgd``: torch DDP with torch's ``powerSGD_hook`` and a ``PowerSGDState``: rank
  ``--powersgd-rank`` (default 4), error feedback and warm start on, torch's other defaults
  (``min_compression_rate`` 2, seed 0); the first ``start_powerSGD_iter`` steps all-reduce plainly, torch's
  default (:data:`TORCH_POWERSGD_START`, 1000) unless ``--powersgd-start-iter`` (torch's minimum with error
  feedback is 2).
- ``torch-ddp-localsgd``: torch DDP with torch's ``post_localSGD_hook`` on a subgroup per host
  (``dist.new_subgroups``, as torch's docs build it: the ranks of one machine; the benchmarks run one rank
  per host, so after the warm-up no gradient crosses a link) and ``PostLocalSGDOptimizer`` over the task's
  optimizer with a ``PeriodicModelAverager`` (``--localsgd-period``, default 4). The warm-up, W steps of
  global gradient all-reduce (``start_localSGD_iter``, equal to the averager's ``warmup_steps`` as torch's
  docs require), is torch's default, the averager's (:data:`TORCH_LOCALSGD_WARMUP`, 0), unless
  ``--localsgd-warmup``. Step s (counted from 1) averages every host's parameters when s > W and
  (s - 1 - W) is a multiple of the period.
- ``one-host``: one host alone: rank 0 of a world of one, in host 0's place (its namespace, its CPU quota,
  one host's threads), on the shard it would read among ``--hosts`` hosts, at the same per-host batch; it
  has no peer, so it sends nothing.

Invariants: the hooks, the optimizer wrapper, the averager and the averaging function are torch's
(``torch.distributed.algorithms``); this module only builds them and answers when local SGD's ranks hold
the same parameters (:class:`LocalSGDConsensus`), which the time-to-accuracy benchmark needs to stop every
rank at a common step and to evaluate the model every host would hold.
"""
from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.distributed.optim import PostLocalSGDOptimizer

POWERSGD, LOCALSGD, ONE_HOST = "torch-ddp-powersgd", "torch-ddp-localsgd", "one-host"
BASELINE_MODES = (POWERSGD, LOCALSGD, ONE_HOST)
STREAMING_PREFIX = "poseidon-streaming"  #: PoseidonDDP's streamed periodic modes, whose fragments are set here
#: torch's defaults, read from its signatures so that a new torch's defaults are the ones used and stated
TORCH_POWERSGD_START = inspect.signature(PowerSGDState).parameters["start_powerSGD_iter"].default
TORCH_LOCALSGD_WARMUP = inspect.signature(PeriodicModelAverager).parameters["warmup_steps"].default
#: torch's PowerSGD with error feedback and warm start refuses an earlier start
POWERSGD_MIN_START = 2
#: the benchmarks run one rank per (emulated) host
RANKS_PER_HOST = 1
START_REASON = (" (torch's PowerSGD with error feedback and warm start cannot compress before DDP has rebuilt its "
                "buckets after the first step)")


@dataclass(frozen=True)
class Baselines:
    """The baselines' settings (the module docstring says what each one does)."""
    powersgd_rank: int = 4
    powersgd_start_iter: int = TORCH_POWERSGD_START
    localsgd_period: int = 4
    localsgd_warmup: int = TORCH_LOCALSGD_WARMUP
    #: PoseidonDDP's streaming modes (``poseidon-streaming*``, whose period is ``localsgd_period`` too): the
    #: fragments of the model, one synced every period / fragments steps (None: one per step of the period)
    streaming_fragments: int | None = None
    #: the streaming modes' ``delay``: the inner steps a fragment's sync stays in flight before it lands
    streaming_delay: int = 1

    def __post_init__(self) -> None:
        if self.streaming_fragments is not None and self.localsgd_period % self.streaming_fragments:
            raise ValueError(f"--streaming-fragments ({self.streaming_fragments}) must divide --localsgd-period "
                             f"({self.localsgd_period}): one fragment syncs every period / fragments steps")
        spacing = self.localsgd_period // self.fragments
        if not 1 <= self.streaming_delay <= spacing:
            raise ValueError(f"--streaming-delay ({self.streaming_delay}) must be between 1 and period / fragments "
                             f"({spacing}): a fragment's sync lands before the next one is sent")

    @property
    def fragments(self) -> int:
        """The streaming modes' fragments."""
        return self.streaming_fragments or self.localsgd_period

    def describe(self, modes: list[str]) -> dict:
        """What the results state about the baselines among ``modes`` (and the streaming modes' fragments)."""
        described = {}
        if POWERSGD in modes:
            described[POWERSGD] = {
                "hook": "torch powerSGD_hook", "matrix_approximation_rank": self.powersgd_rank,
                "start_powerSGD_iter": self.powersgd_start_iter,
                "start_is_torch_default": self.powersgd_start_iter == TORCH_POWERSGD_START,
                "use_error_feedback": True, "warm_start": True,
                "min_compression_rate": inspect.signature(PowerSGDState).parameters["min_compression_rate"].default}
        if LOCALSGD in modes:
            described[LOCALSGD] = {
                "hook": "torch post_localSGD_hook, a subgroup per host",
                "optimizer": "torch PostLocalSGDOptimizer + PeriodicModelAverager", "period": self.localsgd_period,
                "warmup_steps": self.localsgd_warmup,
                "warmup_is_torch_default": self.localsgd_warmup == TORCH_LOCALSGD_WARMUP}
        if ONE_HOST in modes:
            described[ONE_HOST] = {"ranks": 1, "data": "host 0's shard among the hosts", "communication": "none"}
        for mode in modes:
            if mode.startswith(STREAMING_PREFIX):
                described[mode] = {"sync_every": self.localsgd_period, "fragments": self.fragments,
                                   "delay": self.streaming_delay}
        return described

    def footnotes(self, modes: list[str]) -> list[str]:
        """One line per baseline among ``modes``, for under a table."""
        lines = []
        if POWERSGD in modes:
            default = " (torch's default)" if self.powersgd_start_iter == TORCH_POWERSGD_START else ""
            lines.append(f"{POWERSGD}: torch's powerSGD_hook, rank {self.powersgd_rank}, error feedback and warm "
                         f"start; plain all-reduce for the first {self.powersgd_start_iter} steps{default}")
        if LOCALSGD in modes:
            default = " (torch's default)" if self.localsgd_warmup == TORCH_LOCALSGD_WARMUP else ""
            lines.append(f"{LOCALSGD}: torch's post_localSGD_hook (a subgroup per host) + PostLocalSGDOptimizer, "
                         f"parameters averaged every {self.localsgd_period} steps after a warm-up of "
                         f"{self.localsgd_warmup} steps{default}")
        if ONE_HOST in modes:
            lines.append(f"{ONE_HOST}: host 0 alone on its shard, same per-host batch, no communication")
        return lines


def _int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an int no smaller than ``minimum`` (``why``: the reason, said when refused)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {value}")
        return value

    return parse


def add_baseline_arguments(parser: argparse.ArgumentParser, warm_ups: bool = True) -> None:
    """The baselines' options; ``warm_ups``: also when PowerSGD and local SGD start (the throughput
    benchmark sets those itself, so that its timed loop times each algorithm's own steps)."""
    defaults = Baselines()
    parser.add_argument("--powersgd-rank", type=_int_at_least(1), default=defaults.powersgd_rank,
                        help=f"{POWERSGD}: PowerSGD's matrix approximation rank")
    parser.add_argument("--localsgd-period", type=_int_at_least(1), default=defaults.localsgd_period,
                        help=f"{LOCALSGD}: average the parameters every this many steps (PoseidonDDP's periodic "
                             "modes: sync_every)")
    parser.add_argument("--streaming-fragments", type=_int_at_least(1), default=None,
                        help="poseidon-streaming modes: the model's fragments, one synced every period / fragments "
                             "steps (default: one per step of --localsgd-period)")
    parser.add_argument("--streaming-delay", type=_int_at_least(1), default=defaults.streaming_delay,
                        help="poseidon-streaming modes: the steps a fragment's sync stays in flight before it lands "
                             "(PoseidonDDP's delay; at most period / fragments)")
    if warm_ups:
        parser.add_argument("--powersgd-start-iter", type=_int_at_least(POWERSGD_MIN_START, START_REASON), default=defaults.powersgd_start_iter,
                            help=f"{POWERSGD}: plain all-reduce for this many steps first (torch's default: "
                                 f"{TORCH_POWERSGD_START})")
        parser.add_argument("--localsgd-warmup", type=_int_at_least(0), default=defaults.localsgd_warmup,
                            help=f"{LOCALSGD}: global gradient all-reduce for this many steps first (torch's "
                                 f"default: {TORCH_LOCALSGD_WARMUP})")


def baselines_from(args: argparse.Namespace) -> Baselines:
    """The settings parsed by :func:`add_baseline_arguments` (the warm-ups: torch's defaults if absent)."""
    defaults = Baselines()
    return Baselines(args.powersgd_rank, getattr(args, "powersgd_start_iter", defaults.powersgd_start_iter),
                     args.localsgd_period, getattr(args, "localsgd_warmup", defaults.localsgd_warmup),
                     args.streaming_fragments, args.streaming_delay)


def baseline_argv(baselines: Baselines) -> list[str]:
    """The worker options that hand ``baselines`` on."""
    return ["--powersgd-rank", str(baselines.powersgd_rank), "--powersgd-start-iter",
            str(baselines.powersgd_start_iter), "--localsgd-period", str(baselines.localsgd_period),
            "--localsgd-warmup", str(baselines.localsgd_warmup),
            *(["--streaming-fragments", str(baselines.streaming_fragments)] if baselines.streaming_fragments else []),
            "--streaming-delay", str(baselines.streaming_delay)]


def ranks_for(mode: str, hosts: int) -> int:
    """How many ranks ``mode`` runs on a cluster of ``hosts``."""
    return 1 if mode == ONE_HOST else hosts


def wrap(mode: str, module: nn.Module, baselines: Baselines) -> nn.Module:
    """``module`` in torch DDP with the comm hook of ``mode`` (PowerSGD or post-local SGD) registered."""
    model = nn.parallel.DistributedDataParallel(module)
    if mode == POWERSGD:
        state = PowerSGDState(process_group=None, matrix_approximation_rank=baselines.powersgd_rank,
                              start_powerSGD_iter=baselines.powersgd_start_iter, use_error_feedback=True,
                              warm_start=True)
        model.register_comm_hook(state, powerSGD_hook)
    elif mode == LOCALSGD:
        subgroup, _ = dist.new_subgroups(group_size=RANKS_PER_HOST)
        model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                   start_localSGD_iter=baselines.localsgd_warmup),
                                 post_localSGD_hook)
    else:
        raise ValueError(f"{mode} is not a torch DDP baseline")
    return model


def local_sgd_optimizer(model: nn.Module, cls: type, kwargs: dict, baselines: Baselines) -> PostLocalSGDOptimizer:
    """``cls(**kwargs)`` on the model's parameters, in torch's ``PostLocalSGDOptimizer`` with a periodic averager."""
    averager = PeriodicModelAverager(period=baselines.localsgd_period, warmup_steps=baselines.localsgd_warmup)
    return PostLocalSGDOptimizer(optim=cls(model.parameters(), **kwargs), averager=averager)


class LocalSGDConsensus:
    """When local SGD's ranks hold the same parameters, and the model they would all hold.

    After ``n`` steps (counted on every rank alike) the ranks agree if ``n <= W`` (every gradient was
    all-reduced), if step ``n`` averaged (``n > W`` and ``(n - 1 - W) % period == 0``), or if
    :meth:`average_in_place` ran after step ``n``. Every method that communicates is collective: every
    rank calls it after the same step.
    """

    def __init__(self, baselines: Baselines) -> None:
        self.warmup, self.period = baselines.localsgd_warmup, baselines.localsgd_period
        self._averaged_after: int | None = None

    def holds_after(self, steps_done: int) -> bool:
        return self._syncs(steps_done) or steps_done == self._averaged_after

    def next_meeting(self, steps_done: int) -> int:
        """The first step after ``steps_done`` that all-reduces (gradients or parameters): no rank can run
        past it before every rank reaches it, so every rank can still stop after it."""
        step = steps_done + 1
        while not self._syncs(step):
            step += 1
        return step

    def _syncs(self, step: int) -> bool:
        """Whether step ``step`` (from 1; 0: the start) leaves every rank with the same parameters."""
        return step <= self.warmup or (step - 1 - self.warmup) % self.period == 0

    def average_in_place(self, module: nn.Module, steps_done: int) -> None:
        """Average every rank's parameters into ``module`` (torch's ``average_parameters``) unless they
        agree already."""
        if not self.holds_after(steps_done):
            average_parameters(iter(module.parameters()), None)
            self._averaged_after = steps_done

    def averaged_copy(self, state: dict[str, torch.Tensor], module: nn.Module,
                      steps_done: int) -> dict[str, torch.Tensor]:
        """``state`` (a copy of ``module``'s state dict) with its parameters replaced by their average over the
        ranks, leaving ``module`` as it is, so evaluating does not change the training."""
        if not self.holds_after(steps_done):
            average_parameters(iter([state[name] for name, _ in module.named_parameters()]), None)
        return state
