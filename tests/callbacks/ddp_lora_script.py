"""Run by tests/callbacks/test_lora_ddp.py: LoRA + MergeOnSave under a real Lightning Trainer.

Usage: python ddp_lora_script.py OUT_DIR DEVICES BATCH_SIZE. With DEVICES=2 Lightning's DDP launcher starts a
second process (gloo on CPU) by re-running this script. Every rank saves its adapter to OUT_DIR/rank<N>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from transformers import BertConfig  # noqa: E402

from lightning_peft.callbacks import GradientNoise, LoRA, MergeOnSave  # noqa: E402
from lightning_peft.peft import adapter_state_dict  # noqa: E402
from tests.callbacks.test_lora import LORA_ARGS, Classifier  # noqa: E402


class RoundRobinData(pl.LightningDataModule):
    """Unshuffled round-robin split across ranks: ranks 0 and 1 together see exactly the samples of one
    single-process batch of twice the size (Lightning's own distributed sampler would shuffle)."""

    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


def main(out: Path, devices: int, batch_size: int) -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    module = Classifier(config)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 64, (16, 8), generator=generator), torch.randint(0, 3, (16,), generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, use_distributed_sampler=False,
        callbacks=[
            LoRA(**LORA_ARGS, adapter_only_checkpoint=True),
            GradientNoise(eta=0.01, seed=3),  # the same draw on every rank: replicas must stay identical
            export := MergeOnSave(dirpath=str(out / "export")),
            ModelCheckpoint(dirpath=out / "ckpt", save_last=True),
        ],
    )
    trainer.fit(module, datamodule=RoundRobinData(data, batch_size))
    torch.save(adapter_state_dict(module.model), out / f"rank{trainer.global_rank}.pt")
    (out / f"export-rank{trainer.global_rank}.txt").write_text(repr(sorted(export.last_export)))
    if devices > 1:  # an export that fails on rank 0 must reach every rank, not leave one waiting
        failing = FailsOnRankZero(dirpath=str(out / "failing"))
        try:
            failing.export(trainer, module, out / "failing")
            outcome = "no error"
        except Exception as err:
            outcome = f"{type(err).__name__}: {err}"
        (out / f"failing-rank{trainer.global_rank}.txt").write_text(outcome)


class FailsOnRankZero(MergeOnSave):
    def _write(self, trainer, pl_module, directory):
        raise OSError("No space left on device")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    # Tear the gloo group down before the interpreter exits: left to interpreter shutdown, its threads were seen
    # to abort the process ("terminate called without an active exception") after all work had finished.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
