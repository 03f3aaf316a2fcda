"""The compatibility matrix: every callback (a row) under every strategy (a column), on a LightningModule written
the way existing projects write them, not for this library.

A cell trains a few optimizer steps and exports what it trained with ``MergeOnSave`` (the adapter in its file
format; with the merged model in the MergeOnSave row), and records the validation metrics and how far training
got. A cell has two allowed outcomes: equal to the reference (one process, the same global batch: data-parallel
columns split it over the ranks, tensor and pipeline parallelism give every rank of a group the same batch), or
refused at setup (an error before the first batch). ``test_matrix.py`` checks which; ``page.py`` writes
``docs/compatibility.md`` from the outcomes.

Everything here runs both in the pytest process (the one-process columns) and on 2 gloo ranks
(``matrix_script.py``), so it only builds objects: no launch, no assertion.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_peft._seams import data_parallel
from lightning_peft.callbacks import (
    IA3,
    BOFT,
    OFT,
    ActivationCheckpointing,
    AdaLoRA,
    BottleneckAdapters,
    Curriculum,
    GradientAccumulation,
    GradientNoise,
    LayerwiseLRDecay,
    LoHa,
    LoKr,
    LoRA,
    MergeOnSave,
    MultiLoRA,
    PrefixTuning,
    PromptTuning,
    PTuning,
    TokenPruning,
    VeRA,
)
from tests.matrix import kinds
from tests.matrix.sft import PackedSFT

SAMPLES, VAL_SAMPLES, BATCH, LENGTH, VOCAB = 24, 6, 4, 8, 64  # 6 global batches of 4 an epoch; the last val batch is short
STEPS = 6  # micro-batches trained per cell (one epoch)


# ------------------------------------------------------------------------------------------------ the module


class Batches(Dataset):
    """Dict samples of varied length (padding at the end): token ids, mask, label and an adapter id."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (count, LENGTH), generator=generator)
        lengths = torch.randint(3, LENGTH + 1, (count,), generator=generator)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        self.ids = self.ids * self.mask  # pad token 0
        self.labels = torch.randint(0, 3, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index],
                "adapter": torch.tensor(index % 2)}


def bert(dropout: float):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(config)


class PeerClassifier(pl.LightningModule):
    """A classifier as existing projects write one: the model built in ``__init__``, every parameter grouped by
    name in ``configure_optimizers`` (frozen ones too), a linear warm-up schedule over
    ``trainer.estimated_stepping_batches`` stepped per step, a torchmetrics accuracy and ``sync_dist`` logging.

    ``kind="bert"``: a tiny Hugging Face ``BertForSequenceClassification`` at ``self.model``; ``kind="encoder"``:
    the project's ``TransformerEncoder`` at ``self.encoder`` and a linear ``self.head`` (what the pipeline cuts and
    token pruning lives in); ``"mha"`` and ``"moe"``: `tests.matrix.kinds` at ``self.model``.
    """

    def __init__(self, kind: str = "bert", dropout: float = 0.0, batch_size: int = BATCH, fused: bool = False) -> None:
        super().__init__()
        import torchmetrics

        torch.manual_seed(0)
        self.kind, self.batch_size, self.fused = kind, batch_size, fused
        if kind == "bert":
            self.model = bert(dropout)
        elif kind != "encoder":
            self.model = kinds.model(kind, VOCAB, dropout)
        else:
            from lightning_peft.nn import TransformerEncoder

            self.encoder = TransformerEncoder(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                              ffn_size=32, max_position_embeddings=32, dropout=dropout,
                                              attention_dropout=dropout, pooler=False)
            self.head = nn.Linear(16, 3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.kind != "encoder":
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return getattr(out, "logits", out)
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])  # (B, L, H)
        return self.head(hidden[:, 0])  # (B, 3)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch), batch["labels"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch)
        self.log("val_loss", nn.functional.cross_entropy(logits, batch["labels"]), sync_dist=True,
                 batch_size=len(batch["labels"]))
        self.val_acc.update(logits.argmax(-1), batch["labels"])
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        from transformers import get_linear_schedule_with_warmup

        no_decay = ["bias", "LayerNorm.weight", "norm.weight"]
        named = list(self.named_parameters())
        groups = [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=self.fused or None)
        scheduler = get_linear_schedule_with_warmup(optimizer, 1, self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        # Lightning gives a data-parallel run a shuffling DistributedSampler: the same one on one process too, so
        # that every strategy trains on the same global batches.
        replicas, rank = data_parallel(self.trainer.strategy)
        dataset = Batches(SAMPLES, 1)
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self):
        return DataLoader(Batches(VAL_SAMPLES, 2), batch_size=self.batch_size)


# ------------------------------------------------------------------------------------------------ rows, columns


def _targets(kind: str) -> dict[str, Any]:
    if kind == "sft":  # HFCausalLM's Llama: nothing to save in full (its head is the pretrained lm_head)
        return {"target_modules": ["q_proj", "v_proj"]}
    if kind == "bert":
        return {"target_modules": ["query", "value"], "modules_to_save": ["classifier"]}
    if kind == "mha":
        return {"target_modules": ["self_attn"], "modules_to_save": ["head"]}
    return {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["score" if kind == "moe" else "head"]}


def _lora(kind: str, dropout: float = 0.0, **kwargs: Any) -> LoRA:
    return LoRA(rank=4, alpha=8.0, dropout=dropout, **_targets(kind), **kwargs)


def _ia3(kind: str) -> IA3:
    """Keys, values and the second feed-forward layer, whose input is scaled (the paper's placement)."""
    second = {"bert": "output.dense", "encoder": "down_proj"}[kind]  # BERT's: attention.output.dense scaled too
    first = ["key", "value"] if kind == "bert" else ["k_proj", "v_proj"]
    return IA3(target_modules=[*first, second], feedforward_modules=[second],
               modules_to_save=_targets(kind)["modules_to_save"])


@dataclass(frozen=True)
class Row:
    """A callback (with LoRA where it needs adapters to act on) and the model it runs on."""

    name: str
    callbacks: Callable[[str], list[Callback]]  # kind -> callbacks
    kind: str = "bert"
    save_merged: bool = False
    adapter_name: str | None = None
    fused: bool = False  # AdamW(fused=True), as many existing projects build it
    changes_training: bool = True  # False: it must train exactly what LoRA alone trains (it saves memory only)


def length(sample: dict[str, torch.Tensor]) -> float:
    """A curriculum score: the number of real tokens (short is easy)."""
    return float(sample["attention_mask"].sum())


def _all_in_one(kind: str, dropout: float = 0.0) -> list[Callback]:
    return [_lora(kind, dropout), LayerwiseLRDecay(decay=0.7), GradientAccumulation(global_batch_size=2 * BATCH),
            Curriculum(duration=3, scorer="tests.matrix.cells.length", start_fraction=0.5), GradientNoise(eta=1e-3)]


ROWS = [
    Row("LoRA", lambda kind: [_lora(kind)]),
    Row("LoRA, AdamW(fused=True)", lambda kind: [_lora(kind)], fused=True),
    Row("MultiLoRA", lambda kind: [MultiLoRA(
        adapters={"a": {"rank": 4, "target_modules": _targets(kind)["target_modules"]},
                  "b": {"rank": 2, "alpha": 4.0, "target_modules": _targets(kind)["target_modules"]}},
        routing_key="adapter", modules_to_save=_targets(kind)["modules_to_save"])], adapter_name="a"),
    Row("BottleneckAdapters", lambda kind: [BottleneckAdapters(bottleneck_size=4, init_scale=0.1)]),
    Row("PromptTuning", lambda kind: [PromptTuning(num_virtual_tokens=3)]),
    Row("PrefixTuning", lambda kind: [PrefixTuning(num_virtual_tokens=3)]),
    # the other PEFT methods
    Row("IA3", lambda kind: [_ia3(kind)]),
    Row("LoHa", lambda kind: [LoHa(r=2, alpha=4, **_targets(kind))]),
    Row("LoKr", lambda kind: [LoKr(r=2, alpha=4.0, decompose_both=True, **_targets(kind))]),
    Row("VeRA", lambda kind: [VeRA(rank=8, **_targets(kind))]),
    Row("AdaLoRA", lambda kind: [AdaLoRA(**_targets(kind), init_r=4, target_r=2, tinit=1, tfinal=1)]),  # masks at 2-5
    Row("PTuning", lambda kind: [PTuning(num_virtual_tokens=3, encoder_hidden_size=8)]),
    Row("OFT", lambda kind: [OFT(oft_block_size=4, **_targets(kind))]),
    Row("BOFT", lambda kind: [BOFT(boft_block_size=4, boft_n_butterfly_factor=2, **_targets(kind))]),
    Row("MergeOnSave", lambda kind: [_lora(kind)], save_merged=True),
    Row("GradientNoise", lambda kind: [_lora(kind), GradientNoise(eta=1e-3)]),
    Row("LayerwiseLRDecay", lambda kind: [_lora(kind), LayerwiseLRDecay(decay=0.5)]),
    Row("GradientAccumulation(schedule)", lambda kind: [_lora(kind), GradientAccumulation(schedule={0: 1, 2: 2})]),
    Row("GradientAccumulation(global_batch_size)",
        lambda kind: [_lora(kind), GradientAccumulation(global_batch_size=2 * BATCH)]),
    Row("Curriculum", lambda kind: [_lora(kind), Curriculum(duration=4, scorer="tests.matrix.cells.length",
                                                            start_fraction=0.5)]),
    Row("TokenPruning", lambda kind: [_lora(kind), TokenPruning(keep_ratio=0.5, start_layer=0, anneal_fraction=0.0)],
        kind="encoder"),
    Row("DoRA", lambda kind: [_lora(kind, use_dora=True)]),
    Row("QLoRA (NF4 base)", lambda kind: [_lora(kind, quantize="nf4")]),
    Row("ActivationCheckpointing", lambda kind: [_lora(kind), ActivationCheckpointing()], changes_training=False),
    Row("all-in-one", _all_in_one),
    # LoRA's targets and options that a strategy may treat differently (docs/lora.md has a section on each)
    Row("LoRA on nn.MultiheadAttention", lambda kind: [_lora(kind)], kind="mha"),
    Row("LoRA on MoE experts (target_parameters)", lambda kind: [_lora(
        kind, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])], kind="moe"),
    Row("LoRA, trainable_token_indices", lambda kind: [_lora(kind, trainable_token_indices={"word_embeddings": [5, 7]})]),
    # layer 1: under the pipeline the first stage has nothing to train (its optimizer holds only frozen weights)
    Row("LoRA+, lora_bias, PiSSA, layers_to_transform", lambda kind: [_lora(
        kind, loraplus_lr_ratio=4.0, lora_bias=True, init="pissa", layers_to_transform=[1])]),
    # another LightningModule: HFCausalLM on packed SFT batches, a different number of target tokens on each rank
    Row("HFCausalLM + LoRA, packed SFT batches", lambda kind: [_lora(kind)], kind="sft"),
]


def _deepspeed(stage: int) -> Callable[[], Any]:
    def make():
        from lightning_peft.strategies import ZeROStrategy

        options = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        return ZeROStrategy(stage=stage, **options)

    return make


def _native(stage: int) -> Callable[[], Any]:
    def make():
        from lightning_peft.strategies import ZeROStrategy

        return ZeROStrategy(stage=stage, backend="native")

    return make


def _tensor_parallel():
    from lightning_peft.strategies import TensorParallelStrategy

    return TensorParallelStrategy(tensor_parallel_size=2)


def _pipeline():
    from lightning_peft.strategies import PipelineStrategy

    return PipelineStrategy(num_stages=2, num_microbatches=2, schedule="gpipe")


def _device_map():
    from lightning_peft.strategies import DeviceMapStrategy

    return DeviceMapStrategy(devices=["cpu", "cpu"])


@dataclass(frozen=True)
class Column:
    """A strategy: how to make it, on how many processes, and how many distinct batches a step sees."""

    name: str
    make: Callable[[], Any]
    devices: int
    data_parallel: int
    family: str  # where gradients live, for the resume check: plain, deepspeed, dtensor, or "" (not checked)


COLUMNS = [
    Column("one process", lambda: "auto", 1, 1, "plain"),
    Column("DDP", lambda: "ddp", 2, 2, "plain"),
    Column("ZeRO-1 DeepSpeed", _deepspeed(1), 2, 2, ""),
    Column("ZeRO-2 DeepSpeed", _deepspeed(2), 2, 2, "deepspeed"),
    Column("ZeRO-3 DeepSpeed", _deepspeed(3), 2, 2, ""),
    Column("ZeRO-1 native", _native(1), 2, 2, ""),
    Column("ZeRO-2 native", _native(2), 2, 2, ""),
    Column("ZeRO-3 native", _native(3), 2, 2, "dtensor"),
    Column("tensor parallel", _tensor_parallel, 2, 1, ""),
    Column("pipeline", _pipeline, 2, 1, ""),
    Column("device map", _device_map, 1, 1, ""),
]
REFERENCE = COLUMNS[0]


def model_kind(row: Row, column: Column) -> str:
    """The pipeline cuts the project's own encoder, where BERT's rows run (token pruning lives in it); the other
    models run as they are (the pipeline cuts none of them)."""
    return "encoder" if column.name == "pipeline" and row.kind == "bert" else row.kind


def cell_dir(out: Path, row: Row, column: Column, kind: str | None = None) -> Path:
    kind = kind or model_kind(row, column)
    return out / _slug(row.name) / _slug(column.name) / kind


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


# ------------------------------------------------------------------------------------------------ running a cell


class Progress(Callback):
    """How far training got (batches started, optimizer steps taken); first in the list, it seeds the global RNG in
    ``setup`` so that adapters injected by the callbacks after it start alike under every strategy."""

    def __init__(self) -> None:
        self.batches = self.steps = 0

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1

    def on_train_end(self, trainer, pl_module):
        self.steps = trainer.global_step


def trainer(column: Column, out: Path, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    settings = {"accelerator": "cpu", "devices": column.devices, "strategy": column.make(), "max_epochs": 1,
                "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                "enable_checkpointing": False, "num_sanity_val_steps": 0, "default_root_dir": out,
                "callbacks": callbacks}
    return pl.Trainer(**{**settings, **kwargs})


def run_cell(out: Path, row: Row, column: Column, kind: str | None = None) -> dict[str, Any]:
    """Trains the cell and writes ``result.json`` (and the export) under its directory; returns the result."""
    kind = kind or model_kind(row, column)
    here = cell_dir(out, row, column, kind)
    progress = Progress()
    export = MergeOnSave(dirpath=str(here / "export"), save_merged=row.save_merged, adapter_name=row.adapter_name)
    module = PackedSFT(STEPS, fused=row.fused) if kind == "sft" else PeerClassifier(
        kind, batch_size=BATCH // column.data_parallel, fused=row.fused)
    result: dict[str, Any] = {"row": row.name, "column": column.name, "kind": kind}
    try:
        trainer(column, here, [progress, *row.callbacks(kind), export]).fit(module)
        result["outcome"] = "trained"
        result["metrics"] = {k: float(v) for k, v in module.trainer.callback_metrics.items()
                             if k in ("val_loss", "val_acc")}
    except Exception as error:  # noqa: BLE001  (the outcome of the cell, checked by the test)
        result["outcome"] = "refused" if progress.batches == 0 else "failed"
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["batches"], result["steps"] = progress.batches, progress.steps
    if _rank() == 0:
        here.mkdir(parents=True, exist_ok=True)
        (here / "result.json").write_text(json.dumps(result, indent=1))
    return result


def run_resume(out: Path, column: Column) -> None:
    """The all-in-one cell with dropout on (model and LoRA), straight and resumed from a mid-epoch checkpoint at an
    optimizer step (accumulation 2, mid curriculum): both export their adapter."""
    here = out / "resume" / _slug(column.name)
    try:
        _straight_and_resumed(here, column)
    except Exception:  # noqa: BLE001  (no export: the check fails, naming the error)
        if _rank() == 0:
            here.mkdir(parents=True, exist_ok=True)
            (here / "error.txt").write_text(traceback.format_exc()[-3000:])


def _straight_and_resumed(here: Path, column: Column) -> None:
    for name in ("straight", "resumed"):
        checkpoints = ModelCheckpoint(dirpath=here / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        callbacks = [*_all_in_one("bert", dropout=0.1), MergeOnSave(dirpath=str(here / name), save_merged=False)]
        if name == "straight":
            callbacks.append(checkpoints)
        torch.manual_seed(1)
        run = trainer(column, here / name, callbacks, enable_checkpointing=name == "straight")
        path = None if name == "straight" else str(here / "ckpt" / "step=1.ckpt")
        run.fit(PeerClassifier("bert", dropout=0.1, batch_size=BATCH // column.data_parallel), ckpt_path=path)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))
