"""The Poseidon paper's VGG19-22K setting as a profile, and the paper's speed-ups to compare with.

VGG19-22K: VGG19's sixteen 3x3 convolutions on 224x224 inputs and three FC layers, the last with
21,841 ImageNet-22K classes (229 M parameters); batch 32 per machine; Caffe on one GPU per machine,
0.925 s per iteration on one machine (the paper's figure). We have no per-layer times from the paper:
each layer's compute is its share of the model's FLOPs (forward 2 C_in C_out 9 H W per sample for a
convolution, 2 M N for an FC layer; backward twice the forward, the first layer once: it needs no input
gradient), scaled so one iteration takes 0.925 s. SFB's rebuild GEMM runs at the same rate as the
model's own compute (its FLOPs over 0.925 s). K = 32 rows per FC layer and machine.
"""
from __future__ import annotations

import math

from .profile import FCShape, LayerProfile, Profile

NAME = "vgg19-22k"
ITERATION_S = 0.925
BATCH = 32
#: The paper's speed-ups of VGG19-22K on Caffe at 40 GbE (figure data; ``../shared/notes/poseidon.md``)
PAPER_40GBE = {
    "poseidon": {2: 1.96, 4: 3.83, 8: 7.63, 16: 15.0, 32: 29.5},
    "wfbp": {2: 1.78, 4: 3.28, 8: 6.12, 16: 11.6, 32: 21.4},
    "ps": {2: 1.01, 4: 1.47, 8: 2.16, 16: 2.82, 32: 4.42},
}
PAPER_BANDWIDTH_GBPS = 40.0

#: (name, input channels, output channels, spatial size) of VGG19's convolutions
_CONVS = [("conv1_1", 3, 64, 224), ("conv1_2", 64, 64, 224), ("conv2_1", 64, 128, 112), ("conv2_2", 128, 128, 112),
          ("conv3_1", 128, 256, 56), *((f"conv3_{i}", 256, 256, 56) for i in (2, 3, 4)),
          ("conv4_1", 256, 512, 28), *((f"conv4_{i}", 512, 512, 28) for i in (2, 3, 4)),
          *((f"conv5_{i}", 512, 512, 14) for i in (1, 2, 3, 4))]
#: (name, inputs N, outputs M)
_FCS = [("fc6", 512 * 7 * 7, 4096), ("fc7", 4096, 4096), ("fc8", 4096, 21841)]


def vgg19_22k() -> Profile:
    """The VGG19-22K profile described in the module docstring (layers in backward order)."""
    layers = []  # (name, weight and bias shapes, forward FLOPs per sample, fc shape), input side first
    for name, c_in, c_out, size in _CONVS:
        layers.append((name, ((c_out, c_in, 3, 3), (c_out,)), 2.0 * 9 * c_in * c_out * size * size, None))
    for name, n, m in _FCS:
        layers.append((name, ((m, n), (m,)), 2.0 * m * n, FCShape(m, n, BATCH)))
    forward = sum(flops for _, _, flops, _ in layers)
    backward = [flops * (1.0 if i == 0 else 2.0) for i, (_, _, flops, _) in enumerate(layers)]
    total = forward + sum(backward)
    seconds_per_flop = ITERATION_S / total
    profiled = [LayerProfile(name, 4 * sum(math.prod(shape) for shape in shapes), flops * seconds_per_flop, fc,
                             len(shapes), shapes)
                for (name, shapes, _, fc), flops in zip(layers, backward)]
    return Profile(tuple(reversed(profiled)), forward * seconds_per_flop, 0.0, (), 4, BATCH * total / ITERATION_S,
                   BATCH, "VGG19-22K shapes, compute split by FLOPs to 0.925 s per iteration (Poseidon, ATC'17)")
