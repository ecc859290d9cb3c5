"""The time-to-accuracy tasks: real data that ships with the machine, a model, a loss and a validation metric.

- ``lm``: a byte-level causal language model (GPT-like, :class:`~poseidon_torch.bench.workloads.GPTLike` with
  a 256-byte vocabulary) on the Python standard library's own top-level ``.py`` sources. Files are split
  by a hash of their name (about one in ten is validation), so validation text is unseen; the training
  bytes are cut into non-overlapping windows of ``seq + 1`` bytes. Metric: validation loss in **bits per
  byte** on a fixed set of windows. ``lm-wide``: the same twice as wide at half the batch (3.3 M
  parameters, batch 8): four times the bytes per step, where a slow link shows.
- ``digits``: a small CNN with BatchNorm on scikit-learn's bundled handwritten digits
  (``sklearn.datasets.load_digits``: 1797 8x8 images, shipped inside the package); a fixed, seeded split of
  297 validation images. Metrics: validation cross-entropy (nats) and accuracy.

Invariants:
- Nothing is downloaded; the same Python installation gives the same bytes (the file list and byte counts
  go into the results, ``Task.data``).
- The model is built from a fixed seed, so every rank and every mode starts from the same weights; the
  training set is a ``Dataset`` that each rank reads through a ``DistributedSampler`` (its own shard).
- :meth:`Task.evaluate` is a pure function of the model's parameters and buffers (eval mode, no grad).
- ``tiny=True`` shrinks the model and the validation set for smoke tests; the data stay real.
"""
from __future__ import annotations

import math
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from poseidon_torch.bench.workloads import GPTLike
from poseidon_torch.extras import require

MODEL_SEED = 2017
SPLIT_SEED = 1701
VALIDATION_EVERY = 10  # lm: a file whose name hashes to 0 mod this is validation text


@dataclass
class Task:
    """One training problem. ``metric`` names the entry of :meth:`evaluate`'s result that is lower-is-better
    and judged (time to target); ``optimizer`` is the class and keyword arguments every mode uses."""
    name: str
    build_model: Callable[[], nn.Module]
    train_set: Dataset
    batch_size: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    metric: str
    optimizer: tuple[type, dict]
    data: dict = field(default_factory=dict)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(MODEL_SEED)
            return build()

    return seeded


# ---------------------------------------------------------------------------------------------- the LM task

def stdlib_sources() -> tuple[list[Path], list[Path]]:
    """(training files, validation files): the standard library's top-level ``.py`` files, split by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    validation = [f for f in files if zlib.crc32(f.name.encode()) % VALIDATION_EVERY == 0]
    training = [f for f in files if zlib.crc32(f.name.encode()) % VALIDATION_EVERY != 0]
    if not training or not validation:
        raise RuntimeError(f"the standard library at {root} has too few .py files for the lm task")
    return training, validation


def byte_windows(files: list[Path], length: int) -> torch.Tensor:
    """The files' bytes, joined, cut into non-overlapping windows of ``length`` bytes (uint8, one per row)."""
    stream = b"".join(f.read_bytes() for f in files)
    rows = len(stream) // length
    return torch.frombuffer(bytearray(stream[:rows * length]), dtype=torch.uint8).view(rows, length)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class ByteWindows(Dataset):
    """Windows of ``seq + 1`` bytes as (input ids, next-byte targets), int64."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index].long()
        return window[:-1], window[1:]


@torch.no_grad()
def _mean_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable,
               batch: int = 64) -> tuple[float, torch.Tensor]:
    """(mean loss over all rows, the logits' argmax of every row), the model in eval mode, restored after."""
    was_training = model.training
    model.eval()
    try:
        total, predictions = 0.0, []
        for start in range(0, inputs.shape[0], batch):
            logits = model(inputs[start:start + batch])
            total += loss_fn(logits, targets[start:start + batch]).item() * min(batch, inputs.shape[0] - start)
            predictions.append(logits.argmax(-1))
        return total / inputs.shape[0], torch.cat(predictions)
    finally:
        model.train(was_training)


def byte_gpt(d_model: int, heads: int, layers: int, seq: int) -> nn.Module:
    """GPT-like model over bytes, embeddings initialised as GPT-2's (std 0.02), so the tied output starts
    near the uniform 8 bits per byte."""
    model = GPTLike(256, d_model, heads, layers, seq)
    for embedding in (model.tokens, model.positions):
        nn.init.normal_(embedding.weight, std=0.02)
    return model


def lm(tiny: bool = False) -> Task:
    """Byte-level GPT-like LM on the stdlib's sources: d_model 128, 4 heads, 4 layers, seq 128, batch 16
    per rank (0.84 M parameters; tiny: d_model 32, 1 layer, seq 32)."""
    return _byte_lm("lm", (128, 4, 4, 128, 16), tiny)


def lm_wide(tiny: bool = False) -> Task:
    """The same LM twice as wide, at half the batch: d_model 256, 4 heads, 4 layers, seq 128, batch 8 per
    rank (3.3 M parameters: four times the bytes per step for half the samples, where a slow link shows;
    the model of issue 45's first measurements). Tiny: as ``lm``'s."""
    return _byte_lm("lm-wide", (256, 4, 4, 128, 8), tiny)


def _byte_lm(name: str, shape: tuple[int, int, int, int, int], tiny: bool) -> Task:
    """The byte-level LM task of ``shape`` = (d_model, heads, layers, seq, batch), AdamW lr 2e-3."""
    d_model, heads, layers, seq, batch = (32, 2, 1, 32, 8) if tiny else shape
    validation_rows = 32 if tiny else 256
    training, validation = stdlib_sources()
    train_windows = byte_windows(training, seq + 1)
    held_out = byte_windows(validation, seq + 1)
    picks = torch.linspace(0, held_out.shape[0] - 1, validation_rows).long()  # spread over every file
    val_in, val_out = held_out[picks, :-1].long(), held_out[picks, 1:].long()

    def evaluate(model: nn.Module) -> dict[str, float]:
        loss, _ = _mean_loss(model, val_in, val_out, _lm_loss)
        return {"val_loss": loss, "val_bits_per_byte": loss / math.log(2)}

    data = {"source": str(training[0].parent), "train_files": len(training), "validation_files": len(validation),
            "train_bytes": train_windows.numel(), "validation_windows": validation_rows, "seq": seq}
    return Task(name, _seeded(lambda: byte_gpt(d_model, heads, layers, seq)), ByteWindows(train_windows),
                batch, _lm_loss, evaluate, "val_bits_per_byte", (torch.optim.AdamW, dict(lr=2e-3, weight_decay=0.01)),
                data)


# ------------------------------------------------------------------------------------------ the digits task

class DigitsCNN(nn.Module):
    """Two conv + BatchNorm + ReLU stages on 8x8 images, a 2x2 max-pool, then two fully connected layers."""

    def __init__(self, width: int, hidden: int, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(2 * width * 16, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as (images N x 1 x 8 x 8 in [0, 1], labels N)."""
    digits = require("sklearn.datasets", "bench", "the digits task").load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.int64)


def digits(tiny: bool = False) -> Task:
    """Small CNN with BatchNorm on the 8x8 digits: widths 32 / 64, hidden 128, batch 32 per rank
    (tiny: widths 4 / 8, hidden 16); 1500 training and 297 validation images."""
    width, hidden = (4, 16) if tiny else (32, 128)
    images, labels = load_digits_tensors()
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(SPLIT_SEED))
    validation, training = order[:297], order[297:]

    def evaluate(model: nn.Module) -> dict[str, float]:
        loss, predicted = _mean_loss(model, images[validation], labels[validation], F.cross_entropy)
        return {"val_loss": loss, "val_accuracy": (predicted == labels[validation]).float().mean().item()}

    data = {"source": "sklearn.datasets.load_digits", "train_images": len(training),
            "validation_images": len(validation)}
    return Task("digits", _seeded(lambda: DigitsCNN(width, hidden)),
                TensorDataset(images[training], labels[training]), 32, F.cross_entropy, evaluate, "val_loss",
                (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)), data)


TASKS: dict[str, Callable[[bool], Task]] = {"lm": lm, "lm-wide": lm_wide, "digits": digits}
