"""What a lossy path's sync costs in compute, measured against what the coordinator predicts for it: the
calibration behind ``_BYTES_PER_ELEMENT`` and ``_SECONDS_PER_MATRIX`` in ``poseidon_torch/paths/``.

One process, one thread, no network: each layer of a benchmark task's model is a bucket of its own, and
the path's own ``sync`` runs on it with stub collectives (a world of one: every chunk is this rank's, so
a cast path's owner work covers the whole bucket, about twice a rank's share at P = 2). The figure is
the CPU time of a sync (``time.process_time``, the median of ``--repeats`` timings of ``--syncs`` syncs)
next to the path's predicted compute at the probed GEMM rate and memory bandwidth, as the coordinator
probes them. Run it on a quiet machine::

    python benchmarks/compression_compute.py --task lm-wide --shapes 2048x2048 1024x4096 --paths PowerSGD INT8 BF16

``--shapes`` adds linear layers of those (out x in) shapes: buckets larger than the caches, whose
passes over memory run at the probed bandwidth (a task's small layers stay in cache: less per element).

A ratio (measured / predicted) near 1 means the coordinator weighs that path's compute right; above 1,
it would compress where the compute costs more than the bytes save.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from poseidon_torch.bench.accuracy.tasks import TASKS
from poseidon_torch.bucket import Bucket, Layer
from poseidon_torch.link import LinkModel, probe_gemm_flops, probe_memory_bandwidth
from poseidon_torch.paths import BucketCost, LossyPath, Paths, PathEnv, SyncContext, drive
from poseidon_torch.paths.ps import DEFAULT_CHUNK_BYTES

#: any link: the predicted compute does not depend on it
_LINK = LinkModel.from_gbps(1.0)


class StubGroups:
    """The collectives of a world of one: nothing to send."""

    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass


def layers_of(model: nn.Module) -> list[Layer]:
    """Every module that holds parameters of its own, as a layer."""
    layers = []
    for name, module in model.named_modules():
        params = tuple((f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False))
        if params:
            layers.append(Layer(name, module, params))
    return layers


def cost_of(bucket: Bucket) -> BucketCost:
    size = bucket.flat.element_size()
    return BucketCost(bucket.flat.numel() * size, bucket.grad_numel * size, None,
                      tuple(tuple(p.shape) for p in bucket.params), size)


def seconds_per_sync(path: LossyPath, bucket: Bucket, syncs: int, repeats: int) -> float:
    """The median CPU seconds of one sync of ``bucket`` on ``path``, with a residual for every parameter."""
    path.prepare([bucket])
    for p in bucket.params:
        path._residuals[id(p)] = torch.randn_like(p).mul_(1e-3)
    bucket.flat[:bucket.grad_numel].normal_()
    ctx = SyncContext(path=path.name, task=0, aborted=False, shadow=False)
    drive(path.sync(bucket, StubGroups(), ctx))  # the buffers made at a bucket's first sync
    timings = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(syncs):
            drive(path.sync(bucket, StubGroups(), ctx))
        timings.append((time.process_time() - start) / syncs)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="lm-wide")
    parser.add_argument("--shapes", nargs="*", default=[], help="extra linear layers, OUTxIN each")
    parser.add_argument("--paths", nargs="+", default=["PowerSGD", "INT8", "BF16"])
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the task's shrunken model (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gemm, memory = probe_gemm_flops("cpu"), probe_memory_bandwidth("cpu")
    print(f"probed: GEMM {gemm / 1e9:.1f} GFLOP/s, memory {memory / 1e9:.1f} GB/s, one thread")
    paths = Paths.build(PathEnv(0, 1, DEFAULT_CHUNK_BYTES, torch.device("cpu")))
    layers = layers_of(TASKS[args.task](args.tiny).build_model())
    for shape in args.shapes:
        out_features, in_features = (int(size) for size in shape.split("x"))
        layers += layers_of(nn.Sequential(nn.Linear(in_features, out_features, bias=False)))
        layers[-1] = Layer(f"linear {shape}", layers[-1].module, layers[-1].params)
    for name in args.paths:
        path = paths[name]
        print(f"\n{name}\n{'layer':24s} {'elements':>9s} {'measured ms':>11s} {'ns/element':>10s} "
              f"{'predicted ms':>12s} {'ratio':>6s}")
        measured_s = predicted_s = 0.0
        for i, layer in enumerate(layers):
            bucket = Bucket(i, [layer])
            predicted = path.predict(cost_of(bucket), 2, _LINK, gemm, memory)
            if predicted is None:  # not this path's (a vector for PowerSGD)
                continue
            seconds = seconds_per_sync(path, bucket, args.syncs, args.repeats)
            measured_s, predicted_s = measured_s + seconds, predicted_s + predicted.compute_s
            print(f"{layer.name:24s} {bucket.grad_numel:9d} {seconds * 1e3:11.3f} "
                  f"{seconds / bucket.grad_numel * 1e9:10.2f} {predicted.compute_s * 1e3:12.3f} "
                  f"{seconds / predicted.compute_s:6.2f}")
        if predicted_s:
            print(f"{'all':24s} {'':9s} {measured_s * 1e3:11.3f} {'':10s} {predicted_s * 1e3:12.3f} "
                  f"{measured_s / predicted_s:6.2f}")


if __name__ == "__main__":
    main()
