"""Model shapes for the parity tests: MLPs and small CNNs with optional BatchNorm, shared weights,
frozen layers, unused branches; plus the hypothesis strategy that draws them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn

import placement
from placement import on_device
from poseidon_torch import register_fc


class TransposedFC(nn.Module):
    """A third-party style FC layer: weight stored as (in, out), y = x @ W + b."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(in_features, out_features) / in_features ** 0.5)
        self.b = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


register_fc(TransposedFC, weight="w", bias="b", transposed=True)


@dataclass(frozen=True)
class ModelSpec:
    in_features: int = 6
    widths: tuple[int, ...] = (8,)
    out_features: int = 3
    bias: bool = True
    conv_channels: tuple[int, ...] = ()
    kernel: int = 3
    image: int = 6
    batchnorm: bool = False
    tied: bool = False          # a square hidden layer applied twice per forward
    shared_across: bool = False  # two square Linear modules sharing one weight (twin.weight = square.weight)
    frozen_first: bool = False  # first layer's parameters do not require grad
    unused_branch: bool = False  # a layer no rank ever uses
    rank0_branch: bool = False   # a layer only rank 0 uses
    seq: int = 0                 # > 0: inputs (batch, seq, in_features), every position a sample
    custom_head: bool = False    # the head is a registered TransposedFC
    seed: int = 0

    @property
    def has_conv(self) -> bool:
        return bool(self.conv_channels)

    def input_shape(self, batch: int) -> tuple[int, ...]:
        if self.has_conv:
            return (batch, 3, self.image, self.image)
        return (batch, self.seq, self.in_features) if self.seq else (batch, self.in_features)

    def target_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.seq, self.out_features) if self.seq else (batch, self.out_features)


class Net(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        convs, channels = [], 3
        for c in spec.conv_channels:
            convs += [nn.Conv2d(channels, c, spec.kernel, padding=spec.kernel // 2, bias=spec.bias)]
            convs += [nn.BatchNorm2d(c)] if spec.batchnorm else []
            convs += [nn.ReLU()]
            channels = c
        self.features = nn.Sequential(*convs)
        width = channels * spec.image * spec.image if spec.has_conv else spec.in_features
        layers = []
        for w in spec.widths:
            layers += [nn.Linear(width, w, bias=spec.bias), nn.Tanh()]
            width = w
        self.body = nn.Sequential(*layers)
        self.tied = nn.Linear(width, width, bias=spec.bias) if spec.tied else None
        self.square = self.twin = None
        if spec.shared_across:
            self.square, self.twin = nn.Linear(width, width, bias=spec.bias), nn.Linear(width, width, bias=spec.bias)
            self.twin.weight = self.square.weight
        self.rank0_side = nn.Linear(width, width) if spec.rank0_branch else None
        self.unused = nn.Linear(4, 4) if spec.unused_branch else None
        head = TransposedFC if spec.custom_head else nn.Linear
        self.head = head(width, spec.out_features) if spec.custom_head else head(width, spec.out_features,
                                                                                 bias=spec.bias)
        if spec.frozen_first:
            first = next(m for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
            first.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = self.body(self.features(x).flatten(1) if self.features else x)
        if self.tied is not None:
            h = torch.tanh(self.tied(torch.tanh(self.tied(h))))
        if self.square is not None:
            h = torch.tanh(self.twin(torch.tanh(self.square(h))))
        if use_side and self.rank0_side is not None:
            h = h + self.rank0_side(h)
        return self.head(h)


def build(spec: ModelSpec, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(spec).to(placement.DEVICE)


def batch(spec: ModelSpec, step: int, size: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (same on every rank); rank r trains on rows r*size..(r+1)*size."""
    g = torch.Generator().manual_seed(1000 * spec.seed + step)
    x = torch.randn(spec.input_shape(size * world_size), generator=g)
    y = torch.randn(spec.target_shape(size * world_size), generator=g)
    return on_device(x, y)


@st.composite
def fc_specs(draw) -> ModelSpec:
    """MLPs (2-D or 3-D inputs, maybe a custom FC head) for the SFB path."""
    return ModelSpec(
        in_features=draw(st.integers(1, 24)),
        widths=tuple(draw(st.lists(st.integers(1, 48), min_size=1, max_size=3))),
        out_features=draw(st.integers(1, 6)),
        bias=draw(st.booleans()),
        seq=draw(st.sampled_from([0, 0, 3])),
        custom_head=draw(st.booleans()),
        tied=draw(st.booleans()),
        seed=draw(st.integers(0, 10_000)),
    )


@st.composite
def model_specs(draw) -> ModelSpec:
    conv = draw(st.booleans())
    return ModelSpec(
        in_features=draw(st.integers(1, 12)),
        widths=tuple(draw(st.lists(st.integers(1, 24), min_size=0 if conv else 1, max_size=3))),
        out_features=draw(st.integers(1, 5)),
        bias=draw(st.booleans()),
        conv_channels=tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2))) if conv else (),
        kernel=draw(st.sampled_from([1, 3])),
        image=draw(st.integers(2, 6)),
        batchnorm=conv and draw(st.booleans()),
        seed=draw(st.integers(0, 10_000)),
    )
