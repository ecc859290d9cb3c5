"""Synthetic training workloads for the benchmarks.

Each builder returns a :class:`Workload`: ``(model, make_batch, loss_fn, batch_size)`` where
``make_batch(rank, step) -> (x, y)`` yields that rank's batch of ``batch_size`` samples for ``step``.

Invariants:
- Deterministic: the model is initialised from a fixed seed, so every rank builds identical weights, and a
  batch depends only on ``(workload, rank, step)`` (its own ``torch.Generator``; the global RNG is untouched
  by ``make_batch``).
- Synthetic data only; no downloads. Inputs are CPU float32 tensors (token ids: int64).
- ``tiny=True`` shrinks every model to a few thousand to a few hundred thousand parameters (smoke tests);
  the batch shapes keep their meaning.
- No dropout, so an iteration's compute does not depend on RNG state.

Sizes (full): ``fc_heavy`` ~34 M parameters of which ~99 % in three FC layers; ``resnet`` ~2.8 M, all but
~3 k in convolutions and BatchNorm; ``transformer`` ~2.6 M (vocab 2048, d_model 256, 2 layers, seq 64, batch 16);
the sizes people train: ``resnet18`` ~11.2 M (full-width ResNet-18 for 32x32, batch 32) and ``gpt2`` ~17 M
(GPT-2-small-like, 4 layers of width 512, vocab 8192, seq 128, tied embeddings, batch 8);
``mlp50`` / ``mlp200``: 50 / 200 blocks of Linear(64, 64) + LayerNorm (210 k / 840 k parameters, 100 / 400
parameter tensors), batch 32: little compute per layer, so the engine's per-layer cost shows;
``gpt2-offcpu`` / ``resnet18-offcpu``: those models with their compute off the CPU (``offcpu.py``);
``gpt2-synconly`` / ``resnet18-synconly``: the same waiting for nothing (the sync's own time).
One training iteration with 1 torch thread on the 2-core development machine: fc_heavy ~0.25-0.3 s,
resnet ~0.3-0.4 s, transformer ~0.15 s.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from poseidon_torch.bench.offcpu import off_cpu

Batch = tuple[torch.Tensor, torch.Tensor]
MODEL_SEED = 1234
DATA_SEED = 4321


class Workload(NamedTuple):
    model: nn.Module
    make_batch: Callable[[int, int], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int


def _generator(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(DATA_SEED + 1_000_003 * rank + step)


def _image_batches(batch_size: int, classes: int) -> Callable[[int, int], Batch]:
    def make_batch(rank: int, step: int) -> Batch:
        g = _generator(rank, step)
        x = torch.randn(batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, classes, (batch_size,), generator=g)
        return x, y

    return make_batch


def _conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class FCHeavyNet(nn.Module):
    """AlexNet/VGG-like: three conv stages (32x32 -> 4x4) then three big fully connected layers."""

    def __init__(self, widths: tuple[int, int, int], hidden: int, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for width in widths:
            layers += [nn.Conv2d(c_in, width, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            c_in = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(c_in * 4 * 4, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + BatchNorm, identity or 1x1-projection shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetLike(nn.Module):
    """CIFAR-style ResNet: stem, one stage of BasicBlocks per width (stride 2 from the second), GAP, FC."""

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn_relu(3, widths[0]))
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(c_in, width, stride=2 if i > 0 and j == 0 else 1))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class TinyLM(nn.Module):
    """Decoder-only language model: token + learned position embeddings, causal TransformerEncoder, LM head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        h = self.tokens(ids) + self.positions(torch.arange(seq, device=ids.device))
        return self.head(self.norm(self.encoder(h, mask=mask, is_causal=True)))


class CausalSelfAttention(nn.Module):
    """GPT-2's attention: one fused qkv Linear, causal scaled-dot-product attention, an output Linear."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTLike(nn.Module):
    """GPT-2-style decoder: token and position embeddings, pre-norm blocks, final LayerNorm, and the
    output projection tied to the token embedding (as GPT-2 does)."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(GPTBlock(d_model, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return F.linear(self.norm(self.blocks(h)), self.tokens.weight)


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        return build()


def fc_heavy(tiny: bool = False) -> Workload:
    """VGG-like CNN for 32x32x3, conv stack to 256x4x4 then FC 4096->4096->4096->10; batch 32."""
    widths, hidden = ((8, 16, 32), 256) if tiny else ((64, 128, 256), 4096)
    model = _seeded(lambda: FCHeavyNet(widths, hidden))
    return Workload(model, _image_batches(32, 10), F.cross_entropy, 32)


def resnet(tiny: bool = False) -> Workload:
    """Conv-dominated ResNet-like CNN (BasicBlocks with BatchNorm, widths 32..256); batch 32."""
    widths = (8, 16) if tiny else (32, 64, 128, 256)
    model = _seeded(lambda: ResNetLike(widths, blocks_per_stage=1 if tiny else 2))
    return Workload(model, _image_batches(32, 10), F.cross_entropy, 32)


def resnet18(tiny: bool = False) -> Workload:
    """Full-width ResNet-18 for 32x32 inputs (widths 64..512, two BasicBlocks per stage, ~11.2 M
    parameters); batch 32."""
    widths = (8, 16) if tiny else (64, 128, 256, 512)
    model = _seeded(lambda: ResNetLike(widths, blocks_per_stage=1 if tiny else 2))
    return Workload(model, _image_batches(32, 10), F.cross_entropy, 32)


def _token_batches(vocab: int, seq: int, batch: int) -> Callable[[int, int], Batch]:
    def make_batch(rank: int, step: int) -> Batch:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=_generator(rank, step))
        return ids[:, :-1], ids[:, 1:]

    return make_batch


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def transformer(tiny: bool = False) -> Workload:
    """Small causal transformer LM: vocab 2048, d_model 256, 4 heads, 2 layers, seq 64; batch 16."""
    vocab, d_model, layers, seq, batch = (256, 32, 1, 16, 16) if tiny else (2048, 256, 2, 64, 16)
    model = _seeded(lambda: TinyLM(vocab, d_model, heads=4, layers=layers, seq_len=seq))
    return Workload(model, _token_batches(vocab, seq, batch), _lm_loss, batch)


def gpt2(tiny: bool = False) -> Workload:
    """GPT-2-small-like LM: vocab 8192, d_model 512, 8 heads, 4 layers, seq 128, tied embeddings
    (~17 M parameters); batch 8."""
    vocab, d_model, heads, layers, seq, batch = (256, 32, 2, 1, 16, 8) if tiny else (8192, 512, 8, 4, 128, 8)
    model = _seeded(lambda: GPTLike(vocab, d_model, heads, layers, seq))
    return Workload(model, _token_batches(vocab, seq, batch), _lm_loss, batch)


class DeepMLP(nn.Module):
    """``depth`` blocks of Linear(width, width) + LayerNorm + ReLU, then a classifier: many small layers,
    where per-layer engine overhead shows."""

    def __init__(self, depth: int, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())
                                      for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _deep_mlp(depth: int) -> Callable[[bool], Workload]:
    def build_deep_mlp(tiny: bool = False) -> Workload:
        width, batch = (16, 8) if tiny else (64, 32)
        model = _seeded(lambda: DeepMLP(depth, width))

        def make_batch(rank: int, step: int) -> Batch:
            g = _generator(rank, step)
            return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)

        return Workload(model, make_batch, F.cross_entropy, batch)

    build_deep_mlp.__doc__ = f"{depth} Linear+LayerNorm blocks of width 64 (engine overhead); batch 32."
    return build_deep_mlp


def _off_cpu(build_workload: Callable[[bool], Workload], seconds: float,
             positions: int | None = None) -> Callable[[bool], Workload]:
    def build_off_cpu(tiny: bool = False) -> Workload:
        return off_cpu(build_workload(tiny), seconds / 10 if tiny else seconds, positions)

    build_off_cpu.__doc__ = (f"{build_workload.__name__} with its compute off the CPU (an emulated accelerator, "
                             f"{seconds} s per iteration: ``offcpu.py``); batch 1 computed for real.")
    return build_off_cpu


WORKLOADS: dict[str, Callable[[bool], Workload]] = {
    "fc_heavy": fc_heavy,
    "resnet": resnet,
    "transformer": transformer,
    "resnet18": resnet18,
    "gpt2": gpt2,
    "mlp50": _deep_mlp(50),
    "mlp200": _deep_mlp(200),
    # the same gradients, the compute waited for on an emulated accelerator (what one rank's CPU compute
    # took on the development machine: 0.72 s for gpt2, 0.82 s for resnet18), so the cores are the sync's
    "gpt2-offcpu": _off_cpu(gpt2, 0.72, positions=16),
    "resnet18-offcpu": _off_cpu(resnet18, 0.82),
    # the same with no compute waited for: an iteration is the sync's own time (and the one-sample compute)
    "gpt2-synconly": _off_cpu(gpt2, 0.0, positions=16),
    "resnet18-synconly": _off_cpu(resnet18, 0.0),
}
#: what ``--workload all`` runs: the paper-style workloads (the deep MLPs measure engine overhead)
MAIN_WORKLOADS = ("fc_heavy", "resnet", "transformer")


def build(name: str, tiny: bool = False) -> Workload:
    """The workload called ``name`` (a key of :data:`WORKLOADS`)."""
    return WORKLOADS[name](tiny)


def placed(workload: Workload, device: torch.device, batch_scale: int = 1) -> Workload:
    """``workload`` with its model on ``device`` and each step's batch made of ``batch_scale`` of its
    batches (those of steps ``step * batch_scale ...``, so still a function of ``(rank, step)``), moved
    there: a GPU-sized batch of the same data."""
    def make_batch(rank: int, step: int) -> Batch:
        parts = [workload.make_batch(rank, step * batch_scale + i) for i in range(batch_scale)]
        return tuple(torch.cat(column).to(device) for column in zip(*parts))

    return Workload(workload.model.to(device), make_batch, workload.loss_fn, workload.batch_size * batch_scale)


def profile(workload: Workload) -> dict:
    """Parameter bytes and the sufficient-factor shape ``(K, M, N, bias)`` of every nn.Linear that runs.

    K counts every row the layer sees in one forward of rank 0's first batch (batch x positions). Linear
    modules whose ``forward`` is bypassed (e.g. MultiheadAttention's out_proj) do not appear in ``linear``.
    """
    model = workload.model
    rows: dict[nn.Linear, int] = {}

    def count_rows(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        rows[module] = rows.get(module, 0) + inputs[0].numel() // module.in_features

    handles = [m.register_forward_pre_hook(count_rows) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(workload.make_batch(0, 0)[0])
    finally:
        for handle in handles:
            handle.remove()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "linear": [
            {"K": k, "M": m.out_features, "N": m.in_features, "bias": m.bias is not None,
             "bytes": sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))}
            for m, k in rows.items()
        ],
    }
