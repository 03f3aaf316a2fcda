"""Run on 2 ranks by tests/strategies/test_zero.py: the same LoRA and full fine-tuning fits under DDP and every ZeRO
stage and backend, in one process group (a launch costs more than a tiny fit).

Usage: ``python zero_script.py OUT CASE [CASE ...]`` on each rank, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK and NODE_RANK set as torchrun sets them. A case is a strategy name of ``STRATEGIES``, or
``multinode:<name>`` (the launcher then starts two one-device "nodes"). Per case, in ``OUT/<case>/``:

- ``lora/``: LoRA for 2 epochs of 5 optimizer steps, an adapter-only checkpoint after each epoch and
  ``MergeOnSave(every_checkpoint=True)`` exports (``export/step=5``, ``step=10``, then the final one);
- ``resumed/``: the same run resumed from the first epoch's checkpoint, its final export;
- ``test-losses.json``: ``trainer.test`` of the first epoch's checkpoint and of the final weights;
- ``logits.pt``: the straight LoRA run's outputs on ``PROBE``, computed by the sharded model;
- ``full/``: full fine-tuning for one epoch, a full checkpoint at the end; ``full-weights.pt``: its weights,
  gathered;
- ``memory-{lora,full}-rank<r>.json``: :func:`rank_bytes` of each rank during the 3rd step (see ``MemoryProbe``).

The case ``accumulation`` runs every strategy with accumulation (``ACCUMULATION``) into ``OUT/accumulation/``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

from lightning_peft._gather import gathered  # noqa: E402
from lightning_peft.callbacks import GradientAccumulation, LoRA, MergeOnSave  # noqa: E402
from lightning_peft.peft import LoRAConfig, adapter_state_dict, inject_lora  # noqa: E402
from lightning_peft.strategies import ZeROStrategy  # noqa: E402
from lightning_peft.parallel.memory import rank_bytes  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["query", "value"], "modules_to_save": ["classifier"]}
# DeepSpeed stage 3 leaves tensors under 1e5 elements whole unless told: this model's are all smaller.
STRATEGIES = {
    "ddp": lambda: "ddp",
    "deepspeed1": lambda: ZeROStrategy(stage=1),
    "deepspeed2": lambda: ZeROStrategy(stage=2),
    "deepspeed3": lambda: ZeROStrategy(stage=3, stage3_param_persistence_threshold=0),
    "native1": lambda: ZeROStrategy(stage=1, backend="native"),
    "native2": lambda: ZeROStrategy(stage=2, backend="native"),
    "native3": lambda: ZeROStrategy(stage=3, backend="native"),
}
PROBE = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(2))  # inputs for the outputs check
SAMPLES, BATCH = 40, 4  # per rank: 20 samples, 5 batches, 5 optimizer steps an epoch


def config() -> BertConfig:
    return BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 128, (SAMPLES, 8), generator=generator),
                         torch.randint(0, 3, (SAMPLES,), generator=generator))


class Classifier(pl.LightningModule):
    """A tiny BERT classifier whose optimizer is built over ``self.parameters()``, frozen ones included (the
    strategies must keep those out of the engine)."""

    def __init__(self, lora: bool, lr: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BertForSequenceClassification(config())
        if lora:  # injected here, not at setup, so every strategy starts from the same adapter
            inject_lora(self.model, LoRAConfig(**LORA))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def test_step(self, batch, batch_idx):
        ids, labels = batch
        self.log("test_loss", self.model(input_ids=ids, labels=labels).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=BATCH)  # every rank tests on everything: the mean is the same

    def train_dataloader(self) -> DataLoader:
        # Unshuffled round robin: rank r gets samples r, r + 2, ...: the same split under every strategy.
        world, rank = self.trainer.world_size, self.trainer.global_rank
        dataset = data()
        return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, world, rank, shuffle=False))


class MemoryProbe(Callback):
    """``rank_bytes`` around the third step: gradients just before the optimizer step (engines free them after it),
    the rest right after the step (at rest), and ``parameters_in_step``: the parameters held between forward and
    backward (FSDP2 keeps them gathered there at stage 2, not at stage 3)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.measured: dict[str, int] = {}

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == 2:
            self.measured["parameters_in_step"] = rank_bytes(pl_module, trainer.optimizers)["parameters"]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            self.measured["gradients"] = rank_bytes(pl_module, trainer.optimizers)["gradients"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3 and "optimizer_state" not in self.measured:
            after = rank_bytes(pl_module, trainer.optimizers)
            self.measured.update({k: v for k, v in after.items() if k != "gradients"})
            self.path.write_text(json.dumps(self.measured))


def trainer(strategy, out: Path, epochs: int, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", strategy=strategy, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out, use_distributed_sampler=False, callbacks=callbacks,
        **{"devices": 2, **kwargs},
    )


def lora_callbacks(out: Path) -> list:
    return [LoRA(**LORA, adapter_only_checkpoint=True),
            MergeOnSave(dirpath=str(out / "export"), every_checkpoint=True, save_merged=False)]


def run_case(out: Path, name: str, **trainer_kwargs) -> None:
    make, rank = STRATEGIES[name], int(os.environ["RANK"])
    # LoRA: two epochs, a checkpoint (and an export) after each.
    checkpoints = ModelCheckpoint(dirpath=out / "lora" / "ckpt", save_top_k=-1, every_n_epochs=1)
    probe = MemoryProbe(out / f"memory-lora-rank{rank}.json")
    module = Classifier(lora=True)
    fit = trainer(make(), out / "lora", 2, [*lora_callbacks(out / "lora"), checkpoints, probe], **trainer_kwargs)
    fit.fit(module)
    # The trained model's outputs, computed by the sharded model itself (every rank takes part).
    with torch.no_grad(), gathered(module):
        logits = module.model.eval()(input_ids=PROBE).logits
    if rank == 0:
        torch.save(logits, out / "logits.pt")
    if not trainer_kwargs:  # evaluation from the first epoch's checkpoint, and from the final weights
        first = sorted((out / "lora" / "ckpt").glob("epoch=0*"))[0]
        # Final weights first: testing a checkpoint loads it into the module.
        losses = [fit.test(module, ckpt_path=path, verbose=False)[0]["test_loss"] for path in (None, first)][::-1]
        if rank == 0:
            (out / "test-losses.json").write_text(json.dumps(losses))
    if trainer_kwargs:  # the multi-node launch checks the straight run only
        return
    # Resumed from the first epoch's checkpoint (adapter-only: the frozen base comes from the module as built).
    first = sorted((out / "lora" / "ckpt").glob("epoch=0*"))[0]
    trainer(make(), out / "resumed", 2, lora_callbacks(out / "resumed"), enable_checkpointing=False).fit(
        Classifier(lora=True), ckpt_path=first)
    # Full fine-tuning: memory, and a full checkpoint that a single process must load.
    full = ModelCheckpoint(dirpath=out / "full" / "ckpt", filename="full")
    module = Classifier(lora=False)
    trainer(make(), out / "full", 1, [full, MemoryProbe(out / f"memory-full-rank{rank}.json")]).fit(module)
    with gathered(module):
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if rank == 0:
        torch.save(state, out / "full-weights.pt")


class GroupedClassifier(Classifier):
    """Warm-up then constant LR (SequentialLR chains two schedulers) over two groups, the first all frozen
    parameters under LoRA (a no-decay group of biases and norms): both must survive ZeroRedundancyOptimizer."""

    def configure_optimizers(self):
        frozen = [p for n, p in self.named_parameters() if n.endswith("bias") and not p.requires_grad]
        rest = [p for p in self.parameters() if all(p is not q for q in frozen)]
        optimizer = torch.optim.AdamW([{"params": frozen, "weight_decay": 0.0}, {"params": rest}], lr=self.lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
        constant = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=1)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, constant], milestones=[3])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LearningRates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[-1]["lr"])


class MoEModule(pl.LightningModule):
    """A decoder whose layers hold an inner ModuleList (the experts): FSDP2 units must be sharded deepest first."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_peft.nn import TransformerDecoder

        torch.manual_seed(0)
        self.decoder = TransformerDecoder(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2,
                                          moe={"num_experts": 2, "top_k": 1})

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        logits = self.decoder(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    train_dataloader = Classifier.train_dataloader


def run_regressions(out: Path) -> None:
    """Native ZeRO-1 with chained schedulers and an empty group, native ZeRO-3 with nested ModuleLists: each as
    DDP gives (learning rates and adapter; weights)."""
    rank = int(os.environ["RANK"])
    result = {}
    for name in ("ddp", "native1"):
        rates, module = LearningRates(), GroupedClassifier(lora=True)
        trainer(STRATEGIES[name](), out / name, 1, [LoRA(**LORA), rates], enable_checkpointing=False).fit(module)
        result[name] = {"rates": rates.rates, "adapter": adapter_state_dict(module.model)}
    for name in ("ddp", "native3"):
        module = MoEModule()
        trainer(STRATEGIES[name](), out / name, 1, [], enable_checkpointing=False, max_steps=2).fit(module)
        with gathered(module):
            result[f"moe-{name}"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "regressions.pt")


class ScheduledClassifier(Classifier):
    """AdamW under a per-step linear decay: the learning rate tells whose steps the scheduler follows."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=10)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class Stream:
    """The rank's micro-batches without a len(): an epoch of unknown length."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


class StreamingClassifier(ScheduledClassifier):
    def train_dataloader(self):
        return Stream(super().train_dataloader())


# Accumulation runs: 2 epochs of 5 micro-batches per rank. Lightning's count 2 gives windows 2, 2, 1 per epoch (the
# last one short, not aligned with the epoch); the changing schedule 1, 1, then 2 from step 2, then 3 from step 4;
# the stream (count 3) 3, then 2 cut short by the stream's end (the first two micro-batches rescaled by 3 / 2).
ACCUMULATION = {
    "lightning": lambda: ({"accumulate_grad_batches": 2}, [], ScheduledClassifier),
    "schedule": lambda: ({}, [GradientAccumulation(schedule={0: 1, 2: 2, 4: 3}, log=False)], ScheduledClassifier),
    "global-batch": lambda: ({}, [GradientAccumulation(global_batch_size=16, log=False)], ScheduledClassifier),
    "stream": lambda: ({}, [GradientAccumulation(schedule=3, log=False)], StreamingClassifier),
}


def run_accumulation(out: Path) -> None:
    """Every strategy with accumulation (Lightning's count, a changing schedule, a target global batch, a stream whose
    end cuts a window short): the adapter,
    the learning rate of every micro-batch and the number of optimizer steps; or the error a strategy refuses with."""
    rank = int(os.environ["RANK"])
    result: dict[str, dict] = {}
    for name, make in STRATEGIES.items():
        for kind, settings in ACCUMULATION.items():
            kwargs, callbacks, module_class = settings()
            rates, module = LearningRates(), module_class(lora=True)
            fit = trainer(make(), out / name / kind, 2, [*callbacks, rates], enable_checkpointing=False, **kwargs)
            try:
                fit.fit(module)
            except RuntimeError as error:  # refused at setup (on every rank alike)
                result[f"{name}/{kind}"] = {"error": str(error)}
                continue
            with gathered(module):
                state = {k: v.detach().clone() for k, v in adapter_state_dict(module.model).items()}
            result[f"{name}/{kind}"] = {"adapter": state, "rates": rates.rates, "steps": fit.global_step}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "accumulation.pt")


def main(out: Path, cases: list[str]) -> None:
    for case in cases:
        if case == "regressions":
            run_regressions(out / case)
        elif case == "accumulation":
            run_accumulation(out / case)
        elif case.startswith("multinode:"):
            run_case(out / case.replace(":", "-"), case.split(":", 1)[1], devices=1, num_nodes=2)
        else:
            run_case(out / case, case)


MULTINODE = ["deepspeed3", "native3"]


def run(out: Path) -> None:
    """The job ``zero`` of ``tests/_two_ranks.py``: every strategy, the regressions and accumulation on one node of 2
    devices, then ``MULTINODE`` as 2 nodes of one device (the same 2 processes and process group: only what
    Lightning reads, ``LOCAL_RANK`` and ``NODE_RANK``, changes)."""
    main(out, [*STRATEGIES, "regressions", "accumulation"])
    saved = {key: os.environ[key] for key in ("LOCAL_RANK", "NODE_RANK")}
    os.environ.update(LOCAL_RANK="0", NODE_RANK=os.environ["RANK"])
    try:
        main(out, [f"multinode:{name}" for name in MULTINODE])
    finally:
        os.environ.update(saved)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    exit_worker()
