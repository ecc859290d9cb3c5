"""The coordinator: per layer, the path of the next pass, from facts every rank shares.

At the end of every synced backward the ranks all-gather a small vector of *facts* (the pass's
aborted flag, which buckets got a gradient late, and per FC layer its rows K this round and its sticky
flags, see :mod:`~poseidon_torch.fc`). From them every rank computes the same plan for the next pass: a
layer alone in its bucket leaves the default path when an override forces another one, or when a path
chosen by cost (``Path.by_cost``) syncs it faster than the default path and shortens the predicted
iteration (below): for an FC layer no rank raised a sticky flag on, a factor path at the largest K; with
``PoseidonDDP(compression=...)``, for any layer, the lossy paths it names (``lossy``), each from its
``start_iter``-th synced pass on. Without ``compression=`` no lossy path is ever chosen by cost. The
first pass runs every layer on the default path: it is when the sticky facts and the readiness times are
learned.

Cost model: every registered path predicts its bytes per rank and seconds per pass on this
implementation's traffic (``Path.predict``: the formulas the stats, the simulator and the benchmark
share). A sync's prediction charges the default path only its bytes while the buckets are not learned
(on it a layer can share a bucket, and its messages, with its neighbours; on a path of its own it is a
job of its own), and its whole cost once they are. With ``pull_values`` (a mode that updates at the
owners) a path is costed as its job composed with that update (``Path.predict_update``: its reduction,
then the owners' pull of the new values; the default path's push is its reduction). A
path's prediction includes its compute (SFB's rebuild; a lossy path's compression and decompression, at
the probed GEMM rate and memory bandwidth, ``memory_bps``).

One model of the iteration: a path that sends less but computes more (SFB's rebuild, compression) pays
only where the sync is exposed. So once the iteration can be modelled, every candidate is weighed by the
iteration it gives, in the simulator's timeline (:func:`~poseidon_torch.simulate.timeline.fastest`, which
the simulator's ``poseidon`` schemes call too): every layer's backward on one compute lane, timed by the
readiness of the pass the buckets were first learned from (rank 0's, shared; or a checkpoint's), each
layer's sync a job on the link once ready (the default path's, or a candidate's), a path's compute on the
compute lane; BSP, or a pipeline for a mode whose syncs overlap the next step (``pipelined``). Until the
buckets are learned an exact candidate is taken by its sync alone and a lossy one waits; the plan made
then is made again once they are (its exact choices kept for the pass the forwards already committed
to), and the plans after it are all modelled.

Invariants: a factor path is only ever chosen for a layer that can take it exactly; a path is chosen by
cost only where its sync is predicted faster than the default path's (as charged) and, once the iteration
is modelled, where the plan's predicted iteration is shorter than with the layer on the default path; a
lossy path only where ``compression=`` names it, the iteration is modelled and the plan with it is
predicted at least ``LOSSY_MIN_GAIN`` (5%) shorter than the best exact plan (a lossy path costs progress
per step, which the time model does not see); the plan depends only on facts every rank shares.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .bucket import Bucket, Layer, find_layers, flat_numel
from .fc import STICKY_NAMES, FCLayer, fc_eligible
from .link import LinkModel
from .paths import BucketCost, FCCost, Path, Paths, Prediction
from .paths import names as path_names
from .simulate.profile import LayerProfile, Profile
from .simulate.timeline import Job, fastest

#: timed plans a coordinator remembers, by their options (:meth:`Coordinator._timed_plan`)
PLANS_KEPT = 32


@dataclass(frozen=True)
class PassFacts:
    """What the end-of-pass exchange told every rank."""

    aborted_ranks: list[int]  #: the ranks whose backward was aborted (an exception on that rank)
    late: list[bool]         #: per bucket: some rank got a gradient after the bucket was submitted
    late_ranks: list[int]    #: the ranks that got a gradient after its bucket was submitted
    syncing: list[bool]      #: per bucket: its job was still running on some rank when backward ended

    @property
    def aborted(self) -> bool:
        """Some rank's backward was aborted: the pass averaged nothing."""
        return bool(self.aborted_ranks)


def checked_overrides(overrides: Mapping[str, str], layer_names: Sequence[str], fc_names: Collection[str],
                      world_size: int, paths: Mapping[str, Path] | None = None) -> dict[str, str]:
    """``overrides`` (layer -> path name), refused if one names no layer, no registered path, or a factor
    path for a layer that is not an FC layer of its own (``fc_names``: those that could take one, at any
    world size). In a world of one (nothing to gather or compress) a factor or lossy path's override means
    the default path."""
    paths = paths if paths is not None else Paths.for_costing()
    default = next(iter(paths))
    for name, path in overrides.items():
        if name not in layer_names:
            raise ValueError(f"an override or plan names {name!r}, which is not a layer: layers are the modules "
                             "that own trainable parameters (a parameter shared by several modules belongs to the first "
                             f"that registers it); layers: {sorted(layer_names)}")
        if path not in paths:
            raise ValueError(f"override for layer {name!r} must be one of {tuple(paths)}, got {path!r}")
        if paths[path].factors and name not in fc_names:
            raise ValueError(f"cannot force {path} on layer {name!r}: it is not an FC layer of its own "
                             "(see poseidon_torch.register_fc)")
    if world_size == 1:
        return {name: default if paths[path].factors or not paths[path].exact else path
                for name, path in overrides.items()}
    return dict(overrides)


class Coordinator:
    """Owns the plan: which layers leave the default path, and each bucket's path this pass."""

    def __init__(self, fc: Mapping[str, FCLayer], world_size: int, link: LinkModel, gemm_flops: float | None,
                 overrides: Mapping[str, str] | None = None, paths: Mapping[str, Path] | None = None,
                 layers: Sequence[Layer] = (), lossy: Collection[str] = (), memory_bps: float | None = None,
                 pipelined: bool = False) -> None:
        self.fc = dict(sorted(fc.items()))
        self.world_size, self.link, self.gemm_flops = world_size, link, gemm_flops
        self.memory_bps = memory_bps
        #: the paths it predicts with (its own copy: a path an engine's test wraps does not change the plan)
        self.paths = Paths(paths if paths is not None else Paths.for_costing())
        self.default = next(iter(self.paths))  #: the default path's name
        #: the lossy paths ``compression=`` names (none in a world of one: nothing to send)
        self.lossy = tuple(lossy) if world_size > 1 else ()
        self.layers = {layer.name: layer for layer in layers}
        self.overrides = dict(overrides or {})
        self.k_max = {name: 0 for name in self.fc}
        #: per FC layer, its largest K in the last pass it was watched (alone in its bucket): what the
        #: trace's layout tells the simulator of layers later fused with others
        self.k_known: dict[str, int] = {}
        self.sticky = {name: 0 for name in self.fc}
        self.chosen: dict[str, str] = {}  #: layers off the default path for the next pass, and their path
        #: layers whose lossy path won by cost but may not start yet (``start_iter``): kept alone in a bucket
        self.waiting: dict[str, str] = {}
        self.solo: set[str] = set()  #: layers that have a bucket of their own
        #: per layer, seconds from the start of backward to its gradients' readiness in the pass the buckets
        #: were first learned from (rank 0's, shared), or a checkpoint's: the iteration model's compute lane
        self.ready_s: dict[str, float] | None = None
        self._planned_blind = False  #: the current plan was made before the iteration could be modelled
        self._timed: OrderedDict[tuple, list[Job]] = OrderedDict()  #: timed plans by their options, oldest first
        #: the mode's syncs overlap the next step (Pipe-SGD): plans are timed as a pipeline, not BSP
        self.pipelined = pipelined
        self.routed: str | None = None  #: the path every bucket takes, whatever the plan (:meth:`route_all`)
        self.learned = False         #: the buckets are learned (fixed from now on)
        self.passes = 0              #: synced passes observed
        self._plan_due = False       #: facts absorbed since the last plan (:meth:`plan_next`)
        #: a mode that updates at the owners: a path that does not reduce there is charged their pull
        self.pull_values = False
        self._warned: set[str] = set()
        #: the layers some named lossy path could take: each gets a bucket of its own before the first pass
        self.compressible = [name for name, layer in self.layers.items()
                             if any(self._predict(self.paths[path], layer.nbytes, _params(layer), None) is not None
                                    for path in self.lossy)]

    def check_overrides(self, layer_names: Sequence[str], fc_names: Collection[str]) -> None:
        """Refuse bad overrides (:func:`checked_overrides`)."""
        self.overrides = checked_overrides(self.overrides, layer_names, fc_names, self.world_size, self.paths)

    def default_only(self) -> None:
        """Every layer on the default path from now on (ranks on their own clocks take no common step)."""
        self.overrides = {name: self.default for name in (*self.fc, *self.compressible, *self.overrides)}
        self.chosen, self.waiting = {}, {}

    def route_all(self, path: str) -> None:
        """Every bucket on ``path`` from now on, whatever its layers (a mode whose syncs carry something
        other than gradients, through the one path it was given): no layer is chosen by cost, forced
        elsewhere or kept alone for a lossy path."""
        self.routed = path
        self.overrides, self.chosen, self.waiting, self.compressible = {}, {}, {}, []

    def buckets_changed(self, buckets: Sequence[Bucket], learned: bool,
                        ready_s: Mapping[str, float] | None = None) -> None:
        """The engine installed new ``buckets`` (in sync order), learned (from a pass whose layers'
        gradients were ready at ``ready_s``, seconds from the start of its backward) or not yet. The first
        readiness times (or a checkpoint's) are kept for the run, so the plan never depends on a later
        pass's timing. Once the iteration can be modelled, a plan made without the model (its lossy
        layers waiting for it) is made again, its exact paths kept: the forwards of the next pass may
        have committed to a factor path."""
        self.learned = learned
        self.solo = {b.layers[0].name for b in buckets if len(b.layers) == 1}
        if ready_s is not None and self.ready_s is None:
            self.ready_s = dict(ready_s)
        if self._planned_blind and self._modelled() and not self._plan_due:
            chosen, self.waiting = self._plan()
            kept = {name: path for name, path in self.chosen.items() if self.paths[path].exact}
            self.chosen = {**{name: path for name, path in chosen.items() if name not in kept}, **kept}
            self._planned_blind = False

    def wanted_solo(self) -> set[str]:
        """Layers that should get a bucket of their own: off the default path (or waiting to leave it), or
        forced off it; before the first pass also every FC layer and every layer a named lossy path could
        take, not forced onto the default path, so each is watched (an FC layer's K learned) before the
        buckets are learned (a layer fused with a neighbour from the start would never be considered for
        a path of its own)."""
        forced = {name for name, path in self.overrides.items() if path != self.default}
        if not self.passes:
            return {name for name in (*self.fc, *self.compressible) if self.overrides.get(name) != self.default} | forced
        return (set(self.chosen) | set(self.waiting)
                | {name for name in forced if not self._barred(name, self.overrides[name])})

    def on(self, path: str) -> set[str]:
        """The layers on ``path`` in the next pass (besides the default path's)."""
        return {name for name, chosen in self.chosen.items() if chosen == path}

    def commits(self, name: str) -> bool:
        """Whether the layer's calls in the next round are detached (it syncs from its factors)."""
        path = self.chosen.get(name)
        return path is not None and self.paths[path].factors

    def path_of(self, bucket: Bucket, shadow: bool = False) -> str:
        """The path of ``bucket`` this pass: its layer's (alone in the bucket) in the plan; a factor path
        only where the layer's round of forwards was committed to it (a retained graph from before the plan
        changed goes through the default path). A joined rank's shadow pass ran no forward: it follows the
        plan, as the ranks that did commit their calls to it. A routed engine's buckets all take its path."""
        if self.routed is not None:
            return self.routed
        path = self.chosen.get(bucket.layers[0].name) if len(bucket.layers) == 1 else None
        if path is None:
            return self.default
        if self.paths[path].factors and not (bucket.fc is not None and (shadow or bucket.fc.commit)):
            return self.default
        return path

    def k_pad(self, bucket: Bucket) -> int:
        return self.k_max[bucket.fc.name]

    # ---- the end-of-pass exchange -----------------------------------------------------------------

    def facts(self, aborted: bool, late: Sequence[bool], syncing: Sequence[bool]) -> torch.Tensor:
        """This rank's facts: [aborted, late per bucket, syncing per bucket, (K, sticky) per FC layer]."""
        values = [int(aborted), *map(int, late), *map(int, syncing)]
        for layer in self.fc.values():
            values += [layer.k_round, layer.sticky]
        return torch.tensor(values, dtype=torch.int64)

    def observe(self, everyone: torch.Tensor, num_buckets: int) -> PassFacts:
        """Every rank's facts (one row per rank): update K, sticky flags and the plan."""
        facts = self.absorb(everyone, num_buckets)
        self.plan_next()
        return facts

    def absorb(self, everyone: torch.Tensor, num_buckets: int) -> PassFacts:
        """Every rank's facts (one row per rank): update K and the sticky flags, count the pass; the plan
        they lead to is made by :meth:`plan_next` (until then it is *due*: the forwards still read the
        last one)."""
        rows = everyone.tolist()  # a few ints per bucket and layer: plain Python beats a torch op per value
        aborted_ranks = [r for r, row in enumerate(rows) if row[0]]
        columns = list(zip(*rows))
        late = [any(c) for c in columns[1:1 + num_buckets]]
        late_ranks = [r for r, row in enumerate(rows) if any(row[1:1 + num_buckets])]
        syncing = [any(c) for c in columns[1 + num_buckets:1 + 2 * num_buckets]]
        per_layer = columns[1 + 2 * num_buckets:]
        for i, name in enumerate(self.fc):
            self.k_max[name] = max(per_layer[2 * i])
            if self.k_max[name]:
                self.k_known[name] = self.k_max[name]
            for flags in per_layer[2 * i + 1]:
                self.sticky[name] |= flags
        if not aborted_ranks:
            self.passes += 1
            self._plan_due = True
        return PassFacts(aborted_ranks, late, late_ranks, syncing)

    def plan_next(self) -> None:
        """The plan for the next pass from the facts absorbed since the last one (nothing when none is due)."""
        if self._plan_due:
            self.chosen, self.waiting = self._plan()
            self._plan_due = False
            self._planned_blind = not self._modelled()

    def _plan(self) -> tuple[dict[str, str], dict[str, str]]:
        """Every layer's path off the default one, and the layers waiting for a lossy path: as forced, or
        chosen by cost (FC layers, and the layers a named lossy path could take) among the paths that sync
        them faster than the default path, where they shorten the predicted iteration (:meth:`_fastest`);
        a lossy path waits for its ``start_iter`` and for the iteration model (the buckets learned), and
        until then the layer takes the best path that has started (an FC layer keeps SFB where it pays)."""
        chosen = {name: path for name, path in self.overrides.items()
                  if path != self.default and not self.paths[path].factors}
        waiting, cheaper = {}, {}
        for name in dict.fromkeys((*self.fc, *self.compressible)):
            if name in chosen or not self._may_leave_default(name):
                continue
            forced = self.overrides.get(name)
            if forced is not None:
                chosen[name] = forced
                continue
            if self._resumed_lossy(name):
                chosen[name] = self.chosen[name]
                continue
            paths = self._cheaper(name)
            if paths and not self._started(paths[0][0]):
                waiting[name] = paths[0][0]
            started = [(path, predicted) for path, predicted in paths if self._started(path)]
            if started:
                cheaper[name] = started
        return {**chosen, **self._fastest(cheaper)}, waiting

    def _resumed_lossy(self, name: str) -> bool:
        """Whether layer ``name`` is on the lossy path a checkpoint put it on and the iteration cannot be
        modelled yet (a resumed engine's first pass plans before it learns its buckets): it stays there
        until the model re-plans it at learning, as the saved run, which had the model, would have kept
        it (not on the exact path a blind plan would give it for one pass)."""
        path = self.chosen.get(name)
        return path is not None and not self.paths[path].exact and not self._modelled()

    def _started(self, path: str) -> bool:
        """Whether ``path`` may carry a layer chosen by cost this pass: an exact one always, a lossy one
        from its ``start_iter``-th synced pass on, once the iteration can be modelled (never chosen
        unmodelled: a lossy path costs compute, which only the iteration shows to pay or not)."""
        return self.paths[path].exact or (self.passes >= self.paths[path].start_iter and self._modelled())

    def _barred(self, name: str, path: str) -> bool:
        """A sticky fact keeps FC layer ``name`` off factor paths for good."""
        return self.paths[path].factors and bool(self.sticky.get(name))

    def _may_leave_default(self, name: str) -> bool:
        """Whether layer ``name`` may leave the default path in the next pass: alone in its bucket, not
        forced onto the default path, not forced onto a factor path a sticky fact bars (warned once)."""
        forced = self.overrides.get(name)
        if forced is not None and self._barred(name, forced):
            if name not in self._warned:
                self._warned.add(name)
                reasons = ", ".join(text for bit, text in STICKY_NAMES.items() if self.sticky[name] & bit)
                warnings.warn(f"PoseidonDDP: layer {name!r} stays on the {self.default} path despite overrides="
                              f"{{'{name}': '{forced}'}}: {forced} would not be exact ({reasons})", stacklevel=2)
            return False
        return name in self.solo and forced != self.default

    def _cheaper(self, name: str) -> list[tuple[str, Prediction]]:
        """The candidate paths (:meth:`candidates`) that sync layer ``name`` alone in its bucket faster
        than the default path, fastest first, with their predictions. Before the buckets are learned, a
        layer on the default path may still join its neighbours' bucket and share their messages: the
        default is charged only its bytes; once they are learned (fixed), a layer alone in its bucket pays
        the latency on any path."""
        params = self._layer_params(name)
        nbytes = flat_numel(sum(p.numel() for p in params), len(params)) * params[0].element_size()  # its bucket's
        default = self._predict(self.paths[self.default], nbytes, params, self.fc.get(name))
        limit = default.seconds if self.learned else self.link.beta_s_per_byte * default.bytes
        cheaper = []
        for path in self.candidates(name):
            predicted = self._predict(path, nbytes, params, self.fc.get(name))
            if predicted is not None and predicted.seconds < limit:
                cheaper.append((path.name, predicted))
        return sorted(cheaper, key=lambda chosen: chosen[1].seconds)

    def _layer_params(self, name: str) -> list[nn.Parameter]:
        fc = self.fc.get(name)
        return fc.params if fc is not None else _params(self.layers[name])

    def _modelled(self) -> bool:
        """Whether the iteration can be modelled: the buckets are learned, and the readiness times known."""
        return self.learned and self.ready_s is not None

    def _fastest(self, cheaper: Mapping[str, list[tuple[str, Prediction]]]) -> dict[str, str]:
        """Per layer with ``cheaper`` paths, the one it takes. Once the iteration can be modelled, a path only
        where it shortens the predicted iteration (:func:`~poseidon_torch.simulate.timeline.fastest`, the
        simulator's model: the layers' backward on one compute lane, timed by the readiness the buckets
        were learned from, each layer's sync a job on the link, a path's compute on the compute lane); a
        sync hidden under the backward stays on the default path, whatever a path would save on it. Until
        then (lossy paths wait for the model) the fastest exact path by its sync alone."""
        if not self._modelled():
            exact = {name: next((path for path, _ in paths if self.paths[path].exact), self.default)
                     for name, paths in cheaper.items()}
            return {name: path for name, path in exact.items() if path != self.default}
        if not any(cheaper.values()):
            return {}
        profile, layers = self._iteration_profile()
        options = []
        for i, name in enumerate(layers):
            params = self._layer_params(name)
            nbytes = flat_numel(sum(p.numel() for p in params), len(params)) * params[0].element_size()
            default = self._predict(self.paths[self.default], nbytes, params, self.fc.get(name))
            options.append([_job(name, i, self.paths[self.default], default),
                            *(_job(name, i, self.paths[path], predicted) for path, predicted in cheaper.get(name, ()))])
        return {job.name: job.path for job in self._timed_plan(profile, options) if job.path != self.default}

    def _timed_plan(self, profile: Profile, options: list[list[Job]]) -> list[Job]:
        """:func:`~poseidon_torch.simulate.timeline.fastest` of ``options``, the last ``PLANS_KEPT`` remembered:
        a few hundred layers cost it a tenth of a second or more, and the options change only with a path's
        start, an FC layer's K or a sticky fact (the profile only with a checkpoint's readiness), so a model
        whose K takes a few values (lengths padded to a multiple, or bucketed) times each plan once."""
        key = profile, tuple(map(tuple, options))
        plan = self._timed.pop(key, None)
        if plan is None:
            plan = fastest(profile, options, self.pipelined)
        self._timed[key] = plan
        if len(self._timed) > PLANS_KEPT:
            self._timed.popitem(last=False)
        return plan

    def _iteration_profile(self) -> tuple[Profile, list[str]]:
        """Every layer with parameters as the timeline's compute lane, in the order they became ready,
        each the backward seconds since the one before; and their names in that order. Per layer, not
        per bucket: the readiness times a checkpoint carries then give the same plan whatever buckets
        a resumed run learns (a fused layer is charged a job's latency of its own)."""
        end = max(self.ready_s.values(), default=0.0)
        ready = {name: self.ready_s.get(name, end) for name in self.layers}
        names = sorted(self.layers, key=lambda name: ready[name])
        steps, last = [], 0.0
        for name in names:
            steps.append(LayerProfile(name, self.layers[name].nbytes, max(0.0, ready[name] - last)))
            last = max(last, ready[name])
        # a backward the clock could not see (0 s) still runs: a nanosecond keeps the profile valid
        return Profile(tuple(steps), forward_s=1e-9), names

    def candidates(self, name: str) -> list[Path]:
        """The paths layer ``name`` may be put on by cost: the exact ones chosen by cost (factor paths
        only while no sticky fact bars them) and the lossy ones ``compression=`` names."""
        return [path for path in self.paths.values() if path.by_cost and (path.exact or path.name in self.lossy)
                and not self._barred(name, path.name)]

    def _predict(self, path: Path, nbytes: float, params: Sequence[torch.nn.Parameter],
                 layer: FCLayer | None) -> Prediction | None:
        """``path``'s prediction for a bucket of ``nbytes`` holding ``params`` (``layer``: its FC layer alone,
        at last pass's K); with ``pull_values``, of its job composed with the update at the owners
        (``Path.predict_update``)."""
        element_size = params[0].element_size() if params else 4
        param_bytes = sum(p.numel() for p in params) * element_size
        fc = FCCost(layer.m, layer.n, self.k_max[layer.name], element_size) if layer is not None else None
        cost = BucketCost(nbytes, param_bytes, fc, tuple(tuple(p.shape) for p in params), element_size)
        if not self.pull_values:
            return path.predict(cost, self.world_size, self.link, self.gemm_flops, self.memory_bps)
        pull = self.paths.default.predict_pull(param_bytes, self.world_size, self.link)
        return path.predict_update(cost, self.world_size, self.link, self.gemm_flops, self.memory_bps, pull)

    # ---- what a checkpoint carries --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """With a lossy path named or forced, or an FC layer SFB may take: the synced passes so far (each
        path's ``start_iter`` counts them), the layers on a lossy path, which a resumed engine's first pass
        keeps there, and the readiness times the plans are modelled with, so a resumed run plans as the
        saved one would (empty otherwise: the default path needs nothing). A plan still due (a pass settled
        early, for a checkpoint) is the one the next pass takes: its lossy layers are saved, and it stays
        due."""
        chosen = self._plan()[0] if self._plan_due else self.chosen
        lossy = {name: path for name, path in chosen.items() if not self.paths[path].exact}
        if not (lossy or self.lossy or self.fc):
            return {}
        state = {"passes": self.passes, "lossy": lossy}
        if self.ready_s is not None:
            state["ready_s"] = dict(self.ready_s)
        return state

    def load_state_dict(self, state: object) -> None:
        """Restore :meth:`state_dict` before the first pass (the layers it names are alone in a bucket)."""
        lossy = self.checked_state(state)
        self.passes = int(state.get("passes", 0))
        self.chosen.update({name: path for name, path in lossy.items() if name in self.solo})
        if "ready_s" in state:
            self.ready_s = dict(state["ready_s"])

    def checked_state(self, state: object) -> dict[str, str]:
        """The lossy layers of a :meth:`state_dict`, checked (changes nothing: a refusal comes before any
        part of a consistency state is loaded)."""
        if not isinstance(state, Mapping) or set(state) - {"passes", "lossy", "ready_s"}:
            raise ValueError(f"not a coordinator state (a dict of 'passes', 'lossy' and 'ready_s'): {state!r:.80}")
        lossy = dict(state.get("lossy", {}))
        for name, path in lossy.items():
            if name not in self.layers or path not in self.paths or self.paths[path].exact:
                raise ValueError(f"the checkpoint puts layer {name!r} on {path!r}: not a layer and lossy path here")
            if path not in self.lossy and self.overrides.get(name) != path:
                raise ValueError(f"the checkpoint puts layer {name!r} on the lossy path {path!r}, which this PoseidonDDP "
                                 "neither names in compression= nor forces: resume with compression= as when saved")
        ready = state.get("ready_s", {})
        if not (isinstance(ready, Mapping) and all(
                name in self.layers and isinstance(t, (int, float)) and math.isfinite(t) and t >= 0
                for name, t in ready.items())):
            raise ValueError(f"the checkpoint's readiness times (ready_s) must map this model's layers to seconds "
                             f">= 0, got {ready!r:.80}")
        return lossy

    # ---- the printable plan ---------------------------------------------------------------------

    def plan(self, buckets: Sequence[Bucket]) -> Plan:
        """The plan for the next synced pass, one row per bucket."""
        return Plan([self._row(b) for b in buckets], self.world_size, self.link, self.gemm_flops)

    def _columns(self) -> list[Path]:
        """The paths a plan shows: the default, the exact ones chosen by cost, the lossy ones ``compression=``
        names, those an override names."""
        forced = set(self.overrides.values())
        return [path for name, path in self.paths.items() if name in (self.default, self.routed) or name in forced
                or (path.by_cost and (path.exact or name in self.lossy))]

    def _row(self, bucket: Bucket) -> PlanRow:
        layer = bucket.fc
        kind = type(bucket.layers[0].module).__name__ if len(bucket.layers) == 1 else f"fused x{len(bucket.layers)}"
        predictions = {}
        for path in self._columns():
            predicted = (self._predict(path, bucket.nbytes, bucket.params, layer) if layer is not None or not path.factors
                         else None)
            predictions[path.name] = (None if predicted is None else
                                      (predicted.bytes, predicted.seconds, 0.0 if path.exact else predicted.compute_s))
        planned = self.routed or (self.chosen.get(bucket.layers[0].name, self.default) if len(bucket.layers) == 1
                                  else self.default)
        return PlanRow(bucket.name, kind, tuple(bucket.params[0].shape), self.k_max[layer.name] if layer else None,
                       planned, bucket.name in self.overrides, predictions, tuple(part.name for part in bucket.layers))


def _params(layer: Layer) -> list[torch.nn.Parameter]:
    return [p for _, p in layer.params]


def _job(bucket: str, after: int, path: Path, predicted: Prediction) -> Job:
    """A bucket's sync on ``path`` as the timeline's job: its link part, and its compute on the compute lane."""
    return Job(bucket, after, predicted.seconds - predicted.compute_s, predicted.bytes, path.name, predicted.compute_s,
               lossy=not path.exact)


@dataclass(frozen=True)
class PlanRow:
    name: str
    kind: str
    shape: tuple[int, ...]
    k: int | None          #: the largest K of the last pass (FC layers of their own)
    path: str
    forced: bool
    #: per path shown: (bytes per rank, seconds, of which a lossy path's compression and decompression
    #: compute) of one sync, None where it cannot take the bucket
    predictions: dict[str, tuple[float, float, float] | None]
    layers: tuple[str, ...]  #: the bucket's layers, in sync order


#: what :meth:`Plan.save` writes, and :func:`recorded_paths` reads back
PLAN_FORMAT = "poseidon-plan/1"


@dataclass(frozen=True)
class Plan:
    """One row per bucket, in sync order, and the inputs of the cost model; ``print`` it. Given back
    to ``PoseidonDDP(plan=...)`` (itself, :meth:`layer_paths` or the file :meth:`save` wrote), it
    forces every layer onto the path it records."""

    rows: list[PlanRow]
    world_size: int
    link: LinkModel
    gemm_flops: float | None  #: None: not probed (no layer can take a factor path)

    #: a fused bucket's name (its layers joined by "+") wraps onto lines of at most this many characters
    NAME_WIDTH = 48

    def paths(self) -> dict[str, str]:
        return {row.name: row.path for row in self.rows}

    def layer_paths(self) -> dict[str, str]:
        """Every layer's path (a fused bucket's layers share its path)."""
        return {layer: row.path for row in self.rows for layer in row.layers}

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`layer_paths` as JSON, for ``PoseidonDDP(plan=path)``."""
        record = {"format": PLAN_FORMAT, "world_size": self.world_size, "paths": self.layer_paths()}
        with open(path, "w") as file:
            json.dump(record, file, indent=1, sort_keys=True)

    def __str__(self) -> str:
        shown = list(self.rows[0].predictions) if self.rows else []
        header = ("bucket", "type", "shape", "K", "path", *(f"{path} {what}" for path in shown for what in ("bytes", "time")))
        rows = [(header,)] + [_wrapped(_cells(row, shown), self.NAME_WIDTH) for row in self.rows]
        widths = [max(len(line[i]) for row in rows for line in row) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                 for row in rows for line in row]
        lines.insert(1, "  ".join("-" * width for width in widths))
        gemm = "not probed" if self.gemm_flops is None else f"{self.gemm_flops / 1e9:.3g} GFLOP/s"
        lines.append(f"P={self.world_size}; link: {self.link}; GEMM {gemm}; * = forced by override")
        return "\n".join(lines)


def recorded_paths(plan: Plan | Mapping[str, str] | str | os.PathLike, module: nn.Module) -> dict[str, str]:
    """The per-layer paths of a recorded plan (a :class:`Plan`, a ``{layer: path}`` dict, or a file
    :meth:`Plan.save` wrote), checked to name every layer of ``module`` that could take a factor path
    (an FC layer): a layer it leaves out would be planned by the timing-dependent cost model. Which
    names are layers, and which paths they may take, the engine checks as it does for ``overrides``."""
    if isinstance(plan, Plan):
        paths = plan.layer_paths()
    elif isinstance(plan, Mapping):
        paths = dict(plan)
    elif isinstance(plan, (str, os.PathLike)):
        paths = _read_plan(plan)
    else:
        raise TypeError(f"PoseidonDDP option plan must be a Plan (model.plan), a dict {{layer: path}} (paths: "
                        f"{path_names()}) or the path of a file Plan.save() wrote, got {type(plan).__name__}")
    missing = sorted(layer.name for layer in fc_eligible(find_layers(module), module) if layer.name not in paths)
    if missing:
        raise ValueError(f"plan= gives no path for the layer(s) {missing}, which could take a factor path: a plan must "
                         "name every such layer (record it from this model with model.plan.save(path), or add them)")
    return paths


def _read_plan(path: str | os.PathLike) -> dict[str, str]:
    with open(path) as file:
        record = json.load(file)
    if not (isinstance(record, dict) and record.get("format") == PLAN_FORMAT and isinstance(record.get("paths"), dict)):
        raise ValueError(f"{os.fspath(path)!r} is not a plan written by Plan.save() (format {PLAN_FORMAT!r})")
    return record["paths"]


def _wrapped(cells: tuple[str, ...], width: int) -> list[tuple[str, ...]]:
    """A row as lines: the bucket name (first cell) cut after a "+" so no line is wider than ``width``
    (a single layer name longer than that stays whole); the other cells on the first line."""
    pieces, line = [], ""
    for layer in cells[0].split("+"):
        joined = f"{line}+{layer}" if line else layer
        if line and len(joined) + 1 > width:
            pieces.append(line + "+")
            joined = layer
        line = joined
    pieces.append(line)
    blank = ("",) * (len(cells) - 1)
    return [(pieces[0], *cells[1:])] + [(piece, *blank) for piece in pieces[1:]]


def _cells(row: PlanRow, shown: list[str]) -> tuple[str, ...]:
    predicted = []
    for path in shown:
        prediction = row.predictions.get(path)
        predicted += ["-", "-"] if prediction is None else [format_bytes(prediction[0]), _time(*prediction[1:])]
    return (row.name, row.kind, "x".join(map(str, row.shape)), "-" if row.k is None else str(row.k),
            row.path + ("*" if row.forced else ""), *predicted)


def _time(seconds: float, compute_s: float) -> str:
    """A sync's predicted time, and the part of it that is compression compute where there is some."""
    return format_seconds(seconds) + (f" ({format_seconds(compute_s)} compute)" if compute_s else "")


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-6:.1f} us"
