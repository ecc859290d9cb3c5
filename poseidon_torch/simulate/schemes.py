"""Communication schemes as the simulator sees them: which sync jobs an iteration has, when each is ready,
what it costs. The timeline (:mod:`.timeline`) is the same for all of them.

- ``ddp``: torch DDP: buckets of neighbouring layers in backward order, the first up to 1 MiB, the
  others up to 25 MiB (a bucket closes once it reaches its cap), each a ring all-reduce once its last
  layer's gradient is ready;
- ``ps``: a plain parameter server: every layer synced on the PS path after backward (no overlap);
- ``wfbp``: our PS path per bucket as soon as the bucket is ready (the traced run's buckets, one per
  layer for a profile without them);
- ``poseidon``: WFBP plus the coordinator's per-layer choice at that number of machines: a layer for
  which a path chosen by cost (``Path.by_cost``, e.g. SFB for an FC layer) is predicted to sync faster
  than the default path is a job of its own (as the engine gives it a bucket of its own), and takes the
  candidate that shortens the predicted iteration most, the default path where none does
  (:func:`~.timeline.fastest`, as the coordinator chooses: a sync hidden under the backward stays on the
  default path). SFB's cost grows with the machines, PS's does not; its link part uses the link, its
  compute part (SFB's rebuild GEMM) the compute lane (it runs on the same cores or GPU as the backward);
- ``poseidon+powersgd``, ``poseidon+int8``, ``poseidon+bf16``, ``poseidon+fp16``:
  ``PoseidonDDP(compression=...)`` with the path's default settings (PowerSGD: rank 4): the same choice
  with that lossy path among the candidates, costed as the coordinator costs it (its bytes, and its
  compression compute at the profile's memory bandwidth, on the compute lane), a layer going on it only
  where that shortens the predicted iteration (:func:`~.timeline.fastest`); without a memory bandwidth
  in the profile no lossy path can be costed and the scheme is ``poseidon``. PowerSGD reads each
  tensor's shape: a layer whose profile holds none is one flat tensor to it, which it does not compress;
- ``<scheme>+delay``: Pipe-SGD (``delay >= 1``): the same jobs, overlapping the next iteration.

Costs come from the registered paths' own predictions (``Path.predict``: the bytes our paths send and
the link's alpha-beta time, which the coordinator chooses with), so the simulator predicts what the
engine would choose and send. torch DDP's ring all-reduce
sends 2(P-1)/P of the bucket in 2(P-1) steps.
"""
from __future__ import annotations

from ..bucket import flat_numel
from ..link import LinkModel
from ..paths import BucketCost, FCCost, Paths, Prediction, compression_options
from .profile import LayerProfile, Profile
from .timeline import Job, Timeline, bsp, fastest, pipelined

DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20
ALL_REDUCE = "all-reduce"
#: the registered paths, to predict with
PATHS = Paths.for_costing()


class Scheme:
    """The jobs of one iteration at ``hosts`` machines (none on one machine), timed under BSP (or
    pipelined: ``jobs`` is told, for a scheme that chooses its paths by the iteration's time)."""

    name = ""
    pipelined = False

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        raise NotImplementedError

    def run(self, profile: Profile, hosts: int, link: LinkModel, slowdown: float = 1.0) -> Timeline:
        jobs = self.jobs(profile, hosts, link, self.pipelined) if hosts > 1 else []
        return (pipelined if self.pipelined else bsp)(profile, jobs, slowdown)


class TorchDDP(Scheme):
    name = "ddp"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        jobs, bucket, size, cap = [], [], 0, DDP_FIRST_BUCKET_BYTES
        for index, layer in enumerate(profile.layers):
            bucket.append(layer.name)
            size += layer.nbytes
            if size >= cap or index == len(profile.layers) - 1:
                sent = 2.0 * (hosts - 1) / hosts * size
                jobs.append(Job("+".join(bucket), index, link.seconds(sent, 2 * (hosts - 1)), sent, ALL_REDUCE))
                bucket, size, cap = [], 0, DDP_BUCKET_BYTES
        return jobs


class PlainPS(Scheme):
    name = "ps"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        last = len(profile.layers) - 1
        return [_ps_job([layer], last, hosts, profile.element_size, link) for layer in profile.layers]


class WFBP(Scheme):
    name = "wfbp"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        index = {layer.name: i for i, layer in enumerate(profile.layers)}
        return [_ps_job(group, index[group[-1].name], hosts, profile.element_size, link) for group in profile.groups()]


class Poseidon(Scheme):
    """The coordinator's choice; ``compression``: the lossy path ``compression=`` names (its option, e.g.
    ``"int8"``), or None. A layer some path chosen by cost syncs faster than the default path is a job of
    its own (as the engine gives it a bucket of its own), on the candidate (exact or lossy) that shortens
    the predicted iteration, or on the default path where none does (:func:`~.timeline.fastest`, as the
    coordinator chooses); the rest of its traced bucket is one job on the default path."""

    def __init__(self, compression: str | None = None) -> None:
        self.name = "poseidon" if compression is None else f"poseidon+{compression}"
        self.lossy = () if compression is None else (compression_options()[compression].name,)

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        index = {layer.name: i for i, layer in enumerate(profile.layers)}
        options: list[list[Job]] = []
        for group in profile.groups():
            rest = []
            for layer in group:
                cheaper = self.cheaper_paths(layer, profile, hosts, link, self.lossy)
                if not cheaper:
                    rest.append(layer)
                    continue
                after = index[layer.name]
                options.append([_ps_job([layer], after, hosts, profile.element_size, link),
                                *(Job(layer.name, after, predicted.seconds - predicted.compute_s, predicted.bytes,
                                      path, predicted.compute_s, lossy=not PATHS[path].exact)
                                  for path, predicted in cheaper)])
            if rest:
                options.append([_ps_job(rest, index[rest[-1].name], hosts, profile.element_size, link)])
        options.sort(key=lambda jobs: jobs[0].after)
        return fastest(profile, options, pipelined_steps)

    @staticmethod
    def cheaper_paths(layer: LayerProfile, profile: Profile, hosts: int, link: LinkModel,
                      lossy: tuple[str, ...] = ()) -> list[tuple[str, Prediction]]:
        """The paths the coordinator could choose for the layer alone by cost (the exact paths chosen by
        cost and the ``lossy`` ones) whose sync is predicted faster than the default path's, fastest first,
        with their predictions."""
        fc = FCCost(layer.fc.m, layer.fc.n, layer.fc.k, profile.element_size) if layer.fc is not None else None
        elements = layer.nbytes // profile.element_size
        nbytes = flat_numel(elements, layer.tensors) * profile.element_size  # its bucket's, flags included
        cost = BucketCost(nbytes, layer.nbytes, fc, layer.shapes or ((elements,),), profile.element_size)
        rates = (profile.gemm_flops, profile.memory_bps)
        default = PATHS.default.predict(cost, hosts, link, *rates).seconds
        cheaper = []
        for path in PATHS.values():
            takes = path.by_cost and (path.exact or path.name in lossy)
            predicted = path.predict(cost, hosts, link, *rates) if takes else None
            if predicted is not None and predicted.seconds < default:
                cheaper.append((path.name, predicted))
        return sorted(cheaper, key=lambda chosen: chosen[1].seconds)


class Delayed(Scheme):
    """Pipe-SGD over another scheme's jobs."""

    pipelined = True

    def __init__(self, base: Scheme) -> None:
        self.base, self.name = base, f"{base.name}+delay"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel, pipelined_steps: bool = False) -> list[Job]:
        return self.base.jobs(profile, hosts, link, pipelined_steps=True)


def _ps_job(layers: list[LayerProfile], after: int, hosts: int, element_size: int, link: LinkModel) -> Job:
    """One sync of ``layers`` as one bucket on the default path: its flat buffer, gradients and flags."""
    numel = flat_numel(sum(layer.nbytes for layer in layers) // element_size, sum(layer.tensors for layer in layers))
    nbytes = numel * element_size
    predicted = PATHS.default.predict(BucketCost(nbytes, nbytes), hosts, link, None)
    return Job("+".join(layer.name for layer in layers), after, predicted.seconds, predicted.bytes, PATHS.default.name)


#: the lossy paths a scheme may name
COMPRESSIONS = ("powersgd", "int8", "bf16", "fp16")
SCHEMES: dict[str, Scheme] = {scheme.name: scheme for scheme in (
    TorchDDP(), PlainPS(), WFBP(), Poseidon(), Delayed(WFBP()), Delayed(Poseidon()),
    *(Poseidon(option) for option in COMPRESSIONS), *(Delayed(Poseidon(option)) for option in COMPRESSIONS))}
