"""BSP counter barrier: an iteration ends only when every syncer of that iteration has completed.

The paper's client keeps a 0/1 vector with one entry per syncer; the training thread waits until all are
1. Invariants:
- ``arrive`` and ``fail`` may be called from any thread; ``wait`` is called by the training thread only.
- ``wait`` returns only when every syncer arrived; it raises :class:`SyncError` naming the first failed
  syncer and its cause, or :class:`SyncTimeout` naming the syncers still missing. It never blocks longer
  than its timeout.
- After a failure the barrier stays failed: collectives of the failed iteration may be half issued, so no
  later iteration may pretend the ranks are still in step.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence


class SyncError(RuntimeError):
    """A sync job failed; the message names the syncer (layer) and the cause."""


class SyncTimeout(SyncError):
    """Not every syncer completed within the timeout (a dead or stuck peer)."""


class BSPBarrier:
    def __init__(self, syncer_names: Sequence[str]) -> None:
        self._names = list(syncer_names)
        self._done = [False] * len(self._names)
        self._remaining = len(self._names)
        self._failure: SyncError | None = None
        self._cond = threading.Condition()

    @property
    def failure(self) -> SyncError | None:
        return self._failure

    def reset(self) -> None:
        """Start a new iteration (training thread, after the previous ``wait`` returned)."""
        with self._cond:
            self._done = [False] * len(self._names)
            self._remaining = len(self._names)

    def arrive(self, index: int) -> None:
        with self._cond:
            if self._done[index]:
                raise RuntimeError(f"syncer {self._names[index]!r} completed twice in one iteration")
            self._done[index] = True
            self._remaining -= 1
            if self._remaining == 0:
                self._cond.notify_all()

    def fail(self, index: int, cause: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                error = SyncError(f"sync of layer {self._names[index]!r} failed: {type(cause).__name__}: {cause}")
                error.__cause__ = cause
                self._failure = error
            self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failure is None and self._remaining > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n, done in zip(self._names, self._done) if not done]
                    self._failure = SyncTimeout(
                        f"BSP barrier timed out after {timeout:.1f}s waiting for {len(missing)} syncer(s): "
                        f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                        "(a peer died, hung, or skipped this backward)")
                    break
                self._cond.wait(left)
            if self._failure is not None:
                raise self._failure
