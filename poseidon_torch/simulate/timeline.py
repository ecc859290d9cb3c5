"""The timeline of one iteration on one machine: compute on one lane, sync jobs one at a time on the link.

The model is the same for every scheme; a scheme only says which jobs exist, after which layer's
backward each becomes ready, and what it costs (:mod:`.schemes`):

- the forward, then each layer's backward in profile order, back to back on the compute lane;
- a job is ready when the layer it waits for has finished its backward; jobs use the link one at a
  time in the order they became ready (one NIC: concurrent channels share its bandwidth, so the last
  job ends when it would in this order); a job's compute (SFB's rebuild) then queues on the compute
  lane, before the next layer's backward (the lane runs one piece of work at a time, in the order
  they became available);
- with a slowdown factor s >= 1, compute runs s times slower while the link is busy (communication's
  interference with compute: memory copies, CPU time of the transport; measured, not derived);
- BSP: the iteration ends when backward and every job have ended, then ``other_s`` (the optimizer step);
- pipelined (Pipe-SGD, delay >= 1): the sync of step t runs during step t+1, so in steady state an
  iteration lasts max(communication, compute), compute stretched by s while the two overlap.

:func:`fastest` chooses, per bucket, among the jobs its candidate paths would run, the plan whose
iteration is shortest in this model (a plan with a lossy job only where it is ``LOSSY_MIN_GAIN`` shorter
than the exact one): the coordinator plans with it (from the engine's measured readiness
times) and the simulator's ``poseidon`` schemes predict with it, so both decide with one model. The search
times a change to one bucket from that bucket's layer on, where the BSP timeline's state was kept, and
stops where the state meets the plan's again: the figures are the whole timeline's, to the bit.

Every machine is alike (no stragglers): under BSP the iteration of one machine is everyone's.
Invariants: ``iteration_s >= compute_s`` (no scheme is faster than no communication); jobs never
overlap on the link; a job never starts before it is ready.
"""
from __future__ import annotations

from bisect import insort
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral

from .profile import Profile

_TIE = 1e-12  #: relative: iterations closer than this are a tie (a tie keeps the default path)


@dataclass(frozen=True)
class Job:
    name: str
    after: int          #: index of the layer whose backward makes it ready
    seconds: float      #: its time on the link
    nbytes: float       #: bytes this machine sends
    path: str           #: "PS", "SFB" or "all-reduce"
    compute_s: float = 0.0  #: compute it needs once its link part ended (SFB's rebuild GEMM)
    lossy: bool = False     #: its path changes the arithmetic (a compressed path)


@dataclass(frozen=True)
class JobSpan:
    job: Job
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    iteration_s: float
    compute_s: float                #: the same iteration without communication
    backward_end_s: float
    spans: tuple[JobSpan, ...]

    @property
    def exposed_s(self) -> float:
        """What communication adds to the iteration (slowed compute included)."""
        return self.iteration_s - self.compute_s

    @property
    def nbytes(self) -> float:
        return sum(span.job.nbytes for span in self.spans)


def bsp(profile: Profile, jobs: Sequence[Job], slowdown: float = 1.0) -> Timeline:
    """One BSP iteration: jobs start when ready and the link is free; it ends when all have ended."""
    _check(profile, jobs, slowdown)
    ready = defaultdict(list)
    for job in jobs:
        ready[job.after].append(job)
    now, link_free, spans = profile.forward_s, 0.0, []
    rebuilds: deque[tuple[float, float]] = deque()  # (available at, seconds): in link order, so in time order

    def slowed(start: float, work: float) -> float:
        return advance(start, work, [(s.start_s, s.end_s) for s in spans], slowdown)

    # without a slowdown the spans need not be walked (fastest times many plans)
    compute = _unslowed if slowdown == 1.0 else slowed
    for index, layer in enumerate(profile.layers):
        now, link_free = _layer(now, link_free, rebuilds, layer.backward_s, ready[index], compute, spans)
    backward_end, end = _end(now, link_free, rebuilds, compute, profile.other_s)
    return Timeline(end, profile.compute_s, backward_end, tuple(spans))


def _layer(now: float, link_free: float, rebuilds: deque[tuple[float, float]], backward_s: float,
           jobs: Iterable[Job], compute: Callable[[float, float], float], spans: list[JobSpan] | None
           ) -> tuple[float, float]:
    """One layer of a BSP timeline: the compute lane runs the rebuilds available by ``now``, then the
    layer's backward; the link then takes the ``jobs`` it made ready, each job's compute queued on
    ``rebuilds`` (each span recorded in ``spans``). The compute lane's time and when the link is free."""
    while rebuilds and rebuilds[0][0] <= now:
        now = compute(now, rebuilds.popleft()[1])
    now = compute(now, backward_s)
    for job in jobs:
        start = max(now, link_free)
        link_free = start + job.seconds
        if spans is not None:
            spans.append(JobSpan(job, start, link_free))
        if job.compute_s:
            rebuilds.append((link_free, job.compute_s))
    return now, link_free


def _end(now: float, link_free: float, rebuilds: Iterable[tuple[float, float]],
         compute: Callable[[float, float], float], other_s: float) -> tuple[float, float]:
    """After the last layer: the end of the backward, and of the iteration (the rebuilds still queued,
    the link's last job, then ``other_s``)."""
    backward_end = now
    for available, work in rebuilds:
        now = compute(max(now, available), work)
    return backward_end, max(now, link_free) + other_s


def _unslowed(start: float, work: float) -> float:
    return start + work


def pipelined(profile: Profile, jobs: Sequence[Job], slowdown: float = 1.0) -> Timeline:
    """Steady state with the sync of step t overlapping step t+1: max(communication, compute), compute
    (the jobs' own included) slowed by s while communication runs beside it."""
    _check(profile, jobs, slowdown)
    work = profile.compute_s + sum(job.compute_s for job in jobs)
    comm = sum(job.seconds for job in jobs)
    period = comm if comm >= work * slowdown else work + comm * (1.0 - 1.0 / slowdown)
    spans, start = [], 0.0
    for job in jobs:  # laid out back to back from the start of the period
        spans.append(JobSpan(job, start, start + job.seconds))
        start += job.seconds
    return Timeline(period, profile.compute_s, work, tuple(spans))


#: a plan with a lossy job must be predicted at least this much shorter than the best exact plan (a fraction
#: of its iteration): a lossy path costs progress per step, which the time model does not see; on the
#: measured 1 Gbit/s cell a plan predicted 0.9% shorter compressed three layers and reached the target
#: later than the exact plan
LOSSY_MIN_GAIN = 0.05


def fastest(profile: Profile, options: Sequence[Sequence[Job]], pipelined_steps: bool = False,
            slowdown: float = 1.0, min_gain: float = LOSSY_MIN_GAIN) -> list[Job]:
    """One job per bucket: ``options[i]`` are bucket i's candidate jobs, its default path's first (exact).
    The plan of the candidates (:func:`_greedy`); where it holds a lossy job, that plan only if its iteration
    is at least ``min_gain`` (a fraction) shorter than the plan of the exact candidates alone, else that
    one. Invariants: the plan's iteration is never longer than the all-default one's; every bucket off its
    default shortens the plan's predicted iteration; a lossy job only in a plan ``min_gain`` shorter than
    any exact plan this search finds."""
    timeline: Callable[..., Timeline] = pipelined if pipelined_steps else bsp
    plan = _greedy(profile, options, timeline, slowdown)
    if not any(job.lossy for job in plan):
        return plan
    exact = _greedy(profile, [[job for job in jobs if not job.lossy] for jobs in options], timeline, slowdown)
    lossy_s, exact_s = (timeline(profile, jobs, slowdown).iteration_s for jobs in (plan, exact))
    return plan if lossy_s <= exact_s * (1.0 - min_gain) else exact


def _greedy(profile: Profile, options: Sequence[Sequence[Job]], timeline: Callable[..., Timeline],
            slowdown: float) -> list[Job]:
    """Start from every default, then, bucket by bucket in the order of the link time their best candidate
    saves, take the candidate that makes the iteration shortest, where it is shorter than the plan so far.
    A later bucket's choice can hide the sync an earlier one shortened, so then, until none is left, every
    bucket that would not lengthen the iteration back on its default goes back (ties keep the default: a
    sync hidden under compute gains nothing from a path that sends less but computes more)."""
    defaults = [jobs[0] for jobs in options]
    replayed = timeline is bsp and slowdown == 1.0
    plan = _Replay(profile, defaults) if replayed else _Whole(profile, defaults, timeline, slowdown)
    saving = [jobs[0].seconds - min(job.seconds for job in jobs) for jobs in options]
    for i in sorted(range(len(options)), key=lambda i: -saving[i]):
        for job in options[i][1:]:
            seconds = plan.iteration_with(i, job)
            if seconds < plan.iteration_s * (1.0 - _TIE):
                plan.take(i, job)
    went_back = True
    while went_back:
        went_back = False
        for i, jobs in enumerate(options):
            if plan.jobs[i] == jobs[0]:
                continue
            seconds = plan.iteration_with(i, jobs[0])
            if not plan.iteration_s < seconds * (1.0 - _TIE):
                plan.take(i, jobs[0])
                went_back = True
    return plan.jobs


class _Whole:
    """A plan under search, each change timed by its whole ``timeline``."""

    def __init__(self, profile: Profile, jobs: list[Job], timeline: Callable[..., Timeline], slowdown: float) -> None:
        self.profile, self.jobs, self.timeline, self.slowdown = profile, jobs, timeline, slowdown
        self.iteration_s = timeline(profile, jobs, slowdown).iteration_s

    def iteration_with(self, i: int, job: Job) -> float:
        """The iteration with bucket ``i`` on ``job`` instead."""
        return self.timeline(self.profile, [*self.jobs[:i], job, *self.jobs[i + 1:]], self.slowdown).iteration_s

    def take(self, i: int, job: Job) -> None:
        """Bucket ``i`` on ``job``, the plan's iteration timed again."""
        self.jobs[i] = job
        self.iteration_s = self.timeline(self.profile, self.jobs, self.slowdown).iteration_s


class _Replay:
    """A plan under search on the BSP timeline without slowdown, its state before each layer kept (the
    compute lane's time, when the link is free, the rebuilds queued: a slice of the plan's rebuilds in the
    order they were queued): a change to a bucket is timed from its job's layer on, and stops where the
    state meets the plan's again (the rest of the timeline is then the plan's). Every figure is the one
    :func:`bsp` gives, to the bit (the same operations in the same order)."""

    def __init__(self, profile: Profile, jobs: list[Job]) -> None:
        _check(profile, jobs, 1.0)
        self.profile, self.jobs = profile, jobs
        self.ready: list[list[int]] = [[] for _ in profile.layers]  #: per layer, the buckets it makes ready
        for i, job in enumerate(jobs):
            self.ready[job.after].append(i)
        self.ready_jobs = [[jobs[i] for i in buckets] for buckets in self.ready]  #: and their jobs in the plan
        #: before each layer: (compute lane's time, link free at, number of the first rebuild queued and of the next)
        self.states: list[tuple[float, float, int, int]] = [(profile.forward_s, 0.0, 0, 0)] * len(profile.layers)
        self.queued: list[tuple[float, float]] = []  #: the plan's rebuilds (available at, seconds), in queue order
        self.iteration_s = self._run(0, None)

    def iteration_with(self, i: int, job: Job) -> float:
        """The iteration with bucket ``i`` on ``job`` instead (a job after another layer: timed whole)."""
        if job.after != self.jobs[i].after:
            return bsp(self.profile, [*self.jobs[:i], job, *self.jobs[i + 1:]]).iteration_s
        return self._run(job.after, [job if b == i else self.jobs[b] for b in self.ready[job.after]])

    def take(self, i: int, job: Job) -> None:
        """Bucket ``i`` on ``job``, the plan timed again from the job's layer on, its states recorded."""
        before = self.jobs[i].after
        if job.after != before:
            self.ready[before].remove(i)
            insort(self.ready[job.after], i)
        self.jobs[i] = job
        for layer in {before, job.after}:
            self.ready_jobs[layer] = [self.jobs[b] for b in self.ready[layer]]
        self.iteration_s = self._run(min(before, job.after), None)

    def _run(self, start: int, changed: list[Job] | None) -> float:
        """The iteration from layer ``start`` on: with ``changed`` the jobs layer ``start`` makes ready
        (stopping where the state meets the plan's), or with the plan's, recording its states. The queue is
        numbered as the plan's: the n-th rebuild queued since ``start`` is the plan's next n-th, so the
        states meet where the compute lane, the link, the numbers of the queue's first and next rebuild
        match and no rebuild left in it differs from the plan's (a change that queues more or fewer
        rebuilds never meets: timed to the end, as right, only slower)."""
        now, link_free, first, pushed = self.states[start]
        rebuilds = deque(self.queued[first:pushed])
        record = changed is None
        if record:
            del self.queued[pushed:]
        unlike = -1  #: the number of the last rebuild queued that differs from the plan's
        layers, states, queued = self.profile.layers, self.states, self.queued
        for index in range(start, len(layers)):
            if index > start:
                head = pushed - len(rebuilds)
                if record:
                    states[index] = (now, link_free, head, pushed)
                else:
                    plan_now, plan_link_free, plan_head, plan_pushed = states[index]
                    if (now == plan_now and link_free == plan_link_free and head == plan_head
                            and pushed == plan_pushed and unlike < head):
                        return self.iteration_s
            jobs = changed if index == start and changed is not None else self.ready_jobs[index]
            now, link_free = _layer(now, link_free, rebuilds, layers[index].backward_s, jobs, _unslowed, None)
            queued_here = sum(1 for job in jobs if job.compute_s)  # this layer's rebuilds: the queue's last
            for n in range(queued_here, 0, -1):
                entry = rebuilds[-n]
                if record:
                    queued.append(entry)
                elif pushed >= len(queued) or queued[pushed] != entry:
                    unlike = pushed
                pushed += 1
        return _end(now, link_free, rebuilds, _unslowed, self.profile.other_s)[1]


def advance(now: float, work: float, busy: Sequence[tuple[float, float]], slowdown: float) -> float:
    """When ``work`` seconds of compute started at ``now`` end, running ``slowdown`` times slower inside
    the ``busy`` intervals (sorted, disjoint)."""
    for start, end in busy:
        if end <= now:
            continue
        if start > now:
            if work <= start - now:
                return now + work
            work -= start - now
            now = start
        if work * slowdown <= end - now:
            return now + work * slowdown
        work -= (end - now) / slowdown
        now = end
    return now + work


def _check(profile: Profile, jobs: Sequence[Job], slowdown: float) -> None:
    if not slowdown >= 1.0:
        raise ValueError(f"a slowdown factor is >= 1 (1: communication does not slow compute), got {slowdown}")
    for job in jobs:
        if not (isinstance(job.after, Integral) and 0 <= job.after < len(profile.layers)):
            raise ValueError(f"job {job.name!r} waits for layer {job.after!r}: a layer's index, and the profile has "
                             f"{len(profile.layers)}")
