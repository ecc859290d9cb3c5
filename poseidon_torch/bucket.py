"""Buckets: the unit of wait-free backprop. One bucket is one sync job of one or more layers.

A *layer* is a module that directly owns trainable parameters (split by dtype and device, so a bucket
never mixes them). Before the first backward, layers are grouped in reverse registration order, small
neighbours fused; after it, buckets are rebuilt once from the order in which gradients actually became
ready (rank 0's order, the same on every rank): the fewest buckets whose simulated pipeline of sync
jobs ends no later (within one job latency) than any grouping could, so small layers ride with their
neighbours and only the layers near the end of backward keep short jobs; ``fusion_bytes`` caps what
a bucket holds besides its largest layer (a layer above the cap still takes its small neighbours along).
Layers that may take the SFB path stay buckets of their own.

A :class:`Bucket` owns its parameters, its flat buffer, its used flags, its per-pass readiness and its
CUDA events. Invariants:
- every trainable parameter belongs to exactly one bucket (a parameter shared by several modules goes
  to the first module that registers it); a bucket's parameters share one dtype and device;
- the flat buffer holds the gradients back to back, then one *used flag* per parameter, then one
  *aborted* flag. Every rank sends its whole ``.grad`` (zeros where None), as torch DDP does for
  parameters a rank did not use; after averaging, a flag > 0 means some rank used the parameter and
  only those get the average written back (a parameter no rank used keeps ``.grad`` untouched); an
  aborted flag > 0 means some rank's backward was aborted and nothing is written back;
- ``dirty`` marks parameters whose ``.grad`` holds local, unsynced gradient (accumulated under
  ``no_sync`` or in an aborted pass): they count as used at the next synced backward, however long
  the no_sync session lasted. ``seen``, ``dirty`` and ``used_anywhere`` are uint8 tensors that the
  core (Python or native) and the paths share; the bucket's readiness countdown lives in the core;
- a pass copies ``.grad`` into the flat buffer once (:meth:`Bucket.stage`), on the thread that makes
  the bucket ready, before its job is queued (see ``core.py``): no job ever reads ``.grad``, so what
  the user does to ``.grad`` while jobs run cannot change the sync;
- a CUDA bucket staged through a host buffer (gloo) has a device copy of its gradients' part: a sync
  that ends with every rank's average in the host buffer (:meth:`Bucket.read_flags`) uploads it there
  on the job's stream, so whatever writes the averages (:meth:`Bucket.averages`) copies device to
  device at the end of backward. Events order the three buffers' users: the next staging waits for
  the upload to have read the host buffer (``uploaded``), every reader of the device copy for the
  upload too, and the next upload for the last reader (``averages_read``), each on the current stream
  of the bucket's device (not of the thread's current device: a rank that never called
  ``torch.cuda.set_device`` reads on another device's stream); the training stream waits for the job
  (``done``, recorded after the upload).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

USED = 1.0


@dataclass(frozen=True)
class Layer:
    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (qualified name, parameter)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params)

    @property
    def kind(self) -> tuple[torch.dtype, torch.device]:
        p = self.params[0][1]
        return p.dtype, p.device


def flat_numel(grad_numel: int, tensors: int) -> int:
    """Elements of a bucket's flat buffer, what the PS path moves: the gradients, then one flag per
    tensor (its gradient was defined) and one for the bucket."""
    return grad_numel + tensors + 1


class Bucket:
    """The parameters of one sync job, their flat buffer and the flags the core and the paths share."""

    def __init__(self, index: int, layers: Sequence[Layer], pin_memory: bool = False) -> None:
        self.index = index
        self.layers = list(layers)
        self.params = [p for layer in self.layers for _, p in layer.params]
        self.param_names = [n for layer in self.layers for n, _ in layer.params]
        self.position = {id(p): j for j, p in enumerate(self.params)}
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.grad_numel = offset
        device = torch.device("cpu") if pin_memory else self.device
        self.flat = torch.zeros(flat_numel(self.grad_numel, len(self.params)), dtype=self.dtype, device=device,
                                pin_memory=pin_memory)
        self.fc = None  #: the FC layer (sfb.FCLayer) when this bucket may take the SFB path
        n = len(self.params)
        self.seen = torch.zeros(n, dtype=torch.uint8)  #: accumulated in the current pass (the core sets it)
        self.dirty = torch.zeros(n, dtype=torch.uint8)  #: holds local, unsynced gradient
        self.used_anywhere = torch.zeros(n, dtype=torch.uint8)  #: after the last sync: some rank used it
        self.bytes_sent = 0  #: by this rank in the bucket's last sync
        self.sync_seconds = 0.0  #: how long the bucket's last sync job took
        self.outcome = ""  #: how its last sync went: "PS", "SFB", or "SFB->PS" (exactness fallback)
        self.missing: list[int] = []  #: positions staged without their zeros (see :meth:`stage`)
        #: CUDA: recorded on the training stream when the gradients are complete / on the side stream
        #: after the sync job; with a host buffer also when the staging copies are done (`staged`), when
        #: the averages are on the device (`uploaded`) and after the last reader of them (`averages_read`)
        self.ready_event = self.done_event = self.staged_event = None
        self.uploaded_event = self.averages_read_event = None
        self.device_averages: torch.Tensor | None = None  #: the host buffer's gradients, uploaded (staged CUDA)
        if self.device.type == "cuda":
            self.ready_event, self.done_event = torch.cuda.Event(), torch.cuda.Event()
            if self.flat.device != self.device:
                self.staged_event, self.uploaded_event = torch.cuda.Event(), torch.cuda.Event()
                self.averages_read_event = torch.cuda.Event()
                self.device_averages = torch.empty(self.grad_numel, dtype=self.dtype, device=self.device)

    @property
    def name(self) -> str:
        return "+".join(layer.name for layer in self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer (gradients and flags), what the PS path moves."""
        return self.flat.numel() * self.flat.element_size()

    # ---- the flat buffer ------------------------------------------------------------------------

    def views(self, flat: torch.Tensor | None = None) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        flat = self.flat if flat is None else flat
        for p, offset in zip(self.params, self.offsets):
            yield p, flat[offset:offset + p.numel()].view(p.shape)

    def stage(self, aborted: bool, shadow: bool = False, grads_present: bool = False,
              defer_zeros: bool = False) -> None:
        """Copy this rank's ``.grad`` (zeros where None), the used flags (accumulated in this pass, or
        dirty) and the aborted flag into the flat buffer; a ``shadow`` (joined) rank contributes zeros
        and no flags. ``grads_present``: also flag every parameter that has a ``.grad`` (an optimizer
        steps those). ``defer_zeros``: leave the pieces of parameters without ``.grad`` unwritten and
        listed in :attr:`missing` (:meth:`fill_missing` zeroes them if they are ever read: an SFB layer
        needs its ``.grad`` only when it falls back to PS)."""
        self.missing = []
        if self.uploaded_event is not None:  # the last averages must have left the host buffer first
            self.uploaded_event.synchronize()
        if shadow:
            self.flat.zero_()
            return
        for j, (p, piece) in enumerate(self.views()):
            if p.grad is not None:
                piece.copy_(p.grad, non_blocking=True)
                if p.grad.is_cuda:  # read on a side stream: the allocator must not hand it out before
                    p.grad.record_stream(torch.cuda.current_stream(self.device))
            elif defer_zeros:
                self.missing.append(j)
            else:
                piece.zero_()
        self._stage_flags(aborted)
        if grads_present:
            flags = self.flat[self.grad_numel:-1]
            for j, p in enumerate(self.params):
                if p.grad is not None:
                    flags[j] = USED

    def stage_values(self, values: Sequence[torch.Tensor]) -> None:
        """Copy ``values`` (one per parameter, in order: what a mode averages instead of gradients, e.g.
        the parameters themselves) into the flat buffer, every parameter flagged used, none aborted."""
        if self.uploaded_event is not None:  # the last averages must have left the host buffer first
            self.uploaded_event.synchronize()
        for (_, piece), value in zip(self.views(), values):
            piece.copy_(value, non_blocking=True)
        self.flat[self.grad_numel:-1] = USED
        self.flat[-1] = 0.0
        if self.staged_event is not None:
            self.staged_event.record(torch.cuda.current_stream(self.device))

    def fill_missing(self) -> None:
        """The zeros :meth:`stage` deferred (any thread: only the flat buffer is touched)."""
        for j in self.missing:
            self.flat[self.offsets[j]:self.offsets[j] + self.params[j].numel()].zero_()
        self.missing = []

    def _stage_flags(self, aborted: bool) -> None:
        flags = self.flat[self.grad_numel:]
        flags[:-1].copy_(self.seen | self.dirty, non_blocking=True)
        flags[-1] = USED if aborted else 0.0
        if self.staged_event is not None:  # the copies run on; :meth:`wait_staged` before gloo reads them
            self.staged_event.record(torch.cuda.current_stream(self.device))

    def wait_staged(self) -> None:
        """Block until :meth:`stage`'s device-to-host copies have landed (no-op unless staged through a
        host buffer): call before anything on the CPU reads the buffer."""
        if self.staged_event is not None:
            self.staged_event.synchronize()

    def begin_pass(self) -> None:
        """A pass opens: a dirty parameter whose ``.grad`` the user has since set to None (``zero_grad()``
        after a skipped step) holds nothing unsynced any more."""
        if self.dirty.any():
            for j, p in enumerate(self.params):
                if p.grad is None:
                    self.dirty[j] = 0

    def read_flags(self) -> bool:
        """After an average (sync thread): which parameters some rank used; False (local gradients kept
        as unsynced) when some rank aborted. Nothing is written into ``.grad`` here; a staged CUDA
        bucket's averages are uploaded to the device on the calling thread's stream."""
        flags = self.read_used()
        if flags[-1]:
            self.dirty |= self.seen
            return False
        self.upload()
        return True

    def read_used(self) -> torch.Tensor:
        """After an average: which parameters some rank used, into ``used_anywhere``; every flag, as bools
        (the last one: some rank aborted)."""
        flags = self.flat[self.grad_numel:] > 0
        self.used_anywhere.copy_(flags[:-1])
        return flags

    def upload(self) -> None:
        """A staged CUDA bucket (no-op otherwise): copy the host buffer's gradients part (averages, or
        the new values a server pulled) to the device copy, on the current stream, once the last
        reader of the previous ones is done with it."""
        if self.device_averages is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.averages_read_event)
        self.device_averages.copy_(self.flat[:self.grad_numel], non_blocking=True)
        self.uploaded_event.record(stream)

    @contextmanager
    def averages(self) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
        """After a sync: every parameter some rank used, with its average (or new value), on the
        parameter's device. Read them inside the block, on the current stream of the bucket's device
        (the stream its kernels run on, whatever the thread's current device): a staged CUDA bucket's
        device copy is read there after its upload, and the next upload waits for the block's end
        there, also when the block raises."""
        source = self.flat
        if self.device_averages is not None:
            source = self.device_averages
            torch.cuda.current_stream(self.device).wait_event(self.uploaded_event)
        try:
            yield [(p, value) for used, (p, value) in zip(self.used_anywhere.tolist(), self.views(source)) if used]
        finally:
            if self.averages_read_event is not None:
                self.averages_read_event.record(torch.cuda.current_stream(self.device))

    def release_device_copy(self) -> None:
        """The engine closes with every job done: the device copy's memory goes back to the allocator
        now, once its last upload has landed (the training stream never waited for an unsettled
        pass's), not when a garbage collection finds the closed engine."""
        if self.device_averages is not None:
            self.uploaded_event.synchronize()
            self.device_averages = None

    def scatter(self) -> None:
        """Write the averages back into ``.grad`` of every parameter some rank used (training thread, at
        the end of a backward that was not aborted: so nothing of an aborted one lands after the
        user's ``zero_grad()``)."""
        with self.averages() as averages:
            for p, _ in averages:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
            if averages:
                torch._foreach_copy_([p.grad for p, _ in averages], [value for _, value in averages])
        self.dirty &= ~self.used_anywhere.bool()


# ---- grouping layers into buckets ---------------------------------------------------------------

def find_layers(module: nn.Module) -> list[Layer]:
    """Modules owning trainable parameters directly, in registration order, each parameter once,
    split by dtype and device."""
    seen: set[int] = set()
    layers = []
    for mod_name, mod in module.named_modules():
        kinds: dict[tuple, list] = {}
        for p_name, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                kinds.setdefault((p.dtype, p.device), []).append((f"{mod_name}.{p_name}" if mod_name else p_name, p))
        for i, params in enumerate(kinds.values()):
            name = mod_name or "<root>"
            layers.append(Layer(name if i == 0 else f"{name}#{i}", mod, tuple(params)))
    return layers


@dataclass(frozen=True)
class JobCost:
    """Seconds one sync job of ``nbytes`` takes: ``alpha_s + beta_s_per_byte * nbytes``."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) and x >= 0 for x in (self.alpha_s, self.beta_s_per_byte)):
            raise ValueError(f"a sync job's cost needs a finite latency and seconds per byte >= 0, got {self}")

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def group_layers(layers: Sequence[Layer], cap_bytes: int, solo: set[str],
                 ready_s: dict[str, float] | None = None, cost: JobCost | None = None) -> list[list[Layer]]:
    """Group ``layers`` (in the order their gradients become ready) into buckets of neighbours.

    Without timings (before the first backward) neighbours are fused while the bucket stays under
    ``cap_bytes``. With ``ready_s`` (seconds from the start of backward at which each layer's last
    gradient was ready) and the job ``cost``, the sync jobs are simulated as one pipeline on the link
    and the grouping is the one with the *fewest jobs* whose last sync ends at most one job latency
    after the earliest end any grouping reaches (:func:`fewest_jobs`): under BSP only the end of the
    last sync bounds the iteration, so an early layer may wait for its neighbours as long as that
    wait never reaches the tail. Layers in ``solo`` (SFB candidates) always form a bucket alone;
    dtypes and devices never mix; no bucket holds more than ``cap_bytes`` besides its largest layer."""
    first = _first_joinable(layers, cap_bytes, solo)
    if ready_s is None or cost is None:
        return _fill(layers, first)
    return fewest_jobs(layers, first, [ready_s[layer.name] for layer in layers], cost)


def _first_joinable(layers: Sequence[Layer], cap_bytes: int, solo: set[str]) -> list[int]:
    """``first[i]``: the smallest j such that ``layers[j:i + 1]`` may form one bucket: the same kind, no
    solo layer among several, and at most ``cap_bytes`` *besides its largest layer* (a layer above the
    cap is a job of its own anyway; small neighbours riding with it save their own jobs' latency). Any
    part of an allowed window is allowed, so one sweep does: the window only ever moves right (its
    largest layer kept in a monotone deque)."""
    first: list[int] = []
    j = size = 0
    largest: deque[int] = deque()  # window indices, their sizes decreasing
    for i, layer in enumerate(layers):
        prev = layers[i - 1] if i else None
        if layer.name in solo or prev is None or prev.name in solo or prev.kind != layer.kind:
            j, size = i, 0
            largest.clear()
        size += layer.nbytes
        while largest and layers[largest[-1]].nbytes <= layer.nbytes:
            largest.pop()
        largest.append(i)
        while size - layers[largest[0]].nbytes > cap_bytes and j < i:
            size -= layers[j].nbytes
            if largest[0] == j:
                largest.popleft()
            j += 1
        first.append(j)
    return first


def _fill(layers: Sequence[Layer], first: list[int]) -> list[list[Layer]]:
    """Greedy: each bucket takes neighbours while it may."""
    groups: list[list[Layer]] = []
    start = 0
    for i in range(len(layers)):
        if first[i] > start:
            groups.append(list(layers[start:i]))
            start = i
    return groups + [list(layers[start:])] if layers else groups


def fewest_jobs(layers: Sequence[Layer], first: list[int], ready: list[float],
                cost: JobCost) -> list[list[Layer]]:
    """The fewest contiguous buckets whose simulated last sync ends within ``cost.alpha_s`` of the
    earliest possible end (a job starts when its last layer is ready and the link is free).

    Row k of the dynamic program holds, for every prefix ``layers[:i]``, the earliest the link is free
    after syncing it in exactly k jobs. The link-free time only ever delays what follows, so the
    earliest one is the best prefix and the program is exact. ``first`` bounds which neighbours may
    share a bucket. Vectorised over prefixes (numpy), so thousands of layers take well under a second."""
    n = len(layers)
    if n == 0:
        return []
    offset = np.concatenate(([0.0], np.cumsum([layer.nbytes for layer in layers], dtype=np.float64)))
    ready_at = np.concatenate(([0.0], np.asarray(ready, dtype=np.float64)))  # [i]: when layers[i-1] is ready
    lo = np.concatenate(([0], np.asarray(first)))  # [i]: the first layer a bucket ending at layers[i-1] may hold

    def finish(link_free: np.ndarray, j: np.ndarray, i: np.ndarray) -> np.ndarray:
        return np.maximum(ready_at[i], link_free) + cost.alpha_s + cost.beta_s_per_byte * (offset[i] - offset[j])

    best = np.zeros(n + 1)  # any number of jobs; sequential in i, vectorised over the bucket's start
    for i in range(1, n + 1):
        j = np.arange(lo[i], i)
        best[i] = finish(best[j], j, i).min()
    deadline = best[n] + cost.alpha_s
    end, parents = np.full(n + 1, np.inf), []
    end[0] = 0.0
    widest = int((np.arange(n + 1) - lo)[1:].max())
    while end[n] > deadline and len(parents) < n:  # n single-layer jobs always fit: at most n rows
        row, parent = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
        for size in range(1, widest + 1):  # buckets of ``size`` layers, for every end at once
            i = np.arange(size, n + 1)
            j = i - size
            t = np.where(j >= lo[i], finish(end[j], j, i), np.inf)
            better = t < row[i]
            row[i[better]], parent[i[better]] = t[better], j[better]
        end = row
        parents.append(parent)
    groups, i = [], n
    for parent in reversed(parents):
        groups.append(list(layers[parent[i]:i]))
        i = int(parent[i])
    return groups[::-1]


def readiness_order(layers: Sequence[Layer], param_order: Sequence[int],
                    param_ready_s: Sequence[float]) -> tuple[list[Layer], dict[str, float]]:
    """Layers in the order their last parameter became ready, and that time. ``param_order`` lists
    positions in ``[p for layer in layers for p in layer.params]`` in event order, ``param_ready_s``
    their ready times. Layers not all of whose parameters became ready follow in reverse registration
    order, as if ready at the end."""
    owner = [layer for layer in layers for _ in layer.params]
    remaining = {layer.name: len(layer.params) for layer in layers}
    ready: dict[str, float] = {}
    for i, t in zip(param_order, param_ready_s):
        name = owner[i].name
        remaining[name] -= 1
        if remaining[name] == 0:
            ready[name] = t
    by_name = {layer.name: layer for layer in layers}
    rest = [layer for layer in reversed(layers) if layer.name not in ready]
    end = max(ready.values(), default=0.0)
    return [by_name[name] for name in ready] + rest, {**ready, **{layer.name: end for layer in rest}}


def build_buckets(groups: Sequence[Sequence[Layer]], pin_memory: bool,
                  fc_of: Callable[[Layer], object | None]) -> list[Bucket]:
    """Buckets for ``groups``; a single-layer bucket whose layer is an FC candidate gets ``fc``."""
    buckets = []
    for i, group in enumerate(groups):
        bucket = Bucket(i, group, pin_memory)
        if len(group) == 1:
            bucket.fc = fc_of(group[0])
        buckets.append(bucket)
    return buckets
