"""The bundled tracer's recording side: spans of compute and sync, for a window of iterations.

Switched on by ``PoseidonDDP(trace_dir=...)`` or the environment (``POSEIDON_TRACE_DIR``, with
``POSEIDON_TRACE_SKIP`` and ``POSEIDON_TRACE_ITERS``). It skips the first ``skip`` iterations, records the
next ``iters``, then writes one Chrome trace per rank and, on rank 0, a merged trace of all ranks.
Invariants:
- when tracing is off, ``active`` is always False and the engine records nothing (one attribute read
  per sync job: no timestamps, strings or span objects are made);
- a sync job is observed from outside: :meth:`Recorder.run_job` drives the path's phases and stamps
  the boundaries the path yields; the data path itself never sees the tracer;
- all spans of a rank come from ``time.monotonic_ns()`` and are shifted by the rank's clock offset to
  rank 0, measured once at start-up, when written;
- a span belongs to the iteration of the pass it records (a deferred pass, Pipe-SGD's, closes during the
  next iteration's forward, so the window closes there); waits and forwards to the training thread's;
- writing happens once, when the window closes: the spans are gathered to every rank (collective over
  the control group, in the training thread), then the files are written by a background thread so the
  training step does not wait on the disk; ``flush()`` waits for it;
- a run that ends before the window closes (``close()``, or the process exits) still writes what it
  recorded, one file per rank and no collective (rank 0 says so, and how to merge them); a run that
  ended before the window began says that nothing was recorded.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..env import from_env, option
from . import files
from .spans import Span


@dataclass(frozen=True)
class TraceConfig:
    directory: str
    skip: int = 5
    iters: int = 10

    @classmethod
    def resolve(cls, directory: str | None, skip: int | None, iters: int | None) -> "TraceConfig | None":
        """Options win over the environment; no directory from either means tracing is off."""
        directory = directory or from_env("TRACE_DIR", str)
        if not directory:
            return None
        skip = option(skip, "TRACE_SKIP", int, cls.skip)
        iters = option(iters, "TRACE_ITERS", int, cls.iters)
        if skip < 0 or iters < 1:
            raise ValueError(f"trace window needs skip >= 0 and iters >= 1, got skip={skip}, iters={iters}")
        return cls(directory, skip, iters)


class Recorder:
    """Spans of one rank; ``gather(obj)`` returns every rank's ``obj`` (a collective)."""

    def __init__(self, config: TraceConfig | None, rank: int, world_size: int,
                 gather: Callable[[object], list]) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.spans: list[Span] = []
        self.active = False
        self.written: list[Path] = []  #: the files, once the writer thread has written them
        self._closed = False  # the window is over (set on the training thread)
        self._writer: threading.Thread | None = None
        self._gather = gather
        self._iteration = -1
        self._iteration_start = 0
        #: the model's buckets and layers, written into the trace's metadata (the engine sets it)
        self.layout: Callable[[], dict] | None = None
        self.clock_offset_ns = self._measure_clock_offset() if config else 0

    def _measure_clock_offset(self) -> int:
        """Offset of this rank's monotonic clock to rank 0's, taken right after a barrier."""
        self._gather(None)
        stamps = self._gather(time.monotonic_ns())
        return stamps[self.rank] - stamps[0]

    def start_iteration(self) -> int | None:
        """The training thread begins an iteration: its index when the window records it, else None (the
        engine keeps it with the iteration's pass, which may close during the next iteration)."""
        if self.config is None or self._closed:
            return None
        self._iteration += 1
        first = self.config.skip
        self.active = first <= self._iteration < first + self.config.iters
        self._iteration_start = time.monotonic_ns()
        return self.current

    @property
    def current(self) -> int | None:
        """The training thread's iteration, when the window records it."""
        return self._iteration if self.active else None

    def add(self, kind: str, name: str, lane: str, start_ns: int, end_ns: int, iteration: int | None = None,
            **args) -> None:
        """A span of ``iteration`` (default: the training thread's)."""
        self.spans.append(Span(kind, name, lane, start_ns - self.clock_offset_ns, end_ns - self.clock_offset_ns,
                               self._iteration if iteration is None else iteration, args))

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """The training thread blocks on the sync (``name``: one of ``WAIT_NAMES``) for the ``with`` body:
        a ``wait`` span when recording, nothing otherwise."""
        if not self.active:
            yield
            return
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.add("wait", name, "compute", start, time.monotonic_ns())

    def run_job(self, phases: Generator[str, None, object], name: str, lane: str, ready_ns: int, path: str,
                bytes_sent: Callable[[], int], iteration: int, envelope: str = "sync") -> object:
        """Drive a sync job of ``iteration``'s pass to the end, recording its queue wait, each phase the
        path yields (a phase lasts until the next one begins) and the whole job (a span of kind
        ``envelope``: "sync", or "pull" for the second slot of a split job); returns the job's result."""
        start = time.monotonic_ns()
        self.add("queue", name, lane, ready_ns, start, iteration)
        kind, since = None, start
        while True:
            try:
                following = next(phases)
            except StopIteration as stop:
                end = time.monotonic_ns()
                if kind is not None:
                    self.add(kind, name, lane, since, end, iteration, path=path)
                self.add(envelope, name, lane, start, end, iteration, path=path, bytes=bytes_sent())
                return stop.value
            now = time.monotonic_ns()
            if kind is not None:
                self.add(kind, name, lane, since, now, iteration, path=path)
            kind, since = following, now

    def end_iteration(self, iteration: int | None, began_ns: int | None = None, **args) -> None:
        """Iteration ``iteration`` (None: not recorded) ended: its pass closes now, possibly during the
        next iteration (a deferred pass); it began at ``began_ns`` (its round's first forward); ``args``:
        what the consistency policy says of it (SSP: the clock and the staleness its answers had). The
        window's last iteration writes the trace."""
        if iteration is None or self._closed:
            return
        self.add_iteration(iteration, began_ns, **args)
        if iteration + 1 == self.config.skip + self.config.iters:
            self.active = False
            self._write()

    def add_iteration(self, iteration: int, began_ns: int | None = None, **args) -> None:
        """Iteration ``iteration``'s span, ending now, without closing the window (the wrapper closes with
        its pass still open: :meth:`finish` writes it)."""
        began = self._iteration_start if began_ns is None else began_ns
        self.add("iteration", "iteration", "compute", began, time.monotonic_ns(), iteration, **args)

    def _write(self) -> None:
        self._closed = True
        gathered: list[list[Span]] = self._gather(self.spans)
        self._writer = threading.Thread(target=self._write_files, args=(gathered, self._meta(self.config.iters)),
                                        name="poseidon-trace-writer")
        self._writer.start()

    def _meta(self, recorded: int) -> dict:
        """The trace's metadata, taken on the training thread (the layout reads the engine's buckets)."""
        meta = {"skip": self.config.skip, "iters": self.config.iters, "recorded": recorded}
        if self.layout is not None:
            meta["layout"] = self.layout()
        return meta

    def _write_files(self, gathered: list[list[Span]], meta: dict) -> None:
        """This rank's trace, and on rank 0 the merged one of ``gathered`` (every rank's spans, if any)."""
        out = Path(self.config.directory)
        out.mkdir(parents=True, exist_ok=True)
        own = out / f"trace_rank{self.rank}.json"
        files.write_rank_trace(own, self.spans, self.rank, self.world_size, meta)
        self.written.append(own)
        if self.rank == 0 and gathered:
            merged = out / "trace_merged.json"
            files.write_merged_trace(merged, gathered, self.world_size, meta)
            self.written.append(merged)

    def finish(self) -> None:
        """The run ends (the wrapper closes): write what an unfinished window recorded, locally."""
        if self.config is None or self._closed:
            return
        self._closed, self.active = True, False
        recorded = len({span.iteration for span in self.spans if span.kind == "iteration"})
        if not self.spans:
            self._say(f"the run ended after {self._iteration + 1} synced iteration(s), before the trace window "
                      f"began (trace_skip={self.config.skip}): nothing was recorded; lower trace_skip")
            return
        self._write_files([], self._meta(recorded))
        ended = ("the trace window's last pass was still open when the wrapper closed (with lazy pulls or a "
                 "ServerOptimizer delay a step's pass closes at the next forward, with delay=k in the next backward)"
                 if recorded == self.config.iters
                 else f"the run ended after {recorded} of the {self.config.iters} traced iteration(s)")
        self._say(f"{ended}: wrote each rank's trace to {self.config.directory}/trace_rank*.json (no merged trace); "
                  f"merge them with `python -m poseidon_torch.trace merge -o trace_merged.json "
                  f"{self.config.directory}/trace_rank*.json`")

    def _say(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(f"PoseidonDDP tracer: {message}", stacklevel=4)

    def flush(self, timeout: float = 120.0) -> None:
        """Wait until the trace files are on disk (no-op if none are being written)."""
        if self._writer is not None:
            self._writer.join(timeout)
            if self._writer.is_alive():
                raise TimeoutError(f"trace files in {self.config.directory} not written after {timeout:.0f}s")
