"""A LightningModule around a Hugging Face causal LM: supervised fine-tuning on padded or packed batches, generation.

`HFCausalLM` builds ``AutoModelForCausalLM`` from a directory, an installed model package or a hub id (see
`resolve_pretrained`) and keeps it in ``self.model``, where every PEFT callback of the library finds it. Batches are
those of `lightning_peft.data.SFTDataModule`:

| batch | keys given to the model |
| --- | --- |
| padded, ``(B, T)`` | ``input_ids``, ``attention_mask`` |
| packed, ``(1, T)`` (``cu_seqlens`` present) | ``input_ids``, ``position_ids`` (restarting at 0 at every row) |

Always with ``use_cache=False``. With ``attn_implementation="sdpa"`` (the default) the model runs `PACKED_SDPA`
(`lightning_peft.modules.hf_packed`): transformers' sdpa for padded batches, and for a packed batch, given its
``cu_seqlens`` as transformers' ``cu_seq_lens_q`` / ``cu_seq_lens_k``, attention inside each row by
`packed_attention` with no ``(T, T)`` mask built. Other implementations get packed batches as transformers takes them
(``eager``: a block-diagonal mask from the ``position_ids``; flash-attn: its varlen kernel); attention never crosses a
row either way (docs/sft.md). A routing list is never a model argument. ``labels`` are unshifted with -100 on masked tokens; the loss is computed from the logits with
`shifted_token_losses` (a row's first token is -100, so no target crosses a row of a packed batch).

Loss: with ``t`` over the target tokens of the global batch (every data-parallel rank's),
``loss = sum_t -log p(token_t | tokens_<t) / n``. Under data parallelism each rank holds ``n_r`` of the ``n`` targets;
DDP averages the ranks' gradients, so each rank returns ``(its sum of token losses) * R / n`` (``R`` data-parallel
ranks, ``n`` from one all-reduce): the averaged gradient is the gradient of the token mean of the global batch, as
one process on the concatenated batch computes it. A per-rank mean averaged by DDP would weigh a rank's tokens by
``1 / (R * n_r)`` instead. ``val_loss`` / ``val_ppl`` (and ``test_``) are token-weighted over the whole split
(`TokenLoss`, summed across ranks), so a split gives the same number packed or padded.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_peft._checks import boolean, choice, integer, real
from lightning_peft._pretrained import resolve_pretrained
from lightning_peft._seams import data_parallel
from lightning_peft.modules.causal_lm import (
    IGNORE_INDEX,
    TokenLoss,
    refuse_rows_past_positions,
    shifted_token_losses,
)
from lightning_peft.modules.hf import adamw_with_warmup
from lightning_peft.modules.hf_packed import PACKED_SDPA, packed_forward, register_packed_sdpa
from lightning_peft.peft.adapter import attached, unwrap
from lightning_peft.peft.checkpoint import restore_adapters
from lightning_peft.peft.prompt.shared import PromptLearningAdapter

__all__ = ["HFCausalLM"]

_WHO = "HFCausalLM"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_PACKED = "cu_seqlens"  # the key that marks a packed batch


def _import_auto_model() -> Any:
    """Returns ``transformers.AutoModelForCausalLM``, or says how to install transformers."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise RuntimeError(f"{_WHO} needs the transformers package, which is not installed; install it with "
                           "`pip install 'lightning-peft[hf]'`.") from error
    return AutoModelForCausalLM


class HFCausalLM(LightningModule):
    """Fine-tunes a Hugging Face ``AutoModelForCausalLM`` on instruction data, padded or packed (module docstring).

    Logs ``train_loss`` (the token mean of the global batch, every rank's tokens), ``val_loss`` / ``val_ppl`` and
    ``test_loss`` / ``test_ppl`` (token-weighted over the split). ``predict`` generates (`predict_step`).

    Args:
        pretrained: A directory, an installed model package name, or a hub id (see `resolve_pretrained`).
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, on matrices only (not on biases or normalisation weights).
        warmup_ratio: Fraction of the optimizer steps spent warming the learning rate up from ~0.
        torch_dtype: The dtype the weights load in: ``"float32"``, ``"bfloat16"``, or ``"float64"`` (exact checks).
        attn_implementation: transformers' attention: ``"sdpa"`` (default; runs as `PACKED_SDPA`, sdpa with packed
            batches row by row), ``"eager"``, ``"flash_attention_2"``, ...
        fused: ``torch.optim.AdamW(fused=...)``; None leaves torch's choice.
        max_new_tokens: Tokens `predict_step` generates per prompt (at most).
        temperature: 0 for greedy decoding in `predict_step`; above 0, sampling at that temperature.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Examples:
        >>> lm = HFCausalLM("path/to/llama", torch_dtype="bfloat16")  # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained: str,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.03,
        torch_dtype: Literal["float32", "bfloat16", "float64"] = "float32",
        attn_implementation: str = "sdpa",
        fused: bool | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
    ) -> None:
        super().__init__()
        real(_WHO, "learning_rate", learning_rate, minimum=0, open_low=True, example="2e-4")
        real(_WHO, "weight_decay", weight_decay, minimum=0, example="0.01")
        real(_WHO, "warmup_ratio", warmup_ratio, minimum=0, maximum=1, open_high=True, example="0.03")
        choice(_WHO, "torch_dtype", torch_dtype, _DTYPES)
        if fused is not None:
            boolean(_WHO, "fused", fused)
        integer(_WHO, "max_new_tokens", max_new_tokens, minimum=1, example="64")
        real(_WHO, "temperature", temperature, minimum=0, example="0 (greedy) or 0.7")
        self.save_hyperparameters()
        auto_model = _import_auto_model()
        # sdpa itself would build a (T, T) block-diagonal mask for a packed batch and compute all of it
        implementation = register_packed_sdpa() if attn_implementation == "sdpa" else attn_implementation
        self.model: nn.Module = auto_model.from_pretrained(
            resolve_pretrained(pretrained), dtype=_DTYPES[torch_dtype], attn_implementation=implementation)
        # from_pretrained returns the model in eval mode and Lightning keeps the mode it finds (dropout off in training)
        self.model.train()
        self.val_loss, self.val_ppl = TokenLoss(), TokenLoss(exponentiate=True)
        self.test_loss, self.test_ppl = TokenLoss(), TokenLoss(exponentiate=True)

    def setup(self, stage: str) -> None:
        """Checks, before any step, that the datamodule's tokenizer fits the embedding and that packed batches can
        reach the model as they are.

        Raises:
            ValueError: If the tokenizer has more tokens than the model's input embedding, the datamodule's
                ``max_length`` exceeds the model's ``max_position_embeddings``, or the datamodule packs
                rows while a prompt-learning adapter (prompt, P- or prefix tuning) is on the model.
        """
        if self.model.config._attn_implementation == PACKED_SDPA:
            register_packed_sdpa()  # in this process too (a spawned one), before predict's generate
        datamodule = getattr(self.trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        rows = self.model.get_input_embeddings().num_embeddings
        if tokenizer is not None and len(tokenizer) > rows:
            raise ValueError(
                f"{_WHO}({self.hparams.pretrained!r}) has {rows} token embeddings, fewer than the {len(tokenizer)} "
                f"tokens of {type(datamodule).__name__}'s tokenizer; give the datamodule the model's own tokenizer.")
        refuse_rows_past_positions(datamodule, getattr(self.model.config, "max_position_embeddings", None),
                                   f"{_WHO}({self.hparams.pretrained!r})")
        if getattr(datamodule, "packing", False):
            _refuse_prompt_learning(self.model, type(datamodule).__name__)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> Tensor:
        """Logits ``(B, T, V)`` of token ids ``(B, T)``, without a cache; position ``t`` scores token ``t + 1``.
        ``cu_seqlens`` (N + 1,) / ``max_seqlen``: the rows of a packed ``(1, T)`` batch, for `PACKED_SDPA`."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        if self.model.config._attn_implementation != PACKED_SDPA:
            return self.model(**inputs, use_cache=False).logits
        register_packed_sdpa()  # a model unpickled in another process (ddp_spawn) finds the name registered
        if cu_seqlens is None:
            return self.model(**inputs, use_cache=False).logits
        longest = max_seqlen if max_seqlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        with packed_forward():
            return self.model(**inputs, use_cache=False, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                              max_length_q=longest, max_length_k=longest).logits

    def _token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """``(sum of the batch's token losses, number of targets)`` (`shifted_token_losses`)."""
        return shifted_token_losses(self(**_model_inputs(batch)), batch["labels"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """The rank's share of the global batch's token-mean loss, scaled so that DDP's average of the ranks'
        gradients is the gradient of that mean (module docstring); logs ``train_loss``, the mean itself."""
        loss_sum, count = self._token_losses(batch)
        total, tokens = _global_sums(self.trainer, loss_sum.detach(), count)
        self.log("train_loss", total / tokens.clamp(min=1), prog_bar=True, batch_size=1)
        return loss_sum * _data_parallel_size(self.trainer) / tokens.clamp(min=1).to(loss_sum.dtype)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulates ``val_loss`` and ``val_ppl`` over the validation split."""
        self._evaluate(batch, self.val_loss, self.val_ppl, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulates ``test_loss`` and ``test_ppl`` over the test split."""
        self._evaluate(batch, self.test_loss, self.test_ppl, "test")

    def _evaluate(self, batch: dict[str, Any], loss: TokenLoss, ppl: TokenLoss, prefix: str) -> None:
        loss_sum, count = self._token_losses(batch)
        loss.update(loss_sum, count)
        ppl.update(loss_sum, count)
        self.log(f"{prefix}_loss", loss, prog_bar=True, batch_size=1)
        self.log(f"{prefix}_ppl", ppl, batch_size=1)

    @torch.no_grad()
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, list]:
        """Generates up to ``max_new_tokens`` tokens after each prompt of a padded batch (``model.generate``).

        A row's prompt is its tokens before its first label (an SFT batch: the masked prompt; a generated response
        replaces the one in the data), or all its real tokens when the batch has no ``labels`` (a batch of prompts
        only). The prompts are re-laid left-padded, as decoder generation wants them. Greedy unless ``temperature``.

        Returns:
            ``prompt_ids`` (each row's prompt), ``new_ids`` (the generated tokens, up to and including the first end
            token: the model's eos, and the datamodule tokenizer's end token) and, when the datamodule has a
            tokenizer, ``text`` (``new_ids`` decoded without special tokens); lists with one entry per row.

        Raises:
            ValueError: If the batch is packed (generation takes one prompt per row).
        """
        if _PACKED in batch:
            raise ValueError(f"{_WHO}.predict_step: got a packed batch (cu_seqlens); generation takes one prompt per "
                             "row: predict on the datamodule's padded batches (SFTDataModule(packing=False)) or on "
                             "prompts only (input_ids and attention_mask).")
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None) if self._trainer else None
        prompts = _prompts(batch)
        ends = _end_ids(self.model, tokenizer)
        pad = _pad_id(self.model, tokenizer, ends)
        input_ids, mask = _left_padded(prompts, pad, batch["input_ids"].device)
        sampling = {"do_sample": True, "temperature": self.hparams.temperature} if self.hparams.temperature else {
            "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.hparams.max_new_tokens,
                                  eos_token_id=ends or None, pad_token_id=pad, **sampling)
        new_ids = [_until_end(row.tolist(), ends) for row in out[:, input_ids.shape[1]:]]
        result: dict[str, list] = {"prompt_ids": prompts, "new_ids": new_ids}
        if tokenizer is not None:
            result["text"] = tokenizer.batch_decode(new_ids, skip_special_tokens=True)
        return result

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Re-applies the adapters a PEFT callback recorded in ``checkpoint`` (see `restore_adapters`), so
        ``HFCausalLM.load_from_checkpoint(path)`` loads LoRA checkpoints, full or adapter-only."""
        restore_adapters(self, checkpoint)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the trainable parameters with a per-step linear warm-up and decay schedule.

        Raises:
            ValueError: If no parameter requires gradients, or the run length is unknown.
        """
        hparams = self.hparams
        return adamw_with_warmup(self, _WHO, hparams.learning_rate, hparams.weight_decay, hparams.warmup_ratio,
                                 fused=hparams.fused)


def _model_inputs(batch: dict[str, Any]) -> dict[str, Tensor]:
    """What the model takes of ``batch``: ``input_ids`` and ``attention_mask`` padded, ``input_ids`` and
    ``position_ids`` with the rows' ``cu_seqlens`` and ``max_seqlen`` packed; never a routing list.

    Raises:
        ValueError: If a packed batch has no ``position_ids``, an ``attention_mask``, or more than one row: attention
            would then cross its rows.
    """
    if _PACKED not in batch:
        return {k: batch[k] for k in ("input_ids", "attention_mask") if batch.get(k) is not None}
    if batch.get("position_ids") is None or batch.get("attention_mask") is not None or batch["input_ids"].shape[0] != 1:
        raise ValueError(
            f"{_WHO}: a packed batch (cu_seqlens) must be one row (1, T) with position_ids restarting at 0 at every "
            f"packed row and no attention_mask; this one has input_ids {tuple(batch['input_ids'].shape)}, "
            f"position_ids {'present' if batch.get('position_ids') is not None else 'missing'}, attention_mask "
            f"{'present' if batch.get('attention_mask') is not None else 'absent'}. Without that, attention crosses "
            "the rows; use SFTDataModule(packing=True)'s batches as they are.")
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "cu_seqlens": batch[_PACKED],
            "max_seqlen": batch.get("max_seqlen")}


def _refuse_prompt_learning(model: nn.Module, datamodule: str) -> None:
    """A prompt-learning adapter prepends its virtual tokens (or its prefix cache) once per call: in a packed batch
    only the first packed row would see them, and the positions of every row would shift."""
    for kind, adapter in attached(unwrap(model)).items():
        if isinstance(adapter, PromptLearningAdapter):
            raise ValueError(  # noqa: TRY004  (a combination of settings, not a wrong argument type)
                f"{_WHO} with {kind} and {datamodule}(packing=True): {kind} prepends its virtual tokens once per "
                "model call, so in a packed batch only the first row would see them; use packing=False with "
                f"{kind}, or a weight technique (LoRA, IA3, ...) with packing.")


def _data_parallel_size(trainer: Any) -> int:
    """How many ranks read different batches (the strategy's, never the world size: pipeline and tensor-parallel
    ranks read the same batch)."""
    return data_parallel(trainer.strategy)[0]


def _global_sums(trainer: Any, loss_sum: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of token losses, number of targets)`` over the data-parallel ranks, in one all-reduce.

    The all-reduce spans every rank; ranks that read the same batch (``world / data-parallel size`` of them) count
    it that many times, which the division takes out.
    """
    sums = torch.stack([loss_sum.double(), count.double()])  # (2,)
    world = trainer.world_size
    if world > 1:
        sums = trainer.strategy.reduce(sums, reduce_op="sum") * (_data_parallel_size(trainer) / world)
    return sums[0], sums[1].round()


def _prompts(batch: dict[str, Any]) -> list[list[int]]:
    """Each row's prompt: its real tokens before its first label (all of them without ``labels``)."""
    ids = batch["input_ids"]  # (B, T)
    mask = batch.get("attention_mask")
    real_tokens = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    labels = batch.get("labels")
    prompts = []
    for row in range(ids.shape[0]):
        keep = real_tokens[row]
        if labels is not None:
            labelled = (labels[row] != IGNORE_INDEX).nonzero()
            if len(labelled):
                keep = keep & (torch.arange(ids.shape[1], device=ids.device) < labelled[0, 0])
        prompts.append(ids[row][keep].tolist())
    empty = [row for row, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ValueError(f"{_WHO}.predict_step: rows {empty} of the batch have no prompt token (no real token before "
                         "their first label); give every row a prompt.")
    return prompts


def _end_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """The tokens that end a response: the model's eos, and the tokenizer's eos (else ``[SEP]``), as SFT rows end."""
    ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    if tokenizer is not None:
        end = next((t for t in (tokenizer.eos_token_id, getattr(tokenizer, "sep_token_id", None)) if t is not None),
                   None)
        if end is not None and end not in ends:
            ends.append(end)
    return ends


def _pad_id(model: nn.Module, tokenizer: Any, ends: list[int]) -> int:
    """The id filling left padding and finished rows (masked out, so any id works): the tokenizer's pad, the model's,
    an end token, else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(model.config, "pad_token_id", None),
                      *ends, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _left_padded(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)``, ``(B, longest)``: each prompt at the right end, padding on the left."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt, device=device)
        mask[row, longest - len(prompt):] = 1
    return ids, mask


def _until_end(tokens: list[int], ends: list[int]) -> list[int]:
    """``tokens`` up to and including the first end token (generate pads a finished row after it)."""
    for index, token in enumerate(tokens):
        if token in ends:
            return tokens[: index + 1]
    return tokens
