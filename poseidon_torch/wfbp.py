"""Wait-free backpropagation: start each syncer's sync the moment its layer's gradients are ready.

Flow of one iteration:
1. a post-accumulate-grad hook fires per parameter; when the last parameter of a syncer reports, the
   syncer is submitted to its channel (pools.py) and its sync overlaps the rest of backward;
2. the first hook of a backward queues ``_finish_backward`` on the autograd engine, so it runs when the
   autograd pass ends: it submits the syncers some parameter of which got no gradient (unused on this
   rank), then waits on the BSP barrier; ``loss.backward()`` returns only after every syncer completed;
3. a sync job gathers the syncer's gradients into its flat buffer, averages it over the ranks through the
   layer's path (sharded KV store by default), and writes the averages back into ``.grad``.
Invariants: every syncer is synced exactly once per armed backward, on every rank, in each channel's
fixed order; no ``.grad`` is read by the optimizer before its sync finished (barrier); on CUDA the
training stream waits on each job's completion event before backward returns.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import kvstore
from .barrier import BSPBarrier
from .coordinator import PS, SFB, Coordinator
from .pools import ChannelGroups, StreamPool, SyncChannel, assign_round_robin
from .sfb import SFBLayer
from .syncer import Syncer
from .tracer import Recorder


@dataclass
class CommStats:
    """Bytes this rank handed to torch.distributed for gradient sync."""
    bytes_sent_last_iteration: int = 0
    bytes_sent_total: int = 0
    iterations: int = 0
    bytes_by_syncer: dict[str, int] = field(default_factory=dict)
    bytes_by_path: dict[str, int] = field(default_factory=dict)  #: last iteration; "plan" = K exchange


class WFBPEngine:
    def __init__(self, syncers: Sequence[Syncer], channel_groups: Sequence[ChannelGroups], rank: int,
                 world_size: int, chunk_bytes: int, timeout: float, staged: bool,
                 recorder: Recorder, fc_layers: dict[int, SFBLayer] | None = None,
                 coordinator: Coordinator | None = None) -> None:
        self.syncers = list(syncers)
        self.fc_layers = dict(fc_layers or {})
        self.coordinator = coordinator
        self._accumulated: set[int] = set()  # syncers whose .grad accumulated under no_sync
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.recorder = recorder
        self.stats = CommStats()
        self.armed = False
        self._staged = staged
        self._flat = [s.new_flat_buffer(pin_memory=staged) for s in self.syncers]
        self._store = kvstore.ShardedKVStore([s.numel for s in self.syncers], self._element_size(), rank,
                                             world_size, chunk_bytes)
        self._where = {id(p): (s.index, j) for s in self.syncers for j, p in enumerate(s.params)}
        self.barrier = BSPBarrier([s.name for s in self.syncers])
        self._lock = threading.Lock()
        self._cuda = any(s.device.type == "cuda" for s in self.syncers)
        self._init_cuda_events(len(channel_groups))
        self._bytes = [0] * len(self.syncers)
        self._reset_iteration()
        orders = assign_round_robin(len(self.syncers), len(channel_groups))
        self.channels = [SyncChannel(i, channel_groups[i], order, self._run_job, self.barrier.fail)
                         for i, order in enumerate(orders)]
        self._channel_of = {s: ch for ch in self.channels for s in ch.order}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for s in self.syncers for p in s.params]
        for fc in self.fc_layers.values():
            fc.capture.on_complete = functools.partial(self._on_factors_complete, fc)

    def _element_size(self) -> int:
        sizes = {s.params[0].element_size() for s in self.syncers}
        if len(sizes) > 1:
            raise ValueError(f"mixed parameter element sizes {sorted(sizes)} are not supported yet")
        return sizes.pop() if sizes else 4

    def _init_cuda_events(self, num_channels: int) -> None:
        if not self._cuda:
            self._streams = None
            return
        self._streams = StreamPool(self.syncers[0].device, num_channels)
        self._ready_events = [torch.cuda.Event() for _ in self.syncers]
        self._done_events = [torch.cuda.Event() for _ in self.syncers]

    def _reset_iteration(self) -> None:
        self._used = [[False] * len(s.params) for s in self.syncers]
        self._pending = [len(s.params) for s in self.syncers]
        self._submitted = [False] * len(self.syncers)
        self._callback_queued = False
        self._last_ready_ns = None

    # ---- training thread / autograd side -------------------------------------------------------

    def begin_forward(self, armed: bool) -> None:
        """A forward starts; ``armed``: its backward syncs (grad mode on and not inside no_sync).
        FC layers the cost model preferred on SFB last iteration are committed to it now: their
        forward skips the local weight gradient. Every rank commits the same layers (same last plan,
        same no_sync)."""
        self.armed = armed
        preferred = self.coordinator.preferred if self.coordinator is not None else []
        for i, fc in self.fc_layers.items():
            fc.capture.enabled = armed
            fc.detach_weight = armed and preferred[i] == SFB and i not in self._accumulated

    def end_forward(self) -> None:
        """Undo any weight swap a forward that raised left behind."""
        for fc in self.fc_layers.values():
            fc.restore()

    def plan_iteration(self, control_group) -> None:
        """After an armed forward: agree with all ranks on each syncer's path for the coming backward."""
        if self.coordinator is None:
            return
        local_k = [-1 if i in self._accumulated else self.fc_layers[i].capture.num_samples
                   for i in self.coordinator.fc_indices]
        committed = {i for i, fc in self.fc_layers.items() if fc.detach_weight}
        self.coordinator.plan_iteration(local_k, control_group, committed)

    def _on_factors_complete(self, fc: SFBLayer) -> None:
        """A committed layer's weight gets no autograd gradient: its factors being complete is its
        readiness."""
        if fc.detach_weight:
            self._on_grad_ready(fc.weight)

    def _path_of(self, s_idx: int) -> str:
        return self.coordinator.paths[s_idx] if self.coordinator is not None else PS

    def mark_backward_start(self) -> None:
        """Tracing only: the gradient of the model output exists, so backward compute has begun."""
        self._last_ready_ns = time.monotonic_ns()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        s_idx, p_idx = self._where[id(param)]
        if not self.armed:
            self._accumulated.add(s_idx)
            return
        with self._lock:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self._used[s_idx][p_idx]:
                return
            self._used[s_idx][p_idx] = True
            self._pending[s_idx] -= 1
            ready = self._pending[s_idx] == 0
            if ready:
                self._record_backward_span(s_idx)
        if ready:
            self._submit(s_idx)

    def _record_backward_span(self, s_idx: int) -> None:
        if self.recorder.active and self._last_ready_ns is not None:
            now = time.monotonic_ns()
            self.recorder.add("backward", self.syncers[s_idx].name, "compute", self._last_ready_ns, now)
            self._last_ready_ns = now

    def _submit(self, s_idx: int) -> None:
        self._submitted[s_idx] = True
        if self._cuda:
            self._ready_events[s_idx].record()
        self._channel_of[s_idx].submit(s_idx)

    def _finish_backward(self) -> None:
        with self._lock:
            late = [i for i, done in enumerate(self._submitted) if not done]
        for s_idx in late:  # some parameter got no gradient on this rank: sync what there is
            self._submit(s_idx)
        try:
            self.barrier.wait(self.timeout)
        finally:
            self._reset_iteration()
        self.barrier.reset()
        self._accumulated.clear()
        if self._cuda:
            for event in self._done_events:
                torch.cuda.current_stream().wait_event(event)
        self._update_stats()
        self.recorder.end_iteration()

    def _update_stats(self) -> None:
        by_path = {PS: 0, SFB: 0, "plan": 0}
        for s_idx, sent in enumerate(self._bytes):
            by_path[self._path_of(s_idx)] += sent
        if self.coordinator is not None:
            by_path["plan"] = self.coordinator.exchange_bytes()
        total = sum(by_path.values())
        self.stats.bytes_sent_last_iteration = total
        self.stats.bytes_sent_total += total
        self.stats.iterations += 1
        self.stats.bytes_by_syncer = {s.name: b for s, b in zip(self.syncers, self._bytes)}
        self.stats.bytes_by_path = by_path

    # ---- pool thread side ------------------------------------------------------------------------

    def _run_job(self, s_idx: int, groups: ChannelGroups, ready_ns: int) -> None:
        syncer, flat = self.syncers[s_idx], self._flat[s_idx]
        channel = self._channel_of[s_idx]
        lane = f"channel-{channel.index}"
        start_ns = time.monotonic_ns()
        path = self._path_of(s_idx)
        with torch.profiler.record_function(f"poseidon.sync.{path}.{syncer.name}"), \
                self._device_stream(channel.index, s_idx) as stream:
            if path == SFB:
                net_start, net_end, sent = self._sync_sfb(self.fc_layers[s_idx], s_idx, groups.up, lane)
            else:
                net_start, net_end, sent = self._sync_ps(syncer, flat, groups, stream, f"stream-{channel.index}")
            if stream is not None:
                self._done_events[s_idx].record(stream)
        self._bytes[s_idx] = sent
        self._record_job(syncer.name, lane, ready_ns, start_ns, net_start, net_end, sent, path)
        self.barrier.arrive(s_idx)

    def _sync_sfb(self, fc: SFBLayer, s_idx: int, group: object, lane: str) -> tuple[int, int, int]:
        net_start = time.monotonic_ns()
        u_all, v_all, sent = fc.exchange(self.coordinator.counts[s_idx], group, self._staged)
        net_end = time.monotonic_ns()
        fc.rebuild(u_all, v_all, self.world_size)
        if self.recorder.active:
            self.recorder.add("rebuild", self.syncers[s_idx].name, lane, net_end, time.monotonic_ns())
        return net_start, net_end, sent

    def _sync_ps(self, syncer: Syncer, flat: torch.Tensor, groups: ChannelGroups, stream,
                 stream_lane: str) -> tuple[int, int, int]:
        if syncer.index in self.fc_layers:
            self.fc_layers[syncer.index].discard()
        copy_start = time.monotonic_ns()
        syncer.gather_grads(flat, self._used[syncer.index])
        if stream is not None and self._staged:
            stream.synchronize()  # the host buffer must hold the gradients before gloo reads it
            if self.recorder.active:
                self.recorder.add("d2h", syncer.name, stream_lane, copy_start, time.monotonic_ns())
        net_start = time.monotonic_ns()
        sent = self._average(syncer, flat, groups)
        net_end = time.monotonic_ns()
        syncer.scatter_grads(flat)
        return net_start, net_end, sent

    def _average(self, syncer: Syncer, flat: torch.Tensor, groups: ChannelGroups) -> int:
        if self.world_size == 1:
            return 0
        return self._store.push_pull(syncer.index, flat, groups)

    @contextlib.contextmanager
    def _device_stream(self, channel_index: int, s_idx: int):
        if self._streams is None:
            yield None
            return
        stream = self._streams.for_channel(channel_index)
        stream.wait_event(self._ready_events[s_idx])
        with torch.cuda.stream(stream):
            yield stream

    def _record_job(self, name: str, lane: str, ready_ns: int, start_ns: int, net_start: int,
                    net_end: int, sent: int, path_name: str) -> None:
        rec = self.recorder
        if not rec.active:
            return
        path = {"path": path_name, "bytes": sent}
        rec.add("queue", name, lane, ready_ns, start_ns)
        rec.add("network", name, lane, net_start, net_end, **path)
        rec.add("sync", name, lane, start_ns, time.monotonic_ns(), **path)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for fc in self.fc_layers.values():
            fc.remove()
        for channel in self.channels:
            channel.stop()
