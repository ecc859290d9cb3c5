"""BSP counter barrier: a backward ends only when every sync job of its pass has completed.

The paper's client keeps a 0/1 vector with one entry per syncer and waits until all are 1. Here the
entries are job keys (one per bucket). This is the Python core's barrier; the native core has its
own, with the same contract. Invariants:
- ``arrive`` and ``fail`` may be called from any thread; ``wait`` by the training thread only;
- ``wait`` returns only when every expected job arrived; it raises :class:`SyncError` naming the first
  failed job and its cause, or :class:`SyncTimeout` naming the jobs still missing; it never blocks
  longer than its timeout;
- after a failure the barrier stays failed: collectives of that pass may be half issued, so no later
  pass may pretend the ranks are still in step.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable


class SyncError(RuntimeError):
    """A sync job failed, or a peer could not take part; the message names the job and the cause."""


class SyncTimeout(SyncError):
    """Not every sync job completed within the timeout (a dead or stuck peer)."""


class BSPBarrier:
    def __init__(self, describe: Callable[[Hashable], str]) -> None:
        self._describe = describe
        self._missing: set[Hashable] = set()
        self._failure: SyncError | None = None
        self._cond = threading.Condition()

    @property
    def failure(self) -> SyncError | None:
        return self._failure

    def expect(self, keys: Iterable[Hashable]) -> None:
        """Start a pass that ends when every key arrived (training thread, between passes)."""
        with self._cond:
            self._missing = set(keys)

    def arrive(self, key: Hashable) -> None:
        with self._cond:
            if key not in self._missing:
                raise RuntimeError(f"sync job {self._describe(key)} completed twice in one pass")
            self._missing.discard(key)
            if not self._missing:
                self._cond.notify_all()

    def arrived(self, key: Hashable) -> bool:
        with self._cond:
            return key not in self._missing

    def fail(self, key: Hashable, cause: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                if isinstance(cause, SyncError):
                    error = SyncError(str(cause))
                else:
                    error = SyncError(f"sync of {self._describe(key)} failed: {type(cause).__name__}: {cause}")
                error.__cause__ = cause
                self._failure = error
            self._cond.notify_all()

    def wait(self, timeout: float, key: Hashable | None = None) -> None:
        """Until every expected job arrived, or only job ``key`` when given."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failure is None and (key in self._missing if key is not None else self._missing):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted(self._describe(k) for k in self._missing)
                    self._failure = SyncTimeout(
                        f"BSP barrier timed out after {timeout:.1f}s waiting for {len(names)} sync job(s): "
                        f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''} "
                        "(a peer died, hung, or skipped this backward)")
                    break
                self._cond.wait(left)
            if self._failure is not None:
                raise self._failure
