"""What one rank handed to torch.distributed for gradient sync (``PoseidonDDP.comm_stats``), by bucket and
by registered path.

Invariant: an iteration's bytes are the sum over its buckets of what each bucket's last job sent, under
the path that job ran (a fallback counts under the path the bucket was on), plus what late gradients'
second sync sent on the default path, plus the end-of-pass facts exchange (``"facts"``).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .bucket import Bucket


@dataclass
class CommStats:
    """Bytes this rank handed to torch.distributed for gradient sync, and sync jobs run."""

    bytes_sent_last_iteration: int = 0
    bytes_sent_total: int = 0
    iterations: int = 0
    jobs_last_iteration: int = 0
    bytes_by_bucket: dict[str, int] = field(default_factory=dict)
    bytes_by_path: dict[str, int] = field(default_factory=dict)  #: last iteration; "facts" = the exchange
    #: last iteration: the path each bucket took (a path's name, or its fallback, e.g. "SFB->PS")
    outcome_by_bucket: dict[str, str] = field(default_factory=dict)

    def record(self, buckets: Sequence[Bucket], paths: Sequence[str], registered: Iterable[str], default: str,
               late: Sequence[Bucket], facts_bytes: int) -> None:
        """One closed pass: ``paths[i]`` is the path bucket i was on; ``late`` were synced again on ``default``."""
        by_path = {**dict.fromkeys(registered, 0), "facts": facts_bytes}
        for bucket, path in zip(buckets, paths):
            by_path[path] += bucket.bytes_sent
        for bucket in late:  # synced again on the default path: what that job sent
            by_path[default] += bucket.bytes_sent
        total = sum(by_path.values())
        self.bytes_sent_last_iteration = total
        self.bytes_sent_total += total
        self.iterations += 1
        self.jobs_last_iteration = len(buckets) + len(late)
        self.bytes_by_bucket = {b.name: b.bytes_sent for b in buckets}
        self.bytes_by_path = by_path
        self.outcome_by_bucket = {b.name: b.outcome for b in buckets}
