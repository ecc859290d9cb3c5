"""The Hugging Face Trainer on PoseidonDDP: swap Trainer for PoseidonTrainer.

    torchrun --nproc_per_node 2 examples/hf_train.py [--server] [--steps 20]

A 2-layer GPT-2 (built from its config: nothing is downloaded) on synthetic token sequences that repeat a
pattern, so the loss falls. Gradient accumulation 2 and max_grad_norm 1.0, as Trainer does them; with
--server the Trainer's AdamW runs on the parameter-server shards (clipping at the owners).
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from poseidon_torch.integrations.hf import PoseidonTrainer


def dataset(rows: int = 512, length: int = 32, vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    ids = (start + torch.arange(length) * 3) % vocab  # a learnable pattern
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="store_true", help="ServerOptimizer: the shards apply the update")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                     max_steps=args.steps, learning_rate=3e-3, max_grad_norm=1.0, use_cpu=True,
                                     report_to=[], logging_steps=5, save_strategy="no", disable_tqdm=True)
        trainer = PoseidonTrainer(model=model, args=training, train_dataset=dataset(), server_optimizer=args.server)
        trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"loss: {losses[0]:.3f} after 5 steps, {losses[-1]:.3f} after {args.steps} "
              f"({'ServerOptimizer' if args.server else 'AdamW'} on PoseidonDDP)")


if __name__ == "__main__":
    main()
