"""Run by tests/callbacks/test_curriculum_ddp.py: the Curriculum callback under a real 2-process DDP Trainer.

Usage: python ddp_curriculum_script.py OUT_DIR. Lightning's DDP launcher starts rank 1 (gloo on CPU) by
re-running this script. Every rank saves the sample indices it trained on, batch by batch, to
OUT_DIR/rank<N>.pt, then scores with a scorer that fails on rank 0 and writes what each rank raised to
OUT_DIR/failing-rank<N>.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_peft.callbacks import Curriculum

SAMPLES, BATCH_SIZE, DURATION = 16, 2, 4  # 4 batches per rank and epoch: epoch 0 paces, epoch 1 has all


def token_sum(sample) -> float:
    return float(sample[0].sum())


def nan_score(sample) -> float:
    return float("nan")


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 4), nn.Linear(4, 2)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, labels, index = batch
        self.seen.append(index.tolist())
        return nn.functional.cross_entropy(self.head(self.embed(ids).mean(1)), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 32, (SAMPLES, 4), generator=generator),
                         torch.randint(0, 2, (SAMPLES,), generator=generator), torch.arange(SAMPLES))
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    module = Recorder()
    curriculum = Curriculum(duration=DURATION, scorer=token_sum, start_fraction=0.25, seed=5)
    trainer = pl.Trainer(  # use_distributed_sampler stays on: the callback must keep Lightning's sampler out
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out, callbacks=[curriculum],
    )
    trainer.fit(module, loader)
    rank = trainer.global_rank
    torch.save({"seen": module.seen, "scores": curriculum.scores}, out / f"rank{rank}.pt")
    curriculum.scores, curriculum.scoring_function = None, nan_score  # failing on rank 0 stops every rank
    try:
        curriculum._scores(loader, trainer, module)
        outcome = "no error"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    (out / f"failing-rank{rank}.txt").write_text(outcome)


def run(out: Path) -> None:
    """The job ``curriculum_ddp`` of ``tests/_two_ranks.py`` (2 ranks started for it)."""
    main(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
