"""`CausalLM`: `TransformerDecoder` (random, or a Llama-style checkpoint) trained on next-token prediction.

Shapes:

| tensor | shape | meaning |
| --- | --- | --- |
| input_ids | (B, L) | token ids |
| attention_mask | (B, L) | 1 for real tokens, 0 for padding |
| labels | (B, L) | next-token targets *not* shifted, -100 = ignored |
| decoder logits | (B, L, V) | V = vocab_size; position t predicts token t + 1 |
| position_ids, cu_seqlens | (1, T), (N + 1,) | a packed batch (`SFTDataModule(packing=True)`): N sequences in one row |

Causal-LM loss and perplexity: with ``t`` over the real target tokens (``labels[:, 1:] != -100``),
``loss = sum_t -log p(token_t | tokens_<t) / n`` and ``ppl = exp(loss)``. Validation and test sum the token
losses and counts over the whole split (across batches and processes) before dividing, so ``val_ppl`` is the
perplexity of the split, not a mean of per-batch perplexities. With ``CausalLM(chunked_loss=n)`` training,
validation and test compute that sum with `lightning_peft.nn.chunked_cross_entropy` from the decoder's hidden states,
``n`` tokens at a time, never the ``(B, L, V)`` logits, when the head is a plain ``nn.Linear`` (see
`CausalLM.chunked_head`); any other head keeps the plain loss. A packed batch is one row whose sequences never see
each other (`TransformerDecoder.hidden_states`); its labels carry -100 on each sequence's first token, so no target
crosses a boundary and the loss sums the same token losses as the padded batch of the same sequences.
"""

from __future__ import annotations

import math  # noqa: F401  (the doctests use it)
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_peft._checks import integer
from lightning_peft.modules._block_common import (
    _adamw_with_schedule,
    _check_args,
    _check_options,
    add_moe_losses,
)
from lightning_peft.nn.beam_search import beam_search, check_beams
from lightning_peft.nn.chunked_loss import chunked_cross_entropy
from lightning_peft.nn.generation import check_generation, run_generation
from lightning_peft.nn.transformer import TransformerDecoder

__all__ = ["CausalLM", "TokenLoss", "shifted_token_losses"]

IGNORE_INDEX = -100


def shifted_token_losses(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of the next-token cross-entropies and the number of targets; ``t`` predicts ``labels[:, t + 1]``.

    Args:
        logits: ``(B, L, V)``.
        labels: ``(B, L)`` token ids, not shifted; ``-100`` marks tokens that are not targets (padding).

    Returns:
        ``(loss_sum, count)``: the sum over the targets, computed in float32 for half-precision logits (float64
        logits keep float64) and the int64 number of targets.

    Examples:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: each target costs log 4
        >>> loss_sum, count = shifted_token_losses(logits, torch.tensor([[1, 2, -100]]))
        >>> round(loss_sum.item() / math.log(4), 4), count.item()
        (1.0, 1)
    """
    target = _shifted(labels)  # (B, L)
    loss_sum = F.cross_entropy(  # on the logits as they are: slicing off the last position would copy them
        _at_least_float32(logits).reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (target != IGNORE_INDEX).sum()


def refuse_rows_past_positions(datamodule: Any, positions: object, model: str) -> None:
    """Refuses, at setup, a datamodule whose rows may be longer (``max_length``) than the model's ``positions``:
    past them a rotary model runs silently on positions it never saw, and learned position embeddings or our decoder
    fail mid-fit at the first such row. Packed rows restart at position 0, so the row is what must fit.

    Raises:
        ValueError: If ``datamodule.max_length`` exceeds ``positions``.
    """
    max_length = getattr(datamodule, "max_length", None)
    if isinstance(positions, int) and isinstance(max_length, int) and max_length > positions:
        raise ValueError(
            f"{type(datamodule).__name__}(max_length={max_length}) exceeds the {positions} positions of {model} "
            f"(max_position_embeddings): a row that long would run past the positions the model knows; set "
            f"max_length to at most {positions}.")


def _sequences(batch: dict[str, Tensor]) -> int:
    """The number of sequences in a batch: its rows, or the sequences packed into its one row."""
    cu_seqlens = batch.get("cu_seqlens")
    return batch["input_ids"].shape[0] if cu_seqlens is None else len(cu_seqlens) - 1


def _at_least_float32(logits: Tensor) -> Tensor:
    """Half-precision logits in float32 (a log-softmax in bf16 loses the loss); float32 and float64 as they are."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


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


SCRATCH_VOCAB = 30522  # CausalLM's vocabulary without a checkpoint or vocab_size: the MiniLM tokenizer's


class CausalLM(LightningModule):
    """Next-token language modelling with `TransformerDecoder`.

    Batches are dicts with ``input_ids`` ``(B, L)``, ``attention_mask`` (optional) and ``labels`` (optional,
    unshifted, ``-100`` where no loss is taken; default: ``input_ids`` with padding ignored), or packed batches
    (``input_ids`` ``(1, T)``, ``labels``, ``position_ids``, ``cu_seqlens``; ``max_seqlen`` and other keys are not
    read) as `lightning_peft.data.SFTDataModule` gives both. Logs
    ``train_loss`` (token mean of the batch), ``val_loss`` / ``val_ppl`` and ``test_loss`` / ``test_ppl``
    (over the whole split, see the module docstring).

    Args:
        vocab_size: Vocabulary size (the tokenizer's). None (the default): the checkpoint's with ``pretrained``,
            else 30522 (the MiniLM tokenizer's); given with ``pretrained``, it must equal the checkpoint's.
        decoder: Keyword arguments of `TransformerDecoder` (``hidden_size``, ``num_layers``, ``num_heads``,
            ...); with ``pretrained``, overrides that keep the architecture (``dropout``, ``backend``).
        pretrained: A Llama 2/3.x, Qwen2/2.5, Mistral or Gemma checkpoint directory (see
            `TransformerDecoder.from_pretrained`); ``None`` trains from scratch.
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
        vocab_size: int | None = None,
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
        if vocab_size is not None or pretrained is None:
            options["vocab_size"] = SCRATCH_VOCAB if vocab_size is None else vocab_size
        if pretrained is None:
            self.decoder = TransformerDecoder(**options)
        else:
            self.decoder = TransformerDecoder.from_pretrained(pretrained, **options)
        self.val_loss = TokenLoss()
        self.val_ppl = TokenLoss(exponentiate=True)
        self.test_loss = TokenLoss()
        self.test_ppl = TokenLoss(exponentiate=True)

    def setup(self, stage: str) -> None:
        """Checks that the datamodule's tokenizer (``vocab_size``, if it has one) fits the embedding, and its rows
        (``max_length``, if it has one) the decoder's positions.

        Raises:
            ValueError: If the tokenizer has more tokens than the decoder's vocabulary, or ``max_length`` exceeds
                ``max_position_embeddings``.
        """
        datamodule = self.trainer.datamodule  # set up already: Lightning sets the datamodule up first
        tokens = getattr(datamodule, "vocab_size", None)
        vocab = self.decoder.embed_tokens.num_embeddings  # vocab_size, or the checkpoint's
        if tokens is not None and tokens > vocab:
            raise ValueError(
                f"CausalLM(vocab_size={vocab}) is smaller than the tokenizer of "
                f"{type(datamodule).__name__}, which has {tokens} tokens; set model.init_args.vocab_size to "
                f"{tokens}."
            )
        refuse_rows_past_positions(datamodule, self.decoder.max_position_embeddings, "CausalLM")

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """Logits ``(B, L, vocab_size)``; position ``t`` scores the token at ``t + 1``. A packed batch gives
        ``cu_seqlens`` (and ``position_ids``) as `TransformerDecoder.hidden_states` takes them."""
        return self.decoder(input_ids, attention_mask, position_ids, cu_seqlens)

    def _inputs_and_labels(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        """The decoder's inputs (``input_ids`` and those of ``attention_mask``, ``position_ids``, ``cu_seqlens``
        the batch has) and the labels, which default to the ids with padding, and the first token of every packed
        sequence (nothing before it in its sequence), ignored."""
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids", "cu_seqlens")
                  if batch.get(key) is not None}
        labels = batch.get("labels")
        if labels is None:
            input_ids, mask = batch["input_ids"], batch.get("attention_mask")
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
            if "cu_seqlens" in inputs:
                labels = labels.clone()
                labels[:, inputs["cu_seqlens"][:-1].long().clamp(max=labels.shape[1] - 1)] = IGNORE_INDEX
        return inputs, labels

    def chunked_head(self) -> nn.Linear | None:
        """The head the chunked loss runs on, or None for the plain loss (``chunked_loss=None``, or a head it
        cannot see through).

        The chunked loss reads ``lm_head.weight`` and ``bias`` itself and runs the decoder up to its final norm
        (``TransformerDecoder.hidden_states``), so it applies only where that equals calling the model: the head is
        exactly ``nn.Linear`` (not an adapter such as LoRA's wrapper, nor a modules-to-save copy) with plain tensors
        (not quantized, not DTensor shards of tensor parallelism), and no hook or replaced ``forward`` sits on this
        module, the decoder or the head (device maps, pipeline stages), and no soft-cap follows the head
        (``final_logit_softcapping``).
        """
        if self.hparams.get("chunked_loss") is None:
            return None
        head = self.decoder.lm_head
        if type(head) is not nn.Linear or type(self.decoder).forward is not TransformerDecoder.forward:
            return None
        if self.decoder.final_logit_softcapping is not None:  # the cap sits after the head (Gemma 2)
            return None
        if any(p is not None and type(p) not in (nn.Parameter, Tensor) for p in (head.weight, head.bias)):
            return None
        for module in (self, self.decoder, head):
            if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
                return None
        return head

    def _token_losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        inputs, labels = self._inputs_and_labels(batch)
        head = self.chunked_head()
        if head is None:
            return shifted_token_losses(self(**inputs), labels)
        target = _shifted(labels)  # (B, L); in a packed row a sequence's last token targets the next one's first: -100
        hidden = self.decoder.hidden_states(**inputs)  # (B, L, H)
        loss_sum = chunked_cross_entropy(  # under autocast the head's own dtype (the plain head would run lower)
            hidden.to(head.weight.dtype), head.weight, target, chunk_size=self.hparams.chunked_loss,
            ignore_index=IGNORE_INDEX, reduction="sum", bias=head.bias,
        )
        return _at_least_float32(loss_sum), (target != IGNORE_INDEX).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Token-mean cross-entropy of the batch (logged as ``train_loss``) plus any MoE auxiliary losses."""
        loss_sum, count = self._token_losses(batch)
        loss = loss_sum / count.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True, batch_size=_sequences(batch))
        return add_moe_losses(self, self.decoder, loss, _sequences(batch))

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
        """Per-sequence ``loss`` (token mean, ``(B,)``) and ``tokens`` (number of targets, ``(B,)``); for a packed
        batch, per packed sequence (``(N,)``, in ``cu_seqlens`` order)."""
        inputs, labels = self._inputs_and_labels(batch)
        target = labels[:, 1:]  # (B, L-1)
        losses = F.cross_entropy(  # (B, L-1); class scores on dim 1, as cross_entropy wants them
            self(**inputs)[:, :-1].float().transpose(1, 2), target, ignore_index=IGNORE_INDEX, reduction="none",
        )
        counts = (target != IGNORE_INDEX).sum(dim=1)  # (B,)
        sums = losses.sum(dim=1)  # (B,)
        if "cu_seqlens" in inputs:  # target t - 1 (predicting token t) belongs to the sequence holding token t
            lengths = inputs["cu_seqlens"].diff().long()  # (N,)
            sequence = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)[1:]
            sums = losses.new_zeros(len(lengths)).index_add_(0, sequence, losses[0])  # (N,)
            counts = counts.new_zeros(len(lengths)).index_add_(0, sequence, (target[0] != IGNORE_INDEX).long())
        return {"loss": sums / counts.clamp(min=1), "tokens": counts}

    def generate(
        self, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0,
        generator: torch.Generator | None = None, *, top_k: int | None = None, top_p: float | None = None,
        eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
        attention_mask: Tensor | None = None, use_cache: bool = True, num_beams: int = 1,
        length_penalty: float = 1.0, early_stopping: bool | str = False, num_return_sequences: int = 1,
    ) -> Tensor:
        """Appends up to ``max_new_tokens`` tokens to ``input_ids`` ``(B, L)``: the prompt runs once, then one token
        per step on a key/value cache (`lightning_peft.nn.generate`, where the rule is).

        Args:
            input_ids: The prompts, ``(B, L)``; shorter ones left-padded (see ``attention_mask``).
            max_new_tokens: How many tokens to add at most.
            temperature: 0 for greedy decoding; otherwise sampling from ``softmax(logits / temperature)``.
            generator: Random generator for sampling (reproducible draws).
            top_k: Sample among the ``top_k`` most likely tokens (transformers' ``TopKLogitsWarper``).
            top_p: Sample within the top-p nucleus (transformers' ``TopPLogitsWarper``), ``0 < top_p <= 1``.
            eos_token_id: Stop token id(s): a sample that emits one gets ``pad_token_id`` afterwards, and
                generation ends when every sample has stopped.
            pad_token_id: Token after a sample's stop; default: the first stop token.
            attention_mask: ``(B, L)``, 0 on the left padding of shorter prompts (never attended; positions start
                at each prompt's first real token).
            use_cache: False recomputes the whole sequence for every token (the same tokens, slower).
            num_beams: More than 1: deterministic beam search (`lightning_peft.nn.beam_search`: transformers'
                ``num_beams`` with ``do_sample=False``, whose tokens it returns); with ``temperature=0`` only.
            length_penalty: Beam search: finished hypotheses score their summed log-probabilities divided by
                their new tokens ** length_penalty.
            early_stopping: Beam search: True, False or ``"never"``, as in transformers.
            num_return_sequences: Beam search: the best hypotheses returned per prompt (at most ``num_beams``).

        Returns:
            ``(B, L + n)``: the prompts followed by ``n`` new tokens (``n = max_new_tokens`` unless every sample
            stopped earlier); with beams ``(B * num_return_sequences, L + n)``, each prompt's best first. Runs in eval mode; the mode is restored. The decoder runs through its layers'
            module calls, so LoRA adapters and `lightning_peft.peft.route_adapters` apply at every step.

        Raises:
            ValueError: If ``max_new_tokens`` or ``temperature`` is negative, ``top_k`` / ``top_p`` are out of range
                or given with greedy decoding, a prompt ends with padding, or the prompts plus ``max_new_tokens``
                exceed the decoder's ``max_position_embeddings`` (no sliding window: refused before any step), or
                beams come with sampling, ``num_beams < 1`` or ``num_return_sequences > num_beams``.
        """
        settings = check_generation("CausalLM.generate", self.decoder, input_ids, max_new_tokens, temperature,
                                    top_k, top_p, eos_token_id, pad_token_id, attention_mask)
        beams = check_beams("CausalLM.generate", settings, num_beams, length_penalty, early_stopping,
                            num_return_sequences)
        was_training = self.training
        self.eval()
        try:
            if beams is not None:
                return beam_search(self.decoder, input_ids, settings, beams, use_cache)
            return run_generation(self.decoder, input_ids, settings, generator, use_cache)
        finally:
            self.train(was_training)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the trainable parameters with a per-step linear warm-up and decay schedule.

        Raises:
            ValueError: If no parameter requires gradients, or the run length is unknown.
        """
        return _adamw_with_schedule(self, "CausalLM")
