"""``PoseidonDDP``: a drop-in for ``torch.nn.parallel.DistributedDataParallel`` on the Poseidon engine.

After ``torch.distributed.init_process_group``, wrap the model; the user's own loss, ``backward()`` and
optimizer stay as they are. When ``backward()`` returns, every trainable parameter's ``.grad`` holds the
average over all ranks (BSP). Invariants:
- construction checks that all ranks have the same parameters and options, then copies rank 0's
  parameters and buffers to every rank; with ``broadcast_buffers`` every synced forward in training mode
  does it again for buffers (BatchNorm statistics follow rank 0, as in DDP; under a barrier-free mode
  such as Pipe-SGD the other ranks get rank 0's buffers of the synced forward before);
- the engine (``engine.py``) starts at the first grad-enabled forward (or when something asks for it:
  ``engine``, ``plan``, ``bucket_names``, ``consistency_state_dict()``, ``join()``) with its consistency
  mode resolved then, once (``modes.resolve``): from ``delay`` and the ``ServerOptimizer`` built on the
  wrapper before that; nothing changes the mode afterwards;
- no forward issues a collective that torch DDP would not: a forward under ``no_grad``, inside
  ``no_sync`` or in eval mode issues none, so rank 0 alone may compute an accuracy;
- ``state_dict()`` / ``load_state_dict()`` carry the ``module.`` prefix exactly as DDP's do;
- ``copy.deepcopy`` and pickling give an unbound copy: its engine starts (collectively) at its first
  synced forward, and a no_grad forward of the copy needs no process group at all;
- wrapping a module that another, unclosed PoseidonDDP still wraps closes the old one (with a warning):
  only one engine ever hooks a module's parameters.
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from .barrier import SyncError
from .bucket import find_layers
from .compat import DDPArguments
from .compiled import DDP_SPLIT_BYTES, SplitAt, splitting_compiled_graphs
from .coordinator import Plan, checked_overrides, recorded_paths
from .core import native_status
from .engine import Engine
from .env import option
from .fc import fc_eligible, fc_spec
from .link import LinkModel, default_link, probe_gemm_flops, probe_link, probe_memory_bandwidth
from .modes import PeriodicOptions, ServerRequest, check_periodic, check_request, delay_option, periodic_option, \
    resolve, sync_nice
from .paths import compression_option
from .paths import names as path_names
from .paths.ps import DEFAULT_CHUNK_BYTES
from .pools import Groups, started_at_lower_priority
from .replicas import BroadcastInFlight, broadcast_from, check_same_model
from .stats import CommStats
from .trace import Recorder, TraceConfig

DEFAULT_FUSION_BYTES = 4 * 1024 * 1024
DEFAULT_NUM_CHANNELS = 2
ENGINES = ("native", "python")
_announced = False

#: module -> the PoseidonDDP that wraps it now (weak on both sides)
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class _OpenEngine:
    """A started wrapper's engine (None until it binds) and what closing it needs, apart from the
    wrapper: a wrapper freed without ``close()`` leaves its engine running (its hooks and threads hold
    it), so the engine is closed from here at exit instead. Invariant: every instance not closed yet is
    in ``_OPEN``, in the order the wrappers started."""

    def __init__(self, wrapper: PoseidonDDP, recorder: Recorder) -> None:
        self.wrapper = weakref.ref(wrapper)
        self.engine: Engine | None = None
        self.recorder = recorder
        self.buffers_in_flight: BroadcastInFlight | None = None  #: a barrier-free mode's, see _pipeline_buffers
        _OPEN[self] = None

    def close(self) -> None:
        """Drain the engine, stop its threads, remove its hooks and finish the trace (once)."""
        if self not in _OPEN:
            return
        del _OPEN[self]
        if self.engine is not None:
            self._end_buffers_in_flight()
            self.engine.close()
        self.recorder.finish()
        self.recorder.flush()

    def _end_buffers_in_flight(self) -> None:
        """Wait for the broadcast of rank 0's buffers the last synced forward started (nothing lands).
        Left to gloo's threads, it could end during the interpreter's teardown, and a tensor freed there
        then aborts the process ("terminate called without an active exception"). A failed engine does
        not wait (its peers may be gone)."""
        in_flight, self.buffers_in_flight = self.buffers_in_flight, None
        if in_flight is not None and self.engine.failure is None:
            with contextlib.suppress(SyncError):
                self.engine.wait_for_peers("the broadcast of rank 0's buffers", in_flight.wait)


#: the open engines, oldest first: a dict, since closing is collective and every rank must close them in the
#: same order (the order the ranks wrapped their modules in; a set's order differs between processes)
_OPEN: dict[_OpenEngine, None] = {}


@atexit.register
def _close_all() -> None:
    """Close every engine still open, its wrapper alive or freed unclosed, while the interpreter is
    whole: collectives still in flight at its teardown abort the process."""
    for opened in list(_OPEN):
        wrapper = opened.wrapper()
        if wrapper is not None:
            wrapper.close()  # it then runs its module locally, as after any close()
        else:
            opened.close()


@dataclass(frozen=True)
class Options:
    """PoseidonDDP's options, resolved once (code, then environment, then default); all ranks must agree."""

    chunk_bytes: int
    fusion_bytes: int
    num_channels: int
    timeout: float
    broadcast_buffers: bool
    init_sync: bool
    hybrid: bool
    overrides: tuple[tuple[str, str], ...]
    link: LinkModel | None
    trace: TraceConfig | None
    engine: str
    delay: int = 0
    #: the lossy paths ``compression=`` names, each with its settings: ((path name, ((setting, value), ...)), ...)
    compression: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    periodic: PeriodicOptions | None = None  #: sync_every and outer, checked (None: every step syncs)

    def __post_init__(self) -> None:
        self._check_types()
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.num_channels < 1 or self.timeout <= 0 or self.chunk_bytes <= 0 or self.fusion_bytes < 0:
            raise ValueError(f"invalid options: num_channels={self.num_channels}, timeout={self.timeout}, "
                             f"chunk_bytes={self.chunk_bytes}, fusion_bytes={self.fusion_bytes}")
        if self.overrides and not self.hybrid:
            raise ValueError("per-layer paths (overrides= or plan=) need hybrid=True")
        if self.compression and not self.hybrid:
            raise ValueError("compression= chooses paths per layer, which needs hybrid=True (hybrid=False sends every "
                             "layer through the PS path, exactly)")
        check_periodic(self.periodic, dict(self.overrides))

    @property
    def compression_settings(self) -> dict[str, dict[str, Any]]:
        """Per lossy path's name, its settings (what the engine's paths are built with)."""
        return {path: dict(settings) for path, settings in self.compression}

    @property
    def factor_paths(self) -> bool:
        """Whether FC layers may sync gradients from their factors: ``hybrid``, unless no gradient is synced."""
        return self.hybrid and self.periodic is None

    def _check_types(self) -> None:
        """Every rank checks its own options before any collective, so a bad value fails everywhere
        at once instead of on one rank while the others wait."""
        def expect(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise TypeError(f"PoseidonDDP option {name} must be {what}, got {getattr(self, name)!r}")

        for name in ("chunk_bytes", "fusion_bytes", "num_channels"):
            value = getattr(self, name)
            expect(name, isinstance(value, int) and not isinstance(value, bool), "an int")
        expect("timeout", isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool)
               and math.isfinite(self.timeout), "a finite number of seconds or a datetime.timedelta")
        for name in ("broadcast_buffers", "init_sync", "hybrid"):
            expect(name, isinstance(getattr(self, name), bool), "True or False")
        expect("link", self.link is None or isinstance(self.link, LinkModel), "a LinkModel or None")
        expect("engine", isinstance(self.engine, str), "a string")
        delay_option(self.delay)


class PoseidonDDP(nn.Module, Joinable):
    """Wrap ``module`` for data-parallel training with wait-free backprop, a sharded PS and SFB.

    Args:
        module: the model, already on its device (CPU, or one CUDA device per process).
        device_ids ... forward_sync_buffers: torch DDP's arguments, in DDP's order, so that code and
            frameworks that construct DDP can construct this instead (see ``compat.py`` for what each
            means here): ``bucket_cap_mb`` is the fusion cap, ``broadcast_buffers`` /
            ``forward_sync_buffers`` keep buffers on rank 0's values, ``init_sync=False`` skips the
            broadcast of rank 0's state, ``device_ids`` / ``output_device`` must name the module's device.
        chunk_bytes: size of the pieces the gradient space is cut into for the KV-store shards
            (default 2 MiB, or ``POSEIDON_CHUNK_BYTES``).
        fusion_bytes: what a bucket may hold besides its largest layer (default 4 MiB, or
            ``POSEIDON_FUSION_BYTES``); 0 keeps every layer a bucket of its own. Within it, buckets are
            learned from the first backward. Given, it is also where ``torch.compile`` cuts the graph
            (else at torch DDP's 25 MiB).
        num_channels: sync threads, each with its own process groups (default 2, or
            ``POSEIDON_NUM_CHANNELS``).
        timeout: how long any wait may take before the step fails (dead or stuck peer): seconds, or a
            ``datetime.timedelta`` as ``init_process_group`` takes it.
        hybrid: let the coordinator send fully connected layers through SFB where that is cheaper and
            exact; False sends every layer through the PS path.
        overrides: force a path per layer, e.g. ``{"classifier.0": "SFB", "fc2": "PS"}`` (SFB only
            where it is exact).
        plan: a recorded plan given back, so that the paths do not depend on this run's timing probe:
            ``model.plan`` of an earlier run, its ``layer_paths()``, or the file its ``save(path)``
            wrote. It must give a path for every layer that could take SFB, and forces each one as
            ``overrides`` would (a layer it puts on SFB where SFB would not be exact falls back to PS
            with a warning, on every rank alike). Not together with ``overrides``.
        link: the network's alpha-beta model for the cost model (default: probed at start-up, or
            ``POSEIDON_BANDWIDTH_GBPS`` / ``POSEIDON_LATENCY_US``).
        trace_dir, trace_skip, trace_iters: switch the tracer on (see ``poseidon_torch.trace``).
        engine: ``"native"`` (default, or ``POSEIDON_ENGINE``): the C++ core for CPU tensors where it
            is built, else the Python one; ``"python"``: the Python reference core.
        delay: Pipe-SGD's k (default 0: BSP). With k >= 1 a synced ``backward()`` returns without
            waiting for its sync, which runs on during the next steps; ``.grad`` then holds the average
            over the ranks of the gradients of k steps earlier (None for the first k steps: torch's
            optimizers skip those). See ``modes/pipe_sgd.py`` and docs/pipe-sgd.md. With ``sync_every=H``
            (0 <= k <= H): each periodic sync stays in flight for k inner steps, which compute meanwhile, and
            lands after the k-th of them, those steps kept on top of what lands (docs/periodic.md).
        compression: lossy paths the coordinator may choose per layer, where its cost model predicts them
            faster than the exact ones (default None: never; docs/compression.md): ``"powersgd"`` (rank-r
            PowerSGD with error feedback and warm start), ``"bf16"`` or ``"fp16"`` (reduced precision with
            error feedback), ``"int8"`` (8 bits with a scale per block, error feedback), a list of them, or a dict of each with its settings, e.g.
            ``{"powersgd": {"rank": 8, "start_iter": 100}}``. They change the arithmetic: the averages are
            approximations whose errors are fed back into later steps. With ``sync_every`` and ``outer``
            one path, which every outer sync takes for DiLoCo's pseudo-gradients (docs/periodic.md).
        sync_every: periodic averaging (default None: every synced backward averages the gradients). With
            H >= 1 every backward is local and the user's optimizer steps each rank on its own gradients;
            right after every H-th ``step()`` of it the ranks sync: local SGD, or DiLoCo with ``outer``.
            See ``modes/periodic.py`` and docs/periodic.md.
        outer: with ``sync_every``, DiLoCo's outer optimizer: a class and its arguments, e.g.
            ``poseidon_torch.DILOCO_OUTER`` (Nesterov SGD, lr 0.7, momentum 0.9), or a
            ``functools.partial`` of a class; it steps the round's start parameters with the averaged
            pseudo-gradient (start minus end). None (default): local SGD, the parameters averaged.
        fragments: with ``sync_every=H``, F (dividing H, default 1): the buckets are cut into F fragments
            of about equal bytes, synced in turn every H / F steps, so each is synced every H steps and the
            link carries 1/F of the model at a time (Streaming DiLoCo); ``delay`` is then at most H / F.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0, broadcast_buffers: bool | None = None,
                 init_sync: bool = True, process_group: Any = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Sequence[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, chunk_bytes: int | None = None,
                 fusion_bytes: int | None = None, num_channels: int | None = None,
                 timeout: float | timedelta = 300.0, hybrid: bool = True, overrides: dict[str, str] | None = None,
                 plan: Plan | Mapping[str, str] | str | os.PathLike | None = None, link: LinkModel | None = None,
                 trace_dir: str | None = None, trace_skip: int | None = None, trace_iters: int | None = None,
                 engine: str | None = None, delay: int = 0,
                 compression: str | Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
                 sync_every: int | None = None, outer: Any = None, fragments: int = 1) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError(_NO_PROCESS_GROUP)
        self.module = module
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"PoseidonDDP option overrides must be a dict {{layer: path}} (paths: {path_names()}), "
                            f"got {overrides!r}")
        if plan is not None:
            if overrides:
                raise ValueError("pass either plan= (a recorded plan: every layer's path) or overrides= (the paths of "
                                 "some layers), not both")
            overrides = recorded_paths(plan, module)
        self._ddp_arguments = ddp = DDPArguments(
            device_ids, output_device, dim, broadcast_buffers, init_sync, process_group, bucket_cap_mb,
            find_unused_parameters, check_reduction, gradient_as_bucket_view, static_graph,
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh,
            skip_all_reduce_unused_params, bucket_cap_mb_list, batched_grad_copy, forward_sync_buffers)
        if fusion_bytes is not None and ddp.fusion_bytes is not None:
            raise ValueError("pass either fusion_bytes or bucket_cap_mb (torch DDP's name for it), not both")
        fusion_bytes = fusion_bytes if ddp.fusion_bytes is None else ddp.fusion_bytes
        lossy = compression_option(compression)
        periodic = periodic_option(sync_every, outer, ddp.buffers_follow_rank0, module.parameters(), delay, fragments,
                                   lossy)
        self.options = Options(
            chunk_bytes=option(chunk_bytes, "CHUNK_BYTES", int, DEFAULT_CHUNK_BYTES),
            fusion_bytes=option(fusion_bytes, "FUSION_BYTES", int, DEFAULT_FUSION_BYTES),
            num_channels=option(num_channels, "NUM_CHANNELS", int, DEFAULT_NUM_CHANNELS),
            timeout=timeout.total_seconds() if isinstance(timeout, timedelta) else timeout,
            broadcast_buffers=ddp.buffers_follow_rank0, init_sync=init_sync, hybrid=hybrid,
            overrides=tuple(sorted((overrides or {}).items())), link=link,
            trace=TraceConfig.resolve(trace_dir, trace_skip, trace_iters),
            engine=option(engine, "ENGINE", str, "native"), delay=delay,
            compression=tuple((path, tuple(sorted(settings.items()))) for path, settings in lossy.items()),
            periodic=periodic)
        self._group = ddp.group or dist.group.WORLD
        self._group_ranks = dist.get_process_group_ranks(self._group)
        if dist.get_rank() not in self._group_ranks:
            raise ValueError(f"rank {dist.get_rank()} is not a member of process_group (ranks {self._group_ranks})")
        self._backend = dist.get_backend(self._group)
        self._require_sync = True
        self._split = SplitAt(option(fusion_bytes, "FUSION_BYTES", int, DDP_SPLIT_BYTES))
        self._engine: Engine | None = None
        self._open: _OpenEngine | None = None  #: started (None: unbound copy, or closed); closed at exit
        self._request: ServerRequest | None = None  #: what a ServerOptimizer asks of the mode
        #: the parameters the engine syncs (``id``): every trainable one when the wrapper started
        self.synced_parameters: set[int] = set()
        self._closed = False
        ddp.note_unneeded(self._group_ranks.index(dist.get_rank()))
        self._start()

    # ---- the engine's lifetime -------------------------------------------------------------------

    def _start(self) -> None:
        """Groups, checks, rank 0's state, the cost model's inputs: collective over the group's members.
        The engine itself starts later (:meth:`_bind`), with the mode resolved then."""
        _check_materialised(self.module)
        _check_dense_gradients(self.module, self.options.periodic is not None)
        self._take_over_module()
        if self._group is None:
            self._group = _group_over(self._group_ranks)
        options = self.options
        self.rank, self.world_size = dist.get_rank(self._group), dist.get_world_size(self._group)
        self._groups = started_at_lower_priority(sync_nice(options.delay), lambda: Groups.create(
            self._group, self._backend, options.num_channels, timedelta(seconds=options.timeout)))
        check_same_model(self.module, options, self._groups.control)
        device = _single_device(self.module)
        self._ddp_arguments.check_device(device)
        self._staged = device.type == "cuda" and self._backend == "gloo"
        if options.init_sync:
            broadcast_from(list(self.module.parameters()) + list(self.module.buffers()), self._groups.data,
                           self._staged, 0)
        self._has_buffers = any(True for _ in self.module.buffers())
        self.recorder = Recorder(options.trace, self.rank, self.world_size, self._groups.control.all_gather_objects)
        self._link, self._gemm, self._memory = self._cost_inputs(device)
        self._native = options.engine == "native" and device.type == "cpu" and not native_status()
        layers = find_layers(self.module)
        self.synced_parameters = {id(p) for layer in layers for _, p in layer.params}
        self._overrides = checked_overrides(dict(options.overrides), [layer.name for layer in layers],
                                            [layer.name for layer in fc_eligible(layers, self.module)], self.world_size)
        self._open = _OpenEngine(self, self.recorder)
        self._announce(device)
        _WRAPPED[self.module] = weakref.ref(self)

    def _bind(self) -> Engine:
        """Start the engine, its mode resolved now, once (the first grad-enabled forward, or anything that
        needs the engine first): local, no collective but the mode's own."""
        options = self.options
        self._engine = Engine(self.module, groups=self._groups, chunk_bytes=options.chunk_bytes,
                              fusion_bytes=options.fusion_bytes, timeout=options.timeout, staged=self._staged,
                              recorder=self.recorder, hybrid=options.factor_paths, link=self._link,
                              gemm_flops=self._gemm, overrides=self._overrides, native=self._native,
                              mode=resolve(options.delay, self._request, options.periodic),
                              memory_bps=self._memory, compression=options.compression_settings)
        self._open.engine = self._engine
        return self._engine

    def _started_engine(self, what: str) -> Engine:
        """The engine, started now if need be (``what`` needs it)."""
        if self._open is None:
            raise RuntimeError(f"{what} needs a started PoseidonDDP (not closed, not an unbound copy)")
        return self._engine or self._bind()

    def _collective_engine(self, what: str) -> Engine:
        """The started engine for a collective call (``what``): a pass whose backward raised here is still
        open, and the other ranks' backwards wait in it; it is finished first (keeping nothing, as the next
        forward would finish it), so their collectives and this call's meet."""
        engine = self._started_engine(what)
        if engine.backward_raised():
            engine.finish_aborted_pass()
        return engine

    def _announce(self, device: torch.device) -> None:
        """Say once per process, on rank 0, which core runs the hot path."""
        global _announced
        if _announced or self.rank != 0:
            return
        _announced = True
        kind = "native" if self._native else "python"
        why = ""
        if kind == "python" and self.options.engine == "native":
            why = f" ({native_status() or f'the native core runs CPU tensors only, these are on {device}'})"
        print(f"poseidon-torch: {kind} core{why}", file=sys.stderr, flush=True)

    def _take_over_module(self) -> None:
        previous = _WRAPPED.get(self.module)
        previous = previous() if previous is not None else None
        if previous is not None and previous is not self and previous._open is not None:
            warnings.warn("PoseidonDDP: this module is already wrapped by a PoseidonDDP that was not closed; "
                          "closing that one (call close() on a wrapper you replace)", stacklevel=3)
            previous.close()

    def _cost_inputs(self, device: torch.device) -> tuple[LinkModel, float | None, float | None]:
        """The link, GEMM rate and memory bandwidth for the cost model: the link and GEMM rate probed
        (collectively) only when some layer could take the SFB path or ``compression=`` names a path (the
        GEMM rate is None otherwise), the memory bandwidth only in the latter case; otherwise the buckets'
        own first sync jobs are the measurement."""
        options = self.options
        fc = options.factor_paths and any(fc_spec(m) for m in self.module.modules())
        if self.world_size == 1 or not (fc or options.compression):
            return options.link or default_link("not probed: no layer can take SFB"), None, None
        wire = "cpu" if self._staged else device
        key = (tuple(self._group_ranks), self._backend)
        link = options.link or probe_link(self._groups.data, key, device=wire)
        memory = probe_memory_bandwidth(wire, self._groups.data, key) if options.compression else None
        return link, probe_gemm_flops(device, self._groups.data, key), memory

    def close(self) -> None:
        """Drain the last step's sync, stop the sync threads, remove every hook, release the process
        groups and finish writing a trace. Done at exit for a wrapper not closed, alive or freed (its
        engine runs on until then, holding its threads and groups): call it when training ends.
        The wrapper then runs the module locally, as a plain module, and never starts another engine."""
        self._closed = True
        opened, self._open, self._engine = self._open, None, None
        if opened is None:
            return
        opened.close()
        self._groups = None  # the private backends close when the last reference goes
        if _WRAPPED.get(self.module) is not None and _WRAPPED[self.module]() is self:
            del _WRAPPED[self.module]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_engine", "_open", "_groups", "recorder", "_link", "_gemm", "_memory", "_native", "_overrides"):
            state.pop(name, None)
        state["_group"] = None  # a copy makes its own group over the same ranks when it starts
        state["_request"] = None  # and has no ServerOptimizer
        state["synced_parameters"] = set()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._engine = self._open = None  # started by the first synced forward of the copy

    # ---- training ----------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """Per bucket: type, shape, K, path, predicted bytes and time of each path (``print`` it)."""
        engine = self.engine
        return engine.coordinator.plan(engine.buckets) if engine is not None else None

    @property
    def engine(self) -> Engine | None:
        """The wait-free backprop engine (buckets, paths, coordinator, mode), started now if need be; None
        while unbound or once closed."""
        return self._engine or (self._bind() if self._open is not None else None)

    @property
    def comm_stats(self) -> CommStats:
        return self._engine.stats if self._engine is not None else CommStats()

    @property
    def bucket_names(self) -> list[str]:
        """The buckets in sync order: learned from the first backward."""
        engine = self.engine
        return [b.name for b in engine.buckets] if engine is not None else []

    @torch.compiler.disable(recursive=False)  # only the module underneath compiles, see compiled.py
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        step = self._enter_forward()
        if step is None:
            return self.module(*args, **kwargs)
        try:
            output = self.module(*args, **kwargs)
        finally:
            self._end_module(step)
        return self._leave_forward(step, output)

    @torch.compiler.disable
    def _enter_forward(self) -> _Forward | None:
        """The engine's side of a forward before the module runs (None: run the module locally)."""
        self._refuse_outer_ddp()
        synced = torch.is_grad_enabled() and self._require_sync
        if synced and self._open is None and not self._closed:
            self._start()  # an unbound copy (deepcopy, unpickled) that is trained
        if torch.is_grad_enabled() and self._engine is None and self._open is not None:
            self._bind()
        engine = self._engine
        if engine is None:
            return None
        synced = synced and engine.mode.syncs_gradients  # a periodic mode's backwards are local
        step = _Forward(engine, synced, time.monotonic_ns(), splitting_compiled_graphs(self._split))
        engine.begin_forward(synced)
        try:
            self._forward_collectives(synced)
        except BaseException:
            engine.end_forward()
            raise
        step.split.__enter__()
        return step

    def _refuse_outer_ddp(self) -> None:
        """torch DDP around this wrapper (frameworks that wrap whatever model they are given do it:
        accelerate's ``prepare``) would sync every gradient a second time: refused at its first forward."""
        outer = DistributedDataParallel._active_ddp_module
        if isinstance(outer, DistributedDataParallel) and self in (outer.module, getattr(outer.module, "_orig_mod", None)):
            raise RuntimeError(
                "PoseidonDDP is wrapped in torch's DistributedDataParallel (accelerate's Accelerator.prepare() does this "
                "to any model it is given), so every gradient would be synced twice: give the framework the plain model "
                "and let it build PoseidonDDP (poseidon_torch.integrations.accelerate.PoseidonAccelerator for accelerate, "
                "PoseidonStrategy for Lightning, PoseidonTrainer for the Hugging Face Trainer)")

    @torch.compiler.disable
    def _end_module(self, step: _Forward) -> None:
        step.split.__exit__(None, None, None)
        step.engine.end_forward()

    @torch.compiler.disable
    def _leave_forward(self, step: _Forward, output: Any) -> Any:
        engine = step.engine
        engine.after_forward(output, step.synced)
        if step.synced:
            engine.arm(output)
        if self.recorder.active:
            self.recorder.add("forward", "forward", "compute", step.start_ns, time.monotonic_ns())
        return output

    def _forward_collectives(self, synced: bool) -> None:
        """What torch DDP issues in forward: with join() the not-joined notice and this iteration's
        sync decision, then rank 0's buffers (synced forwards in training mode only). Under a
        barrier-free policy (Pipe-SGD) the buffers are pipelined too: rank 0's are sent as this forward
        starts and land as the next synced training forward starts (before it: autograd saved them in
        this one), so no rank waits for the others here."""
        code = _SYNC * synced + _BUFFERS * (synced and self._syncs_buffers())
        if not (self._join_config.enable or code & _BUFFERS):
            return
        if code & _BUFFERS and self._engine.mode.barrier_free:  # join() is refused with these
            self._pipeline_buffers()
            return
        with self.recorder.waiting("forward collectives"):
            if self._join_config.enable:
                Join.notify_join_context(self)
                flag = torch.tensor([code])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            if code & _BUFFERS:
                self._sync_buffers(joined=False)

    def _pipeline_buffers(self) -> None:
        """Send rank 0's buffers as they are now; write those sent by the last synced training forward
        into the module's buffers as they are now (unless one changed shape or dtype since: then this
        rank keeps its own for one more step)."""
        opened = self._open
        landing, opened.buffers_in_flight = (opened.buffers_in_flight,
                                             BroadcastInFlight(self.module.buffers(), self._groups.data, self._staged, 0))
        if landing is not None:
            with self.recorder.waiting("forward collectives"):
                self._engine.wait_for_peers("the broadcast of rank 0's buffers",
                                            partial(landing.land, self.module.buffers()))

    def _syncs_buffers(self) -> bool:
        lockstep = self._engine is None or self._engine.mode.lockstep  # SSP: ranks on their own clocks
        return (self.options.broadcast_buffers and self.module.training and self.world_size > 1 and self._has_buffers
                and lockstep)

    def _sync_buffers(self, joined: bool) -> None:
        """Broadcast the buffers from rank 0, or with join() from the highest rank still training."""
        source = 0
        if self._join_config.enable:
            candidate = torch.tensor([-1 if joined else self.rank])
            dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self._group)
            source = int(candidate)
        broadcast_from(list(self.module.buffers()), self._groups.data, self._staged, source)

    def attach_server(self, request: ServerRequest, described: dict[str, object]) -> None:
        """Parameter-server mode, asked by a :class:`~poseidon_torch.ServerOptimizer` (collective): its
        ``request`` (``described``: what every rank must agree on) becomes the mode when the engine
        starts, so the optimizer must be built before the engine starts."""
        if self._open is None:
            raise RuntimeError("ServerOptimizer needs a started PoseidonDDP (not closed, not an unbound copy)")
        if self._join_config.enable:
            raise RuntimeError("ServerOptimizer cannot be used inside join() (uneven inputs) yet")
        if self._request is not None:
            raise RuntimeError("this PoseidonDDP already has a ServerOptimizer")
        if self._engine is not None:
            raise RuntimeError("build the ServerOptimizer before the model's first forward (and before anything that "
                               "starts its engine: .engine, .plan, .bucket_names, consistency_state_dict()): the "
                               "consistency mode is chosen once, when the engine starts, and this one has started")
        everyone = self._groups.control.all_gather_objects(described)
        for rank, other in enumerate(everyone):
            differing = "; ".join(f"{key}: {value!r} vs {other[key]!r}" for key, value in everyone[0].items()
                                  if other[key] != value)
            if differing:
                raise ValueError(f"ServerOptimizer differs between rank 0 and rank {rank}: {differing}")
        check_request(self.options.delay, self.options.periodic, dict(self.options.overrides),
                      {p.device.type for p in self.module.parameters()}, request, self.options.compression_settings)
        self._request = request

    def synchronize(self) -> None:
        """In parameter-server mode: wait until every parameter holds the value of the last step (the
        forward and ``ServerOptimizer.step()`` do it already; the parameters' ``state_dict`` too). Local:
        one rank may call it alone, and training goes on as it would have without the call."""
        if self._engine is not None:
            self._engine.flush()

    def end_round(self) -> None:
        """With ``sync_every`` (collective: call it on every rank after the same step): end the round now,
        so every rank holds the same parameters, e.g. before the final evaluation or save: the sync in
        flight lands and every fragment syncs at once (local SGD: the average; DiLoCo: the outer step of
        the partial round); the step count and the schedule go on from there. Other modes: as
        :meth:`synchronize`."""
        if self._engine is not None:
            self._engine.mode.end_round(self._engine)

    def consistency_state_dict(self) -> dict:
        """What a checkpoint must carry besides the model and the optimizer to resume the same
        trajectory: with ``delay=k``, the averaged gradients still in flight; with ``sync_every``, the steps
        taken and DiLoCo's outer optimizer state and round start; with a lossy path (``compression=``), its
        error-feedback residuals (and PowerSGD's warm-start Q) under ``"paths"`` and the coordinator's passes
        and lossy layers under ``"coordinator"``. The residuals differ between ranks, so ``"paths"`` holds
        every rank's (``{"world_size": P, "ranks": [rank 0's, ...]}``): the copy one rank saves resumes every
        rank. Collective (call it on every rank, as ``ZeroRedundancyOptimizer.consolidate_state_dict``): it
        waits for the last sync, and training goes on, bit for bit, as it would have without the call."""
        engine = self._collective_engine("consistency_state_dict()")
        engine.flush()
        names = {id(p): name for name, p in self.module.named_parameters()}
        state = engine.mode.state_dict(names)
        mine = {name: _on_cpu(kept) for name, path in engine.paths.items() if (kept := path.state_dict())}
        everyone = self._groups.control.all_gather_objects(mine)
        paths = {"world_size": self.world_size, "ranks": everyone} if any(everyone) else None
        plan = engine.coordinator.state_dict()
        return {**state, **({"paths": paths} if paths else {}), **({"coordinator": plan} if plan else {})}

    def load_consistency_state_dict(self, state: dict) -> None:
        """Restore what :meth:`consistency_state_dict` saved (before the first step of the resumed run)."""
        engine = self._collective_engine("load_consistency_state_dict()")
        engine.settle()
        mine = self._own_paths_state(state.get("paths"))
        for name in mine:
            if name not in engine.paths:
                raise ValueError(f"the consistency state has a state for path {name!r}, which is not registered")
            if name not in engine.coordinator.lossy and name not in self._overrides.values():
                raise ValueError(f"the consistency state holds path {name!r}'s residuals, and this PoseidonDDP neither "
                                 f"names it in compression= nor forces it: resume with compression= as when saved, or "
                                 f"drop its error feedback knowingly by deleting the state's 'paths' and 'coordinator'")
        if "coordinator" in state:
            engine.coordinator.checked_state(state["coordinator"])
        own = {name: engine.paths[name].state_dict() for name in mine}  # put back if a later part is refused
        try:
            for name, kept in mine.items():
                engine.paths[name].load_state_dict(kept)
            engine.mode.load_state_dict(state, dict(self.module.named_parameters()))
        except Exception:
            for name, kept in own.items():
                engine.paths[name].load_state_dict(kept)
            raise
        if "coordinator" in state:
            engine.coordinator.load_state_dict(state["coordinator"])

    def _own_paths_state(self, saved: object) -> dict:
        """This rank's entry of a saved ``"paths"`` state (checked: saved by as many ranks as this run has)."""
        if saved is None:
            return {}
        if not isinstance(saved, Mapping) or set(saved) != {"world_size", "ranks"} or \
                not isinstance(saved["ranks"], list) or len(saved["ranks"]) != saved["world_size"]:
            raise ValueError(f"the consistency state's 'paths' must be {{'world_size': P, 'ranks': [P states]}}, got "
                             f"{saved!r:.80}")
        if saved["world_size"] != self.world_size:
            raise ValueError(f"the consistency state's residuals were saved by {saved['world_size']} ranks and this run "
                             f"has {self.world_size}: each rank's residual is its own, so they cannot be split again; "
                             "resume with as many ranks, or drop them knowingly by deleting the state's 'paths'")
        return saved["ranks"][self._groups.control.rank]

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False while gradients accumulate locally (what ``no_sync()`` sets)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally in this context; the next synced backward syncs them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ---- uneven inputs ---------------------------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs, as torch DDP's ``join()``: ranks that ran out of data take part in
        the others' syncs with zero gradients (averages divide by the initial world size); at the end
        every rank takes the model of the last rank to finish."""
        if not divide_by_initial_world_size:
            raise ValueError("PoseidonDDP.join supports divide_by_initial_world_size=True only")
        if self._open is None and not self._closed:
            self._start()  # an unbound copy: started (collectively) for its mode
        if self._open is not None:
            self._started_engine("join()").mode.refuse_join()
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu") if self._backend == "gloo" else _single_device(self.module)

    @property
    def join_process_group(self) -> Any:
        return self._group


_SYNC, _BUFFERS = 1, 2


@dataclass
class _Forward:
    """One forward of the wrapper, between its engine-side halves."""

    engine: Engine
    synced: bool
    start_ns: int
    split: contextlib.AbstractContextManager


class _JoinHook(JoinHook):
    """A joined rank shadows the collectives of the others' iterations."""

    def __init__(self, ddp: PoseidonDDP) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        flag = torch.tensor([0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ddp._group)
        code = int(flag)
        if code & _BUFFERS:
            ddp._sync_buffers(joined=True)
        if code & _SYNC:
            ddp._started_engine("join()").shadow_pass()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        candidate = torch.tensor([ddp.rank if is_last_joiner else -1])
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp._group)
        state = list(ddp.module.parameters()) + list(ddp.module.buffers())
        broadcast_from(state, ddp._groups.data, ddp._staged, int(candidate))


_NO_PROCESS_GROUP = (
    "PoseidonDDP needs a process group: launch the script with torchrun (e.g. `torchrun --nproc_per_node 2 "
    "train.py`) and call torch.distributed.init_process_group() before wrapping the model")


def _check_materialised(module: nn.Module) -> None:
    """Refuse, before any collective, a module whose tensors hold no values yet (meta device, lazy)."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if nn.parameter.is_lazy(tensor):
                raise ValueError(
                    f"PoseidonDDP: {kind} {name!r} is uninitialised (a lazy module such as nn.LazyLinear): run "
                    f"one forward on a sample batch before wrapping the model, so that its shapes are known")
            if tensor.is_meta:
                raise ValueError(
                    f"PoseidonDDP: {kind} {name!r} is on the meta device: materialise the model before wrapping "
                    f"it, e.g. model.to_empty(device='cpu') then initialise it (reset_parameters() on each "
                    f"module, or load_state_dict() of a checkpoint)")


def _check_dense_gradients(module: nn.Module, periodic: bool) -> None:
    """Refuse, before any collective, an embedding that gives sparse gradients (``sparse=True``) unless
    the parameters are averaged (``sync_every``): the gradient paths sync dense buffers (it failed in
    backward with "reshape is not implemented for sparse tensors")."""
    if periodic:
        return
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            raise ValueError(f"PoseidonDDP: {name or type(child).__name__!r} ({type(child).__name__}(sparse=True)) "
                             "gives sparse gradients, and PoseidonDDP syncs dense ones: build it with sparse=False, "
                             "or average the parameters instead (sync_every=H, where the gradients stay local)")


def _on_cpu(state: Any) -> Any:
    """``state`` (nested dicts of tensors) with every tensor copied to the CPU, to gather and save."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, Mapping):
        return {key: _on_cpu(value) for key, value in state.items()}
    return state


def _group_over(ranks: list[int]) -> Any:
    """The process group of a copy that starts training: the world, or a new group over the same ranks
    (made by the members only)."""
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)


def _single_device(module: nn.Module) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"PoseidonDDP needs all parameters on one device, found {sorted(map(str, devices))}")
    return devices.pop()
