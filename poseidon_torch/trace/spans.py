"""Timed spans: the unit of record shared by the engine, the tracer and the trace tools.

Invariants:
- ``start_ns <= end_ns``, both from ``time.monotonic_ns()`` of the recording process, already shifted by
  that rank's clock offset to rank 0 when written to a trace file.
- ``kind`` is one of :data:`SPAN_KINDS`; ``lane`` names the row the span is drawn on
  (``"compute"`` for the training thread, ``"channel-<i>"`` for a sync pool thread).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: forward: the wrapped module's forward; backward: one bucket's share of the backward pass;
#: iteration: forward start to the end of the BSP barrier; queue: a sync job waiting for its channel;
#: the phases of a sync job, as its path yields them: gather (gradients or factors into the send
#: buffer, device-to-host on the staged GPU path), network (bytes on the wire), rebuild (SFB's GEMM),
#: compress / decompress (a lossy path's compute before and after its messages), update (the optimizer
#: step at a shard, parameter-server mode); scatter: every average back into
#: ``.grad``, on the compute lane at the end of backward; sync: a whole sync job, or the first slot of a
#: split one (args carry ``path`` and ``bytes``); pull: the second slot of a split job (update and pull,
#: parameter-server mode; it carries the job's bytes); wait: the training thread blocked on the sync, named
#: for what it waits on (:data:`WAIT_NAMES`), inside a forward span or after the backward.
SPAN_KINDS = ("forward", "backward", "iteration", "queue", "gather", "network", "rebuild", "compress", "decompress",
              "update", "scatter", "sync", "pull", "wait")
JOB_KINDS = ("sync", "pull")
PHASE_KINDS = ("gather", "network", "rebuild", "compress", "decompress", "update", "scatter")
COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("network",)
WAIT_KINDS = ("wait",)
#: jobs: a pass's sync jobs (the BSP barrier at the end of backward, or a deferred pass at the next
#: forward); facts: the end-of-pass facts exchange; forward collectives: what a forward issues before
#: the module runs (rank 0's buffers, join()'s notices); values: a layer's new parameter values, waited
#: for at that layer's forward (parameter-server mode with lazy pulls or a staleness bound)
WAIT_NAMES = ("jobs", "facts", "forward collectives", "values")


@dataclass(frozen=True)
class Span:
    kind: str
    name: str
    lane: str
    start_ns: int
    end_ns: int
    iteration: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns
