"""Communication schemes as the simulator sees them: which sync jobs an iteration has, when each is ready,
what it costs. The timeline (:mod:`.timeline`) is the same for all of them.

- ``ddp``: torch DDP: buckets of neighbouring layers in backward order, the first up to 1 MiB, the
  others up to 25 MiB (a bucket closes once it reaches its cap), each a ring all-reduce once its last
  layer's gradient is ready;
- ``ps``: a plain parameter server: every layer synced on the PS path after backward (no overlap);
- ``wfbp``: our PS path per bucket as soon as the bucket is ready (the traced run's buckets, one per
  layer for a profile without them);
- ``poseidon``: WFBP plus the coordinator's per-layer choice at that number of machines: an FC layer
  whose SFB sync is predicted cheaper than its PS sync takes SFB as a job of its own (SFB's cost grows
  with the machines, PS's does not); its factor all-gather uses the link, its rebuild GEMM the
  compute lane (it runs on the same cores or GPU as the backward);
- ``<scheme>+delay``: Pipe-SGD (``delay >= 1``): the same jobs, overlapping the next iteration.

Costs come from the coordinator's own formulas (:func:`~poseidon_torch.coordinator.predict_ps`,
:func:`~poseidon_torch.coordinator.predict_sfb`: the bytes our paths send and the link's alpha-beta
time), so the simulator predicts what the engine would choose and send. torch DDP's ring all-reduce
sends 2(P-1)/P of the bucket in 2(P-1) steps.
"""
from __future__ import annotations

from ..bucket import flat_numel
from ..coordinator import PS, SFB, predict_ps, predict_sfb, sfb_rebuild_seconds
from ..link import LinkModel
from .profile import LayerProfile, Profile
from .timeline import Job, Timeline, bsp, pipelined

DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20
ALL_REDUCE = "all-reduce"


class Scheme:
    """The jobs of one iteration at ``hosts`` machines (none on one machine), timed under BSP."""

    name = ""
    pipelined = False

    def jobs(self, profile: Profile, hosts: int, link: LinkModel) -> list[Job]:
        raise NotImplementedError

    def run(self, profile: Profile, hosts: int, link: LinkModel, slowdown: float = 1.0) -> Timeline:
        jobs = self.jobs(profile, hosts, link) if hosts > 1 else []
        return (pipelined if self.pipelined else bsp)(profile, jobs, slowdown)


class TorchDDP(Scheme):
    name = "ddp"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel) -> list[Job]:
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

    def jobs(self, profile: Profile, hosts: int, link: LinkModel) -> list[Job]:
        last = len(profile.layers) - 1
        return [_ps_job([layer], last, hosts, profile.element_size, link) for layer in profile.layers]


class WFBP(Scheme):
    name = "wfbp"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel) -> list[Job]:
        index = {layer.name: i for i, layer in enumerate(profile.layers)}
        jobs = []
        for group in profile.groups():
            jobs += self._group_jobs(group, index, profile, hosts, link)
        return jobs

    def _group_jobs(self, group: list[LayerProfile], index: dict[str, int], profile: Profile, hosts: int,
                    link: LinkModel) -> list[Job]:
        return [_ps_job(group, index[group[-1].name], hosts, profile.element_size, link)]


class Poseidon(WFBP):
    name = "poseidon"

    def _group_jobs(self, group: list[LayerProfile], index: dict[str, int], profile: Profile, hosts: int,
                    link: LinkModel) -> list[Job]:
        jobs, rest = [], []
        for layer in group:
            sfb = self.sfb_cost(layer, profile, hosts, link)
            if sfb is None:
                rest.append(layer)
            else:
                sent, seconds = sfb
                fc = layer.fc
                rebuild = sfb_rebuild_seconds(fc.k, fc.m, fc.n, hosts, profile.gemm_flops)
                jobs.append(Job(layer.name, index[layer.name], seconds - rebuild, sent, SFB, rebuild))
        if rest:
            jobs.append(_ps_job(rest, index[rest[-1].name], hosts, profile.element_size, link))
        return sorted(jobs, key=lambda job: job.after)

    @staticmethod
    def sfb_cost(layer: LayerProfile, profile: Profile, hosts: int, link: LinkModel) -> tuple[float, float] | None:
        """(bytes, seconds) of the layer's SFB sync where the coordinator would choose it, else None."""
        if layer.fc is None or profile.gemm_flops is None:
            return None
        fc = layer.fc
        sfb = predict_sfb(fc.k, fc.m, fc.n, profile.element_size, hosts, link, profile.gemm_flops)
        return sfb if sfb[1] < predict_ps(layer.nbytes, hosts, link)[1] else None


class Delayed(Scheme):
    """Pipe-SGD over another scheme's jobs."""

    pipelined = True

    def __init__(self, base: Scheme) -> None:
        self.base, self.name = base, f"{base.name}+delay"

    def jobs(self, profile: Profile, hosts: int, link: LinkModel) -> list[Job]:
        return self.base.jobs(profile, hosts, link)


def _ps_job(layers: list[LayerProfile], after: int, hosts: int, element_size: int, link: LinkModel) -> Job:
    """One PS sync of ``layers`` as one bucket: its flat buffer, gradients and flags."""
    numel = flat_numel(sum(layer.nbytes for layer in layers) // element_size, sum(layer.tensors for layer in layers))
    sent, seconds = predict_ps(numel * element_size, hosts, link)
    return Job("+".join(layer.name for layer in layers), after, seconds, sent, PS)


SCHEMES: dict[str, Scheme] = {scheme.name: scheme for scheme in
                              (TorchDDP(), PlainPS(), WFBP(), Poseidon(), Delayed(WFBP()), Delayed(Poseidon()))}
