"""A benchmark resource that exists only inside a ``with`` block (an emulated cluster, CPU quotas).

Invariant: ``close()`` runs on exit, and also when ``_build()`` fails part way, so nothing built before
the failure is left behind; ``close()`` must be idempotent and undo only what was built.
"""
from __future__ import annotations

from typing import Self


class Scoped:
    """Set up by :meth:`_build` on entering, torn down by :meth:`close` on leaving."""

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
