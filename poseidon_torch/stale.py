"""The server threads of stale synchronous parallel (Bosen) and asynchronous SGD (Downpour): the shards
of the SSP mode (``modes/ssp.py``).

With ``ServerOptimizer(..., staleness=s)`` (s >= 1), or ``staleness=None`` (asynchronous), the shards no
longer aggregate exactly P pushes per step: each rank runs on its own *clock* (its count of synced
passes since the last ``finish()``).
- The job of a bucket at clock c pushes each chunk to its owner, point to point on two gloo backends of
  this mode's own (one per direction, as the sync channels); each owner's :class:`StaleServer` threads
  receive from *any* source (gloo matches a send with a receive by order, so a receive from one named
  peer would serve the ranks in a fixed order: the measured alternative, torch's RPC, was no faster,
  ``benchmarks/async_transport.py``).
- The owner applies each push at once: one step of the user's optimizer on that chunk's pieces with the
  pushed gradient divided by P (with plain SGD the P pushes of a clock move the parameters as one BSP
  step on their average; adaptive optimizers take P steps per clock, see the README).
- It answers with the chunk's values once they hold every rank's pushes of clocks <= c - s (what the
  rank's forward at clock c+1 may read under SSP: it is then at most s clocks ahead of the slowest); a
  rank that called ``finish()`` no longer holds anyone back. ``staleness=None`` answers at once.
- Asynchronous mode only, Downpour's n_push and n_fetch (``push_every``, ``fetch_every``): a rank sums
  its gradients over ``push_every`` passes and pushes the sum once (the passes in between send
  nothing), and takes new values every ``fetch_every`` passes (between fetches its forwards read the
  values of the last one); ``finish()`` pushes what is still summed, so nothing is lost.
Invariants: the pushes of one rank to one chunk are applied in clock order, each exactly once (a chunk's
counter per rank checks it); a pass aborted on a rank still pushes its remaining buckets, empty, so
every chunk sees every clock; between ``finish()`` calls the owners' pieces hold the authoritative
values (the parameters hold what the rank last pulled), and ``finish()`` makes every rank's parameters
the owners' values (or, after the parameters were loaded, the owners' values the parameters).
"""
from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .barrier import SyncError
from .bucket import Bucket
from .paths.ps import Chunk, PSPath
from .pools import Backend, Collectives, make_backend
from .server import BucketShard, ServerSpec, export_shards, hyperparameters, pieces_of

HEADER, PAYLOAD, REPLY = 1, 2, 1000  #: message tags (a reply's tag adds the chunk's id)
#: what a header [kind, chunk id, push number, clock, answer?] announces (BEAT: still training)
PUSH, DONE, STOP, FETCH, BEAT = 0, 1, 2, 3, 4
#: the requests' backends never time out: their receives wait for whichever rank pushes next, however
#: long its compute takes (a gloo receive that times out closes the connection); the waits that can
#: fail (replies, the SSP bound) use the engine's timeout
_FOREVER = timedelta(days=3650)


@dataclass(eq=False)
class _Owned:
    """A chunk this rank owns: its pieces' optimizer, and how many pushes of each rank it applied."""

    bucket: Bucket
    chunk: Chunk
    shard: BucketShard
    applied: list[int]

    @property
    def payload_numel(self) -> int:
        return self.chunk.stop - self.chunk.start + len(self.bucket.params) + 1


@dataclass
class _Reply:
    rank: int
    cid: int
    values: Tensor


@dataclass
class _PassLog:
    """What the answers of this rank's current pass found."""

    staleness: int = 0


class StaleServer:
    """This rank's shards in SSP/asynchronous mode, its server threads, and its clock.

    The engine's view of a server (``begin_pass``, ``install``, ``export``, ``load``, ...) plus
    :meth:`exchange` (a bucket's job), :meth:`finish` (the end of a stretch of training, collective)."""

    def __init__(self, spec: ServerSpec, control: Collectives, staleness: int | None, timeout: float,
                 push_every: int = 1, fetch_every: int = 1, versions: dict[int, int] | None = None) -> None:
        self.spec, self.control, self.bound, self.timeout = spec, control, staleness, timeout
        self.passes = 0  #: passes begun (a state gathered before the last one is stale)
        self.push_every, self.fetch_every = push_every, fetch_every
        self.rank, self.size = control.rank, control.size
        prefix = control.broadcast_object(f"poseidon/{uuid.uuid4().hex}/stale/", 0)
        #: ``up`` carries messages from a lower to a higher rank, ``down`` the way back
        self.up = make_backend(prefix, "up", self.rank, self.size, "gloo", _FOREVER)
        self.down = make_backend(prefix, "down", self.rank, self.size, "gloo", _FOREVER)
        self.clock = -1  #: this rank's clock: the pass now open (-1: none since the last finish)
        self.pushes = -1  #: this rank's pushes since the last finish, less one (each chunk counts them)
        self.pushing = self.fetching = True  #: the open pass pushes / takes new values
        self._summed: dict[int, Tensor] = {}  #: id(bucket) -> gradients summed since its last push
        self.parameters_loaded = False  #: the parameters were loaded: the owners take them at finish()
        #: id(parameter) -> its version after this mode last wrote or took it: another version means the
        #: user wrote it in place (an edit the owners would silently overwrite); the first time, the
        #: versions the parameters had when the ServerOptimizer was built (a write since then is an edit)
        self._versions: dict[int, int] = {}
        self._first_versions = dict(versions or {})
        #: id(bucket) of the buckets whose values this rank's open pass still has to land (an edit of
        #: those is the engine's to refuse, when they land)
        self._landing: set[int] = set()
        self.failure: SyncError | None = None
        self.shards: dict[int, BucketShard] = {}
        self._cond = threading.Condition()
        self._owned: dict[int, _Owned] = {}
        self._cids: dict[int, list[tuple[int, Chunk]]] = {}  #: id(bucket) -> (chunk id, chunk)
        self._done = [False] * self.size
        self._dead: set[int] = set()  #: requesters an answer could not reach
        self._heard = [time.monotonic()] * self.size  #: when each rank's last message arrived
        self._sent_at: dict[int, float] = defaultdict(float)  #: when this rank last sent each peer a message
        self._waiting: list[tuple[int, int, int]] = []  #: (rank, chunk id, clock) answers due later
        self._send_locks = defaultdict(threading.Lock)
        self._log = _PassLog()
        self._buckets: list[Bucket] = []
        self._loaded = False
        self._threads = [threading.Thread(target=self._serve, args=(backend, senders), daemon=True,
                                          name=f"poseidon-stale-{name}")
                         for name, backend, senders in (("up", self.up, list(range(self.rank))),
                                                        ("down", self.down, list(range(self.rank + 1, self.size))))
                         if senders]
        for thread in self._threads:
            thread.start()

    # ---- the engine's view of a server ----------------------------------------------------------

    def install(self, buckets: list[Bucket], ps: PSPath, rank: int) -> None:
        """Chunk ids over ``buckets`` (the same on every rank) and a shard per chunk this rank owns,
        its pieces starting from the parameters (collective, between passes, no push in flight)."""
        key_of = self.spec.key_of
        if self._summed:
            raise RuntimeError("the buckets changed while summed gradients wait for their push (push_every)")
        cid = 0
        self._cids, self._owned, self.shards, self._buckets = {}, {}, {}, list(buckets)
        for bucket in buckets:
            self._cids[id(bucket)] = []
            for chunk in ps.chunks_of(bucket):
                self._cids[id(bucket)].append((cid, chunk))
                if chunk.owner == rank:
                    shard = BucketShard(pieces_of(bucket, [chunk], key_of), self.spec)
                    self._owned[cid] = _Owned(bucket, chunk, shard, [0] * self.size)
                    self.shards[cid] = shard
                cid += 1
        self._take_parameters()
        self._versions.update(self._first_versions)
        self._first_versions = {}
        self.control.barrier()  # every owner ready before any rank pushes (installs are collective)

    def refuse_if_loaded(self) -> None:
        """A forward that may train must not run on loaded or edited parameters the owners have not taken
        yet (the owners' values would silently replace them)."""
        edited = self.edited()
        if edited:  # finish() finds them by their versions, as this check does
            raise RuntimeError(f"parameter {edited[0]!r} was written in place while the ServerOptimizer runs with "
                               "staleness (the owners hold the values and would overwrite it): call opt.finish() on "
                               "every rank after writing parameters, so the servers take the written values")
        if self.parameters_loaded:
            raise RuntimeError("the parameters were loaded while the ServerOptimizer runs with staleness: call "
                               "opt.finish() (or opt.load_state_dict) on every rank before training on, so the "
                               "servers take the loaded values")

    def own_versions(self, buckets: list[Bucket]) -> None:
        """This mode wrote (or took) the parameters of ``buckets``: their present versions are its own."""
        for bucket in buckets:
            self._versions.update((id(p), p._version) for p in bucket.params)
            self._landing.discard(id(bucket))

    def edited(self) -> list[str]:
        """The names of the parameters written since this mode last wrote or took them (of the buckets
        whose values have landed)."""
        return [name for bucket in self._buckets if id(bucket) not in self._landing
                for name, p in zip(bucket.param_names, bucket.params) if self._versions.get(id(p)) != p._version]

    def begin_pass(self) -> None:
        self._reassure_the_finished()
        self.clock += 1
        self.pushing = (self.clock + 1) % self.push_every == 0
        self.fetching = (self.clock + 1) % self.fetch_every == 0
        self.pushes += self.pushing
        if self.fetching:
            self._landing = {id(bucket) for bucket in self._buckets}
        # without a fetch the next forward reads the same values as this one: one clock staler
        self._log = _PassLog() if self.fetching else _PassLog(self._log.staleness + 1)
        self.passes += 1  # this pass's pushes change the state

    def _reassure_the_finished(self) -> None:
        """A rank waiting in ``finish()`` hears from this one at least every timeout / 4 while it trains
        on: it may own none of this rank's chunks, or this rank may push and fetch rarely
        (``push_every``), so pushes alone cannot tell it that this rank is alive."""
        now = time.monotonic()
        with self._cond:
            waiting = [peer for peer, done in enumerate(self._done) if done and peer != self.rank]
        for peer in waiting:
            if now - self._sent_at[peer] > self.timeout / 4:
                self._send(peer, self._header(BEAT, 0, False))

    def pushed(self) -> None:
        pass

    def facts_known(self, aborted: bool) -> None:
        pass

    def roll_back(self) -> None:
        pass  # the buckets pushed before a raise stay applied (README); the rest were pushed empty

    #: the answers of a pass aborted on this rank are still the owners' newest values, which the next
    #: forward must read (the bound was checked for them)
    keeps_aborted_values = True

    def export(self) -> dict:
        with self._cond:
            return export_shards(self.shards.values())

    def state_bytes(self) -> int:
        return sum(shard.state_bytes() for shard in self.shards.values())

    def has_state(self) -> bool:
        return self._loaded or any(shard.inner is not None and shard.inner.state for shard in self.shards.values())

    def load(self, full_state: dict | None) -> None:
        """Each owned piece's part of a torch-format state (collective: no rank pushes before every
        owner loaded)."""
        if full_state:
            with self._cond:
                for shard in self.shards.values():
                    shard.load(full_state)
            self._loaded = True
        self.control.barrier()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server threads: each listens to the ranks on one side, and the neighbour on that
        side stops it (so every thread gets one STOP); waits at most ``timeout`` for both."""
        header = torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64)
        for peer in (self.rank - 1, self.rank + 1):
            if 0 <= peer < self.size:
                with contextlib.suppress(RuntimeError):
                    self._backend_to(peer).send([header], peer, HEADER).wait(timedelta(seconds=timeout))
        for thread in self._threads:
            thread.join(timeout)

    # ---- a bucket's job ------------------------------------------------------------------------------

    def exchange(self, bucket: Bucket) -> int:
        """Push this rank's staged gradients of ``bucket`` (flat buffer; summed first with ``push_every``)
        at its clock and put the values the owners answer into the flat buffer (in a pass that fetches);
        returns the bytes sent (channel thread)."""
        outgoing = self._outgoing(bucket)
        # the answers' receives are posted before any push: an owner's answer must not wait on this rank
        # (its server thread would stall while this rank still pushes to it)
        answers = self._post_answers(bucket) if self.fetching else []
        sent = 0
        if outgoing is not None:
            sent = self._push_bucket(bucket, outgoing, answer=self.fetching)
        elif self.fetching:
            for cid, chunk, _, _ in answers:
                self._send(chunk.owner, self._header(FETCH, cid, True))
        if self.fetching:
            self._take_answers(bucket, answers)
        bucket.used_anywhere.fill_(1)
        return sent

    def _outgoing(self, bucket: Bucket) -> Tensor | None:
        """The buffer this pass pushes for ``bucket``: its own (``push_every`` = 1), the sum of the passes
        since the last push when this pass pushes, None when it does not (the sum grows)."""
        if self.push_every == 1:
            return bucket.flat
        summed = self._summed.get(id(bucket))
        if summed is None:  # nothing summed yet: an empty push unless a pass adds to it
            summed = self._summed[id(bucket)] = empty_push(bucket)
        if not bucket.flat[-1] > 0:  # the pass was not aborted on this rank
            summed[:bucket.grad_numel] += bucket.flat[:bucket.grad_numel]
            torch.maximum(summed[bucket.grad_numel:-1], bucket.flat[bucket.grad_numel:-1],
                          out=summed[bucket.grad_numel:-1])
            summed[-1] = 0
        return self._summed.pop(id(bucket)) if self.pushing else None

    def _push_bucket(self, bucket: Bucket, flat: Tensor, answer: bool) -> int:
        """Push every chunk of ``flat`` (``bucket``'s layout) as push number ``self.pushes``; the remote
        owners answer it when ``answer``; returns the bytes sent."""
        flags, sent = flat[bucket.grad_numel:], 0
        for cid, chunk in self._cids[id(bucket)]:
            payload = torch.cat([flat[chunk.start:chunk.stop], flags])
            if chunk.owner == self.rank:
                self._send_replies(self._apply(cid, self.rank, self.pushes, self.clock, payload, answer=False))
            else:
                self._send(chunk.owner, self._header(PUSH, cid, answer), payload)
                sent += payload_bytes(bucket, chunk)
        return sent

    def _header(self, kind: int, cid: int, answer: bool) -> Tensor:
        return torch.tensor([kind, cid, self.pushes, self.clock, int(answer)], dtype=torch.int64)

    def _post_answers(self, bucket: Bucket) -> list[tuple[int, Chunk, Tensor, Any]]:
        """A receive for the answer of every remote chunk of ``bucket``: (chunk id, chunk, buffer, work)."""
        posted = []
        for cid, chunk in self._cids[id(bucket)]:
            if chunk.owner != self.rank:
                reply = torch.empty(chunk.stop - chunk.start + 1, dtype=reply_dtype(bucket.flat.dtype))
                try:
                    work = self._backend_to(self.rank, chunk.owner).recv([reply], chunk.owner, REPLY + cid)
                except RuntimeError as exc:  # the connection is already closed: the owner died
                    raise self._unreachable(chunk.owner, exc) from None
                posted.append((cid, chunk, reply, work))
        return posted

    def _take_answers(self, bucket: Bucket, answers: list[tuple[int, Chunk, Tensor, Any]]) -> None:
        """The owners' values of every chunk of ``bucket`` into its flat buffer: this rank's own chunks
        once the bound allows, the remote ones as ``answers`` arrive."""
        for cid, chunk in self._cids[id(bucket)]:
            if chunk.owner == self.rank:
                self._take(bucket, chunk, self._wait_own(cid, self.clock))
        for cid, chunk, reply, work in answers:
            try:
                work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                raise SyncError(self._stall(chunk.owner, self.clock, exc)) from None
            self._take(bucket, chunk, reply)

    def _take(self, bucket: Bucket, chunk: Chunk, values: Tensor) -> None:
        bucket.flat[chunk.start:chunk.stop].copy_(values[:-1])
        with self._cond:
            self._log.staleness = max(self._log.staleness, int(values[-1]))

    def _send(self, peer: int, header: Tensor, payload: Tensor | None = None) -> None:
        """A header (and its payload: they stay together on the connection) to ``peer``'s server."""
        backend = self._backend_to(peer)
        try:
            with self._send_locks[peer]:
                backend.send([header], peer, HEADER).wait(timedelta(seconds=self.timeout))
                if payload is not None:
                    backend.send([payload], peer, PAYLOAD).wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._unreachable(peer, exc) from None
        self._sent_at[peer] = time.monotonic()

    def _unreachable(self, peer: int, exc: Exception) -> SyncError:
        return SyncError(f"staleness={self.bound}: rank {self.rank} could not reach rank {peer}'s server (dead?): {exc}")

    def _backend_to(self, peer: int, sender: int | None = None) -> Backend:
        """The backend of messages from ``sender`` (default: this rank) to ``peer``."""
        sender = self.rank if sender is None else sender
        return self.up if sender < peer else self.down

    def _wait_own(self, cid: int, clock: int) -> Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: self.failure is not None or self._ready(cid, clock), self.timeout):
                raise SyncError(self._stall(self.rank, clock, None))
            if self.failure is not None:
                raise self.failure
            return self._values(cid, clock)

    def _stall(self, owner: int, clock: int, exc: Exception | None) -> str:
        behind = self._behind(clock)
        who = f"; rank(s) {behind} never pushed clock {clock - (self.bound or 0)} here" if behind else ""
        why = f" ({exc})" if exc is not None else ""
        return (f"staleness={self.bound}: rank {self.rank} waited {self.timeout:.0f}s at clock {clock} for the values of "
                f"rank {owner}'s chunks{who}: a dead or stalled peer{why}")

    def diagnosis(self) -> str:
        """The ranks that hold this rank's open clock back at the chunks it owns ("" if none, or without
        a bound)."""
        behind = self._behind(self.clock) if self.bound is not None else []
        return (f"staleness={self.bound}: rank(s) {behind} never pushed clock {self.clock - self.bound} to rank "
                f"{self.rank}'s chunks: dead or stalled" if behind else "")

    def _behind(self, clock: int) -> list[int]:
        with self._cond:
            needed = clock + 1 - (self.bound or 0)
            return sorted(self._dead | {r for owned in self._owned.values() for r in range(self.size)
                                        if owned.applied[r] < needed and not self._done[r]})

    # ---- the owner's side --------------------------------------------------------------------------

    def _serve(self, backend: Backend, senders: list[int]) -> None:
        """Receive from any source (``senders``, the ranks on ``backend``'s side): pushes (applied at once),
        fetches, DONE notices, STOP."""
        header = torch.empty(5, dtype=torch.int64)
        try:
            while True:
                work = backend.recv_anysource([header], HEADER)
                work.wait()
                source = work._source_rank()
                kind, cid, number, clock, answer = header.tolist()
                if kind == STOP:
                    return
                if kind == DONE:
                    with self._cond:
                        self._done[source] = True
                        self._heard[source] = time.monotonic()
                        replies = self._due()
                        self._cond.notify_all()
                    self._send_replies(replies)
                    continue
                if kind == FETCH:
                    self._send_replies(self._answer_later(cid, source, clock))
                    continue
                if kind == BEAT:
                    with self._cond:
                        self._heard[source] = time.monotonic()
                    continue
                owned = self._owned[cid]
                payload = torch.empty(owned.payload_numel, dtype=owned.bucket.flat.dtype)
                backend.recv([payload], source, PAYLOAD).wait()
                self._send_replies(self._apply(cid, source, number, clock, payload, bool(answer)))
        except Exception as exc:  # noqa: BLE001 - any failure ends the mode with a clear error
            with self._cond:
                self.failure = SyncError(f"the parameter-server thread of rank {self.rank}, which receives from rank(s) "
                                         f"{senders}, failed (a peer that dies or leaves closes its connection): {exc!r}")
                self._cond.notify_all()

    def _apply(self, cid: int, source: int, number: int, clock: int, payload: Tensor, answer: bool) -> list[_Reply]:
        """Apply ``source``'s push number ``number`` of chunk ``cid``, sent at ``clock`` (answered when
        ``answer``); the answers now due."""
        owned = self._owned[cid]
        with self._cond:
            if owned.applied[source] != number:
                raise SyncError(f"rank {source} sent push {number} of chunk {cid}, rank {self.rank} expected push "
                                f"{owned.applied[source]} (a push lost or repeated)")
            flags = payload[owned.chunk.stop - owned.chunk.start:]
            if not flags[-1] > 0:  # not aborted
                self._step(owned, payload, flags)
            owned.applied[source] += 1
            self._done[source] = False
            self._heard[source] = time.monotonic()
            if answer:
                self._waiting.append((source, cid, clock))
            replies = self._due()
            self._cond.notify_all()
        return replies

    def _answer_later(self, cid: int, source: int, clock: int) -> list[_Reply]:
        """``source`` asks for chunk ``cid``'s values at ``clock`` without a push (``fetch_every``)."""
        with self._cond:
            self._heard[source] = time.monotonic()
            self._waiting.append((source, cid, clock))
            return self._due()

    def _step(self, owned: _Owned, payload: Tensor, flags: Tensor) -> None:
        shard, start = owned.shard, owned.chunk.start
        grads = [payload[piece.flat_start - start:piece.flat_start - start + piece.hi - piece.lo]
                 .view(piece.tensor.shape) / self.size if flags[piece.position] > 0 else None
                 for piece in shard.pieces]
        shard.apply(grads, [hyperparameters(g) for g in self.spec.param_groups])

    def _ready(self, cid: int, clock: int) -> bool:
        """The values of chunk ``cid`` may be read at clock ``clock`` + 1 (lock held)."""
        if self.bound is None:
            return True
        applied = self._owned[cid].applied
        return all(done or count >= clock + 1 - self.bound for count, done in zip(applied, self._done))

    def _values(self, cid: int, clock: int) -> Tensor:
        """Chunk ``cid``'s values, and how many clocks of the slowest rank they lack for a forward at
        ``clock`` + 1 (lock held)."""
        owned = self._owned[cid]
        out = torch.zeros(owned.chunk.stop - owned.chunk.start + 1, dtype=reply_dtype(owned.bucket.flat.dtype))
        for piece in owned.shard.pieces:
            offset = piece.flat_start - owned.chunk.start
            out[offset:offset + piece.hi - piece.lo].copy_(piece.tensor.reshape(-1))
        lagging = [count * self.push_every for count, done in zip(owned.applied, self._done) if not done]
        out[-1] = clock + 1 - min(lagging, default=clock + 1)
        return out

    def _due(self) -> list[_Reply]:
        """The remote answers the bound now allows (lock held); local waiters are woken instead."""
        due, waiting = [], []
        for rank, cid, clock in self._waiting:
            if rank == self.rank:
                continue
            if self._ready(cid, clock):
                due.append(_Reply(rank, cid, self._values(cid, clock)))
            else:
                waiting.append((rank, cid, clock))
        self._waiting = waiting
        return due

    def _send_replies(self, replies: list[_Reply]) -> None:
        """Send the answers due; a requester that cannot be reached (it died, or gave up waiting) is
        marked dead and named by the waits it stalls, and the other peers are served on."""
        for reply in replies:
            if reply.rank in self._dead:
                continue
            try:
                self._backend_to(reply.rank).send([reply.values], reply.rank, REPLY + reply.cid).wait(
                    timedelta(seconds=self.timeout))
            except RuntimeError:
                with self._cond:
                    self._dead.add(reply.rank)
                    self._cond.notify_all()

    # ---- the end of a stretch of training ---------------------------------------------------------

    def finish(self) -> None:
        """Collective, after this rank's last pass settled: tell every owner this rank is done (it no
        longer holds the bound back), wait for every rank, make the parameters the owners' values (or,
        after a load, the owners' values the parameters) and start the clocks again."""
        self._push_summed()
        for peer in range(self.size):
            if peer != self.rank:
                self._send(peer, self._header(DONE, 0, False))
        with self._cond:
            self._done[self.rank] = True
            replies = self._due()
        self._send_replies(replies)
        self._wait_for_everyone()
        try:
            alone = self._settle()
        except RuntimeError as exc:
            raise SyncError(f"staleness={self.bound}: finish() on rank {self.rank}: every rank said it was done, "
                            f"but the collective that settles the values failed ({exc}): a peer left finish() with an "
                            "error (see its own) or died") from None
        if alone:
            raise RuntimeError(f"opt.finish(): rank(s) {alone} loaded or wrote parameters and the other ranks did not; "
                               "each owner took its own rank's values, so every rank now holds that mix: load or write "
                               "the same values on every rank, then call opt.finish() again")

    def _settle(self) -> list[int]:
        """Collective: every rank's parameters the owners' values (or, after a load, the other way round);
        the clocks start again. Returns the ranks that loaded or wrote parameters when some others did
        not (the owners then took a mix)."""
        # one rank loaded: the same collectives everywhere
        loaded = self.control.all_gather_objects(self.parameters_loaded or bool(self.edited()))
        if any(loaded):
            self._take_parameters()
        self._give_parameters()  # after a load too: ranks that loaded and ranks that did not end up the same
        with self._cond:
            for owned in self._owned.values():
                owned.applied = [0] * self.size
            self._done = [False] * self.size
            self._heard = [time.monotonic()] * self.size
            self._waiting = []
        self.clock = self.pushes = -1
        self.control.barrier()  # nobody pushes before every owner started its clocks again
        return [rank for rank, flag in enumerate(loaded) if flag] if any(loaded) and not all(loaded) else []

    def _push_summed(self) -> None:
        """The gradients still summed since the last push (``push_every``) go as one more push of every
        bucket, unanswered (empty for a bucket that summed nothing, so every chunk counts it)."""
        if not self._summed:
            return
        self.pushes += 1
        for bucket in self._buckets:
            summed = self._summed.pop(id(bucket), None)
            self._push_bucket(bucket, empty_push(bucket) if summed is None else summed, answer=False)

    def _wait_for_everyone(self) -> None:
        """Until every rank sent its DONE (after its last push was answered, so applied): as long as
        the ranks still missing are heard from (their pushes, or the beats they send a rank they know
        waits, however long their data lasts); one silent for the timeout since this rank began to
        wait, dead or stalled, is named."""
        with self._cond:
            began = time.monotonic()  # the others learn only now (DONE) that this rank listens for them
            self._heard = [max(heard, began) for heard in self._heard]
            while not all(self._done) and self.failure is None:
                now = time.monotonic()
                silent = [r for r, done in enumerate(self._done) if not done and now - self._heard[r] > self.timeout]
                if silent or self._dead:
                    raise SyncError(f"staleness={self.bound}: finish() on rank {self.rank}: rank(s) "
                                    f"{sorted(set(silent) | self._dead)} neither pushed nor finished for "
                                    f"{self.timeout:.0f}s (dead, stalled, or not calling finish())")
                self._cond.wait(min(self.timeout, 1.0))
            if self.failure is not None:
                raise self.failure

    def _take_parameters(self) -> None:
        """The owned pieces start from the parameters."""
        with self._cond:
            for shard in self.shards.values():
                for piece in shard.pieces:
                    piece.tensor.copy_(piece.live())
        self.parameters_loaded = False
        self.own_versions(self._buckets)

    def _give_parameters(self) -> None:
        """Every rank's parameters become the owners' values (each element is owned by one rank: a sum
        over the ranks of the owned values, zeros elsewhere, is exact)."""
        for bucket in self._buckets:  # every bucket on every rank: a collective each
            values = torch.zeros(bucket.grad_numel, dtype=bucket.flat.dtype)
            for cid, _ in self._cids[id(bucket)]:
                if cid in self._owned:
                    for piece in self._owned[cid].shard.pieces:
                        values[piece.flat_start:piece.flat_start + piece.hi - piece.lo].copy_(piece.tensor.reshape(-1))
            self.control.all_reduce(values)
            with torch.no_grad():
                for p, value in bucket.views(values):
                    p.copy_(value)
            self.own_versions([bucket])

    def pass_staleness(self) -> int:
        """The most clocks of the slowest rank missing from the values this rank's last pass read."""
        return self._log.staleness


def reply_dtype(dtype: torch.dtype) -> torch.dtype:
    """An answer's dtype: the values' own, widened to fp32 for 16-bit ones (exact both ways), so that its
    staleness trailer is an exact integer up to 2**24."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def empty_push(bucket: Bucket) -> Tensor:
    """A flat buffer that pushes nothing: no gradient flag set, the aborted flag set (the owner counts
    the push and applies nothing)."""
    flat = torch.zeros_like(bucket.flat)
    flat[-1] = 1
    return flat


def payload_bytes(bucket: Bucket, chunk: Chunk) -> int:
    return (chunk.stop - chunk.start + len(bucket.params) + 1) * bucket.flat.element_size()
