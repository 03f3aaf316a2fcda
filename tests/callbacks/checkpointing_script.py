"""Run on 2 ranks by tests/callbacks/test_activation_checkpointing.py: the tiny BERT with LoRA (dropout on) for 2 steps
under DDP and under native ZeRO stage 3 (FSDP2), each with and without ``ActivationCheckpointing``, in one process
group. Writes ``OUT/rank<r>.pt``: each run's trainable weights (gathered) and the modules checkpointed in its fit."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_peft._gather import gathered  # noqa: E402
from lightning_peft.callbacks import ActivationCheckpointing  # noqa: E402
from lightning_peft.nn import checkpointed_modules  # noqa: E402
from lightning_peft.peft import inject_lora  # noqa: E402
from lightning_peft.strategies import ZeROStrategy  # noqa: E402
from tests._models import LORA_ARGS, Classifier, bert_config, dataset  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402

STRATEGIES = {"ddp": lambda: "ddp", "native3": lambda: ZeROStrategy(stage=3, backend="native")}


class Module(Classifier):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(bert_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
        inject_lora(self.model, **{**LORA_ARGS, "dropout": 0.1})  # here, so every run starts from the same adapter

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=2, sampler=sampler)


class Probe(Callback):
    seen: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        Probe.seen = list(checkpointed_modules(pl_module))


def main(out: Path) -> None:
    result = {}
    for name, strategy in STRATEGIES.items():
        for kind in ("plain", "checkpointed"):
            pl.seed_everything(1, verbose=False)  # each rank draws its own dropout masks, the same in both kinds
            module = Module()
            callbacks = [Probe(), *([ActivationCheckpointing()] if kind == "checkpointed" else [])]
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_steps=2, logger=False,
                                 enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                 callbacks=callbacks, default_root_dir=out / name / kind)
            trainer.fit(module)
            with gathered(module):
                result[f"{name}/{kind}"] = {n: p.detach().clone() for n, p in module.named_parameters()
                                            if p.requires_grad}
            if kind == "checkpointed":
                result[f"{name}/seen"] = Probe.seen
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    torch.distributed.destroy_process_group()
    exit_worker()
