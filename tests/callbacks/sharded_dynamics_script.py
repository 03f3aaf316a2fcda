"""Run on 2 ranks by tests/callbacks/test_sharded_dynamics.py: LoRA + GradientNoise and LoRA + LayerwiseLRDecay under
DDP, every ZeRO stage and backend and tensor parallelism, in one process group (a launch costs more than a fit).

Usage: ``python sharded_dynamics_script.py OUT STRATEGY [STRATEGY ...]`` on each rank, with MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK and LOCAL_RANK set as torchrun sets them. For each strategy and each case (``noise``, ``llrd``)
rank 0 writes ``OUT/<strategy>-<case>.pt``: the trained adapter (gathered), or ``OUT/<strategy>-<case>.error``: the
exception it raised (the next fits still run, so that one launch shows every cell). Under DDP it also writes
``without-<case>``: the same fit without the technique.

Every fit sees the same data as DDP's: 32 samples, 8 per optimizer step (4 steps); a data-parallel rank reads
every other sample, tensor parallelism (one data-parallel replica) reads all 8 at once.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

from lightning_peft._gather import gathered  # noqa: E402
from lightning_peft._seams import data_parallel  # noqa: E402
from lightning_peft.callbacks import GradientNoise, LayerwiseLRDecay, LoRA  # noqa: E402
from lightning_peft.peft import LoRAConfig, adapter_state_dict, inject_lora  # noqa: E402
from lightning_peft.strategies import TensorParallelStrategy, ZeROStrategy  # noqa: E402
from tests.strategies.zero_script import LORA, config  # noqa: E402

STRATEGIES = {
    "ddp": lambda: "ddp",
    "deepspeed1": lambda: ZeROStrategy(stage=1),
    "deepspeed2": lambda: ZeROStrategy(stage=2),
    "deepspeed3": lambda: ZeROStrategy(stage=3, stage3_param_persistence_threshold=0),
    "native1": lambda: ZeROStrategy(stage=1, backend="native"),
    "native2": lambda: ZeROStrategy(stage=2, backend="native"),
    "native3": lambda: ZeROStrategy(stage=3, backend="native"),
    "tp": lambda: TensorParallelStrategy(tensor_parallel_size=2),
}
SAMPLES, STEP_BATCH = 32, 8  # 4 optimizer steps of 8 samples


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 128, (SAMPLES, 8), generator=generator),
                         torch.randint(0, 3, (SAMPLES,), generator=generator))


class Classifier(pl.LightningModule):
    """A tiny BERT with LoRA injected here (every strategy starts from the same adapter); AdamW over
    ``self.parameters()``, frozen ones included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BertForSequenceClassification(config())
        inject_lora(self.model, LoRAConfig(**LORA))
        with torch.no_grad():  # B starts at zero: give it values, so that A's gradients (and noise) matter
            generator = torch.Generator().manual_seed(4)
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        size, rank = data_parallel(self.trainer.strategy)
        dataset = data()  # unshuffled round robin: data-parallel rank r reads samples r, r + size, ...
        return DataLoader(dataset, batch_size=STEP_BATCH // size,
                          sampler=DistributedSampler(dataset, size, rank, shuffle=False))


class ExistingProject(Classifier):
    """``configure_optimizers`` as many projects write it: every parameter grouped by name (frozen ones too), AdamW,
    and a linear warm-up and decay over ``trainer.estimated_stepping_batches``, stepped every optimizer step (as
    ``transformers.get_linear_schedule_with_warmup`` does)."""

    def configure_optimizers(self):
        no_decay = ["bias", "LayerNorm.weight"]
        named = list(self.named_parameters())
        groups = [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=0.02)
        total, warmup = self.trainer.estimated_stepping_batches, 1

        def linear(step: int) -> float:
            return (step + 1) / (warmup + 1) if step < warmup else max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


CASES = {
    "noise": (Classifier, lambda: [LoRA(**LORA), GradientNoise(eta=0.01, seed=3)]),
    "llrd": (ExistingProject, lambda: [LoRA(**LORA), LayerwiseLRDecay(decay=0.5)]),
}
# Under DDP only: the same fits without the technique, to show it acts.
WITHOUT = {"noise": (Classifier, lambda: [LoRA(**LORA)]), "llrd": (ExistingProject, lambda: [LoRA(**LORA)])}


def run(out: Path, strategy: str, case: str) -> None:
    make_module, callbacks = CASES[case] if not case.startswith("without-") else WITHOUT[case.split("-", 1)[1]]
    module = make_module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_epochs=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, default_root_dir=out / "runs", callbacks=callbacks(),
    )
    trainer.fit(module)
    with torch.no_grad(), gathered(module):
        adapter = {k: v.detach().clone() for k, v in adapter_state_dict(module.model).items()}
    if int(os.environ["RANK"]) == 0:
        torch.save({"adapter": adapter, "steps": trainer.global_step}, out / f"{strategy}-{case}.pt")


def main(out: Path, strategies: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for strategy in strategies:
        for case in [*CASES, *(f"without-{c}" for c in WITHOUT if strategy == "ddp")]:
            try:
                run(out, strategy, case)
            except Exception:  # noqa: BLE001 - recorded for the test, which fails on it
                if int(os.environ["RANK"]) == 0:
                    (out / f"{strategy}-{case}.error").write_text(traceback.format_exc())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
