"""A LightningModule around a Hugging Face sequence-classification model.

`HFSequenceClassifier` builds ``AutoModelForSequenceClassification`` from a directory, a hub id, or an
installed model package (see `resolve_pretrained`) and keeps it in ``self.model``: PEFT callbacks such as
`lightning_peft.callbacks.LoRA` find the Hugging Face model there. Batches are dicts with ``input_ids``,
``attention_mask`` (optional ``token_type_ids``) and ``labels``; logits have shape ``(B, num_labels)``.

Optimisation is AdamW over the parameters that still require gradients when ``configure_optimizers`` runs (a
PEFT callback freezes the base in ``setup``, which comes first), with a linear warm-up followed by a linear
decay to zero over ``trainer.estimated_stepping_batches``, stepped every optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from lightning_peft._checks import integer
from lightning_peft._pretrained import resolve_pretrained
from lightning_peft.peft.checkpoint import restore_adapters

__all__ = ["ClassifierSteps", "HFSequenceClassifier", "adamw_with_warmup", "linear_warmup_decay", "resolve_pretrained"]

_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def linear_warmup_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier: linear warm-up to 1 over ``warmup_steps``, then linear decay to 0.

    The first step already gets a non-zero rate (``1 / warmup_steps``) so no batch is wasted.

    Args:
        step: The optimizer step about to be taken, counted from 0.
        warmup_steps: Number of warm-up steps (0 for none).
        total_steps: Number of optimizer steps of the whole run; the multiplier reaches 0 there.

    Returns:
        The multiplier in ``[0, 1]``.

    Examples:
        >>> [round(linear_warmup_decay(s, 2, 6), 2) for s in range(7)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    warmup = (step + 1) / warmup_steps if warmup_steps > 0 else 1.0
    decay = max(0, total_steps - step) / max(1, total_steps - warmup_steps)
    return max(0.0, min(1.0, warmup, decay))


def _import_auto_model() -> Any:
    """Returns ``transformers.AutoModelForSequenceClassification``, or says how to install transformers."""
    try:
        from transformers import AutoModelForSequenceClassification
    except ImportError as error:
        raise RuntimeError(
            "HFSequenceClassifier needs the transformers package, which is not installed; "
            "install it with `pip install 'lightning-peft[hf]'`."
        ) from error
    return AutoModelForSequenceClassification


class ClassifierSteps(LightningModule):
    """The steps, metrics and checkpoint hook shared by the sequence classifiers of this package.

    A subclass builds its model, calls `init_metrics` in ``__init__`` and defines ``forward(input_ids,
    attention_mask=None, token_type_ids=None) -> logits (B, num_labels)``. Batches are dicts with ``input_ids``,
    ``attention_mask`` (optional ``token_type_ids``) and ``labels``; entries that are not model inputs (a
    ``MultiLoRA`` routing key) are left out of the forward call.
    """

    def init_metrics(self, num_labels: int) -> None:
        """Micro accuracy and macro F1 for validation and test (logged as ``val_acc``, ``val_f1``, ...)."""
        self.val_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes=num_labels, average="macro")
        self.test_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.test_f1 = MulticlassF1Score(num_classes=num_labels, average="macro")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Re-applies the adapters a PEFT callback recorded in ``checkpoint`` (see `restore_adapters`).

        So ``load_from_checkpoint(path)`` of a subclass loads LoRA checkpoints, full or adapter-only.
        """
        restore_adapters(self, checkpoint)

    def _logits_and_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self(**_model_inputs(batch))  # (B, num_labels)
        return logits, F.cross_entropy(logits, batch["labels"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Returns the cross-entropy loss of one batch and logs it as ``train_loss``."""
        _, loss = self._logits_and_loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["labels"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Logs ``val_loss``, ``val_acc`` and ``val_f1`` (epoch-level)."""
        self._evaluate(batch, "val", self.val_acc, self.val_f1)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Logs ``test_loss``, ``test_acc`` and ``test_f1`` (epoch-level)."""
        self._evaluate(batch, "test", self.test_acc, self.test_f1)

    def _evaluate(
        self, batch: dict[str, Tensor], prefix: str, accuracy: MulticlassAccuracy, f1: MulticlassF1Score
    ) -> None:
        logits, loss = self._logits_and_loss(batch)
        labels = batch["labels"]
        accuracy(logits, labels)
        f1(logits, labels)
        size = labels.shape[0]
        self.log(f"{prefix}_loss", loss, prog_bar=True, batch_size=size)
        self.log(f"{prefix}_acc", accuracy, prog_bar=True, batch_size=size)
        self.log(f"{prefix}_f1", f1, batch_size=size)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Returns ``preds`` ``(B,)`` and class ``probs`` ``(B, num_labels)``; labels, if any, are ignored."""
        probs = self(**_model_inputs(batch)).softmax(dim=-1)
        return {"preds": probs.argmax(dim=-1), "probs": probs}


class HFSequenceClassifier(ClassifierSteps):
    """Fine-tunes a Hugging Face ``AutoModelForSequenceClassification``.

    Logs ``train_loss``, ``val_loss``, ``val_acc`` (micro accuracy), ``val_f1`` (macro F1), ``test_acc``,
    ``test_f1`` and ``test_loss``.

    Args:
        model_name_or_path: A directory, an installed model package name, or a hub id
            (see `resolve_pretrained`).
        num_labels: Number of classes; a new classification head of that size is created if needed.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to biases or normalisation weights).
        warmup_ratio: Fraction of the optimizer steps spent warming the learning rate up from ~0.

    Raises:
        ValueError: If an argument is out of range.
    """

    def __init__(
        self,
        model_name_or_path: str,
        num_labels: int,
        learning_rate: float = 5e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.06,
    ) -> None:
        super().__init__()
        _check_args(num_labels, learning_rate, weight_decay, warmup_ratio)
        self.save_hyperparameters()
        auto_model = _import_auto_model()
        self.model: nn.Module = auto_model.from_pretrained(
            resolve_pretrained(model_name_or_path), num_labels=num_labels
        )
        # from_pretrained returns the model in eval mode and Lightning keeps the mode it finds, which would
        # switch dropout off during training.
        self.model.train()
        self.init_metrics(num_labels)

    def setup(self, stage: str) -> None:
        """Checks that ``num_labels`` matches the datamodule's number of classes, before any step runs.

        Only a datamodule with a ``num_classes`` attribute (such as `BBCNewsDataModule`) is checked.

        Raises:
            ValueError: If ``num_labels`` differs from the datamodule's ``num_classes``.
        """
        _check_num_labels(self.hparams.num_labels, self.trainer.datamodule)
        _set_pad_token(self.model, getattr(self.trainer.datamodule, "tokenizer", None))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Returns the logits, shape ``(B, num_labels)``, for token ids of shape ``(B, T)``."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        return self.model(**inputs).logits

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the trainable parameters with a per-step linear warm-up and decay schedule.

        Raises:
            ValueError: If no parameter requires gradients, or the run length is unknown.
        """
        hparams = self.hparams
        return adamw_with_warmup(self, "HFSequenceClassifier", hparams.learning_rate, hparams.weight_decay,
                                 hparams.warmup_ratio)


def adamw_with_warmup(module: nn.Module, who: str, learning_rate: float, weight_decay: float, warmup_ratio: float,
                      fused: bool | None = None) -> dict[str, Any]:
    """AdamW over the trainable parameters of ``module`` (matrices decayed) with a per-step `linear_warmup_decay`
    over ``trainer.estimated_stepping_batches``: what ``configure_optimizers`` returns.

    Args:
        module: A LightningModule attached to a trainer.
        who: The module's name in the errors.
        learning_rate: Peak learning rate.
        weight_decay: Weight decay of the matrices.
        warmup_ratio: Fraction of the optimizer steps spent warming up.
        fused: ``torch.optim.AdamW(fused=...)``; None leaves torch's choice.

    Raises:
        ValueError: If no parameter requires gradients, or the run length is unknown.
    """
    options = {} if fused is None else {"fused": fused}
    optimizer = torch.optim.AdamW(_param_groups(module, weight_decay), lr=learning_rate, **options)
    total_steps = module.trainer.estimated_stepping_batches
    if not math.isfinite(total_steps):
        raise ValueError(
            f"{who}.configure_optimizers: the trainer's estimated_stepping_batches is {total_steps}, so the "
            "learning-rate schedule has no end; set Trainer(max_epochs=...) or Trainer(max_steps=...)."
        )
    total_steps = int(total_steps)
    warmup_steps = int(warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, warmup_steps, total_steps)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _model_inputs(batch: dict[str, Any]) -> dict[str, Tensor]:
    """The batch entries the model takes; the rest (``labels``, a ``MultiLoRA`` routing key, ...) are not inputs."""
    return {key: batch[key] for key in _INPUTS if key in batch}


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Splits the trainable parameters of ``module`` into a decayed group (matrices) and a non-decayed one.

    Biases and normalisation weights are the 1-D parameters; telling them apart by shape, not by name, works
    for any architecture.
    """
    trainable = [param for param in module.parameters() if param.requires_grad]
    if not trainable:
        raise ValueError(
            f"{type(module).__name__}.configure_optimizers: none of the {sum(1 for _ in module.parameters())} "
            "parameters requires gradients, so there is nothing to train; check that the PEFT callback's "
            "target_modules / modules_to_save select something, or unfreeze some parameters."
        )
    decay = [param for param in trainable if param.ndim >= 2]
    no_decay = [param for param in trainable if param.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _check_num_labels(num_labels: int, datamodule: object, who: str = "HFSequenceClassifier") -> None:
    """Raises a ValueError if ``datamodule`` has a ``num_classes`` other than ``num_labels``."""
    num_classes = getattr(datamodule, "num_classes", None)
    if num_classes is None or num_classes == num_labels:
        return
    names = getattr(datamodule, "class_names", None)
    listed = f" ({', '.join(map(str, names))})" if names else ""
    raise ValueError(
        f"{who}(num_labels={num_labels}) does not match {type(datamodule).__name__}, which "
        f"has {num_classes} classes{listed}. Set model.init_args.num_labels to {num_classes} "
        f"({who}(num_labels={num_classes}) in Python)."
    )


def _set_pad_token(model: nn.Module, tokenizer: Any) -> None:
    """Models that pool the last non-padding token (GPT-2, Llama) need ``config.pad_token_id``; the tokenizer has it."""
    config = getattr(model, "config", None)
    if config is None or tokenizer is None or getattr(config, "pad_token_id", 0) is not None:
        return
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        config.pad_token_id = pad


def _check_args(num_labels: int, learning_rate: float, weight_decay: float, warmup_ratio: float) -> None:
    """Validates the constructor arguments of `HFSequenceClassifier`."""

    integer("HFSequenceClassifier", "num_labels", num_labels, minimum=2, meaning="the number of classes of the data")
    if not learning_rate > 0:
        raise ValueError(
            f"HFSequenceClassifier(learning_rate={learning_rate!r}): learning_rate must be positive, "
            "e.g. 5e-4."
        )
    if not weight_decay >= 0:
        raise ValueError(
            f"HFSequenceClassifier(weight_decay={weight_decay!r}): weight_decay must be >= 0, e.g. 0.01."
        )
    if not 0 <= warmup_ratio < 1:
        raise ValueError(
            f"HFSequenceClassifier(warmup_ratio={warmup_ratio!r}): warmup_ratio must be in [0, 1), e.g. 0.06."
        )
