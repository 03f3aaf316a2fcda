"""Prompt tuning: trainable soft-prompt embeddings prepended to a frozen model's input embeddings.

Paper: Lester, Al-Rfou, Constant, "The Power of Scale for Parameter-Efficient Prompt Tuning", arXiv:2104.08691.

The frozen model reads ``[P; E(x)]`` instead of ``E(x)``: ``P`` (``n`` virtual tokens of width ``d``) is the only
parameter that trains (with the task head, if saved in full), ``P <- P - lr * dL/dP``. ``P`` starts as

- ``"random"``: ``N(0, 1)`` entries (PEFT's ``RANDOM``);
- ``"vocab"``: the embeddings of ``n`` token ids drawn uniformly from the vocabulary (PEFT's ``SAMPLE_VOCAB``);
- ``"text"``: the embeddings of ``init_text``'s token ids (special tokens included, as the tokenizer returns them),
  repeated or cut to ``n`` (PEFT's ``TEXT``). Exact property: with ``n`` equal to the text's token count, the
  prompted model computes what the plain model computes on the text followed by the input.

The model is adapted in place, with no wrapper class: the prompt is a parameter ``weight`` of a small module
attached to the Hugging Face model under :data:`PROMPT_MODULE` (state-dict key ``lightning_peft_prompt.weight``),
and a forward pre-hook on that model rewrites each call (positional arguments are bound to the ``forward``
signature first) as Hugging Face PEFT's ``PeftModelFor*`` classes do, so outputs equal PEFT's:

=========================  ==================================  ==================================================
argument                   given                               passed to the model
=========================  ==================================  ==================================================
``input_ids``              (B, T)                              None; ``inputs_embeds`` = [P; E(input_ids)] (B, n+T, d)
``inputs_embeds``          (B, T, d)                           [P; inputs_embeds] (B, n+T, d)
``attention_mask``         (B, T)                              [1 ... 1; mask] (B, n+T)
``token_type_ids``         (B, T)                              [0 ... 0; ids] (B, n+T)
``position_ids``           (..., T)                            [0 ... n-1; ids + n] (..., n+T)
``labels``                 (B, T) integer (per token)          [-100 ... -100; labels] (B, n+T); (B,) unchanged
``start/end_positions``    (B,) (question answering)           + n
=========================  ==================================  ==================================================

Outputs keep the virtual positions, as PEFT's do: a causal LM's logits are (B, n+T, V) and its loss skips them
(labels -100). ``generate()`` works: the prompt is prepended on the first (prefill) call; later calls, whose KV cache
already holds it, only get their attention mask and positions extended. Differences from PEFT, where PEFT's
behaviour is a bug or a loss of information: given ``position_ids`` are shifted (PEFT drops them with a warning, so
the two agree when they are the default ``0 ... T-1``), ``token_type_ids`` of a causal LM are extended with zeros
(PEFT drops them), and span labels of question answering are shifted (PEFT leaves them pointing n tokens early).

A model with a learned absolute position table (BERT's ``position_embeddings``, GPT-2's ``wpe``) refuses
``n + T`` beyond the table at forward time, and ``n`` that leaves no room for a real token at inject time.
Encoder-decoder models (PEFT's ``SEQ_2_SEQ_LM``, which prompts both stacks) are not supported.

Saved in Hugging Face PEFT's layout: ``adapter_config.json`` with ``peft_type: PROMPT_TUNING`` and the tensor
``prompt_embeddings`` (n, d) under that bare key; ``modules_to_save`` under ``base_model.<module path>.<param>``
(PEFT keeps a prompt-learning model at ``base_model``, one level higher than for LoRA). Both are full file keys:
:attr:`PromptTuningAdapter.peft_key_prefix` is empty.

Shapes: ``B`` batch, ``T`` real tokens, ``n`` virtual tokens, ``d`` the input-embedding width, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from .adapter import Adapter, attach, attached, base_model_name, clean_key, detach, register, remove_adapter, unwrap
from .modules_to_save import plain_key, saved_elsewhere, select_named, set_submodule, wrap_modules_to_save

log = logging.getLogger(__name__)

PromptInit = Literal["random", "vocab", "text"]

#: Name of the module that holds the prompt on the adapted model (chosen so no Hugging Face model has it).
PROMPT_MODULE = "lightning_peft_prompt"
#: The key of the prompt tensor in PEFT's ``adapter_model.safetensors``.
PEFT_PROMPT_KEY = "prompt_embeddings"
#: Prefix of ``modules_to_save`` keys in PEFT's file for prompt-learning methods.
PEFT_MODULE_PREFIX = "base_model."

_INITS = ("random", "vocab", "text")
_PEFT_INITS = {"random": "RANDOM", "vocab": "SAMPLE_VOCAB", "text": "TEXT"}
# Hugging Face task models and the task heads PEFT's task types save in full (PEFT's SEQ_CLS: classifier, score).
_TASK_HEADS = {"ForSequenceClassification": ("classifier", "score"), "ForTokenClassification": ("classifier", "score"),
               "ForQuestionAnswering": ("qa_outputs",)}
# PEFT's task type by model class-name suffix; any other model is a FEATURE_EXTRACTION backbone.
_TASK_TYPES = {"ForSequenceClassification": "SEQ_CLS", "ForCausalLM": "CAUSAL_LM", "LMHeadModel": "CAUSAL_LM",
               "ForTokenClassification": "TOKEN_CLS", "ForQuestionAnswering": "QUESTION_ANS"}
_SPAN_LABELS = ("start_positions", "end_positions")


class PromptEmbedding(nn.Module):
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

    def forward(self, batch_size: int, dtype: torch.dtype) -> Tensor:
        """The prompt for a batch, (B, n, d), in ``dtype`` (the input embeddings' dtype, as PEFT casts it)."""
        return self.weight.to(dtype).unsqueeze(0).expand(batch_size, -1, -1)

    def extra_repr(self) -> str:
        return f"num_virtual_tokens={self.weight.shape[0]}, dim={self.weight.shape[1]}"


# --- checks --------------------------------------------------------------------------------------------------


def check_options(num_virtual_tokens: object, init: object, init_text: object, modules_to_save: object,
                   who: str) -> None:
    """Raise for invalid options (the checks that need no model); ``who`` names the caller in the message.

    Shared by :func:`inject_prompt_tuning` and the ``PromptTuning`` callback, which checks in ``__init__``.
    """
    if isinstance(num_virtual_tokens, bool) or not isinstance(num_virtual_tokens, numbers.Integral):
        raise TypeError(f"{who}(num_virtual_tokens={num_virtual_tokens!r}): give a positive integer, e.g. 20.")
    if num_virtual_tokens <= 0:
        raise ValueError(f"{who}(num_virtual_tokens={num_virtual_tokens!r}): num_virtual_tokens must be positive.")
    if init not in _INITS:
        raise ValueError(f"{who}(init={init!r}): init must be 'random', 'vocab' or 'text'.")
    if init == "text" and (not isinstance(init_text, str) or not init_text):
        raise ValueError(
            f"{who}(init='text', init_text={init_text!r}): give the text whose token embeddings start the prompt, "
            "e.g. init_text='Classify the topic of this article:'."
        )
    if init != "text" and init_text is not None:
        raise ValueError(
            f"{who}(init={init!r}, init_text={init_text!r}): init_text is only read with init='text'; "
            "set init='text' to start from the text, or drop init_text."
        )
    if modules_to_save is not None and (
        isinstance(modules_to_save, str) or not isinstance(modules_to_save, Iterable)
        or not all(isinstance(m, str) for m in modules_to_save)
    ):
        raise TypeError(
            f"{who}(modules_to_save={modules_to_save!r}): give a list of module names, e.g. ['classifier']."
        )


def _input_embeddings(model: nn.Module, who: str) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if not isinstance(embeddings, nn.Module) or not isinstance(getattr(embeddings, "weight", None), Tensor):
        raise TypeError(
            f"{who}: {type(model).__name__} has no get_input_embeddings() returning an embedding module; prompt "
            "tuning needs a Hugging Face model (the PreTrainedModel itself, e.g. BertForSequenceClassification)."
        )
    return embeddings


def _token_dim(embeddings: nn.Module) -> int:
    """The embedding size: under DeepSpeed ZeRO-3 the weight is an empty placeholder (its shape is ``ds_shape``)."""
    dim = getattr(embeddings, "embedding_dim", None)
    return int(dim) if dim is not None else int(getattr(embeddings.weight, "ds_shape", embeddings.weight.shape)[1])


def _check_model(model: nn.Module, num_virtual_tokens: int, who: str) -> None:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{who}: {type(model).__name__} is an encoder-decoder model; prompt tuning here supports encoder-only and "
            "decoder-only models. Use Hugging Face PEFT (task_type='SEQ_2_SEQ_LM') for it."
        )
    if hasattr(model, PROMPT_MODULE) or "prompt_tuning" in attached(model):
        raise RuntimeError(
            f"{who}: {type(model).__name__} already has a soft prompt ({PROMPT_MODULE}); prompt tuning was injected "
            "twice. Use the model as it is, or build a fresh one."
        )
    limit = _position_limit(model)
    if limit is not None and num_virtual_tokens >= limit:
        raise ValueError(
            f"{who}(num_virtual_tokens={num_virtual_tokens}): {type(model).__name__} has {limit} learned positions, "
            "so the prompt leaves no room for a real token. Use fewer virtual tokens."
        )


def _position_limit(model: nn.Module) -> int | None:
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


def _select_modules_to_save(model: nn.Module, modules_to_save: list[str] | None, who: str) -> list[str]:
    """Full names: the given names or dotted suffixes, or None: a Hugging Face task model's random head (unless
    another adapter, e.g. LoRA's ``modules_to_save``, already trains and saves it)."""
    if modules_to_save is None:
        suffix = next((s for s in _TASK_HEADS if type(model).__name__.endswith(s)), None)
        heads = [n for n, _ in model.named_children() if suffix and n in _TASK_HEADS[suffix]]
        return [n for n in heads if not saved_elsewhere(model, n)]
    return select_named(model, modules_to_save, who)


# --- the initial prompt ----------------------------------------------------------------------------------------


def _prompt_dtype(embeddings: nn.Module) -> torch.dtype:
    """float32, or the embeddings' dtype if it is wider (float64); PEFT keeps prompts in float32 too."""
    dtype = embeddings.weight.dtype
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _initial_prompt(embeddings: nn.Module, num_virtual_tokens: int, init: str, init_text: str | None,
                    tokenizer: Any, who: str) -> Tensor:
    """The starting prompt (n, d), detached, in :func:`_prompt_dtype`."""
    weight = embeddings.weight
    vocab, dim = weight.shape
    if init == "random":
        return torch.randn(num_virtual_tokens, dim, device=weight.device, dtype=_prompt_dtype(embeddings))
    if init == "vocab":
        ids = torch.randint(0, vocab, (num_virtual_tokens,), device=weight.device)
    else:
        ids = _text_ids(init_text, tokenizer, num_virtual_tokens, vocab, who).to(weight.device)
    with torch.no_grad():
        return embeddings(ids).detach().clone().to(_prompt_dtype(embeddings))  # (n, d)


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

        return AutoTokenizer.from_pretrained(tokenizer)
    if not callable(tokenizer):
        raise TypeError(
            f"{who}(tokenizer={type(tokenizer).__name__}): give a Hugging Face tokenizer, or its name or directory."
        )
    return tokenizer


def _tokenizer_name(tokenizer: Any) -> str | None:
    if tokenizer is None or isinstance(tokenizer, str):
        return tokenizer or None
    return getattr(tokenizer, "name_or_path", None) or None


# --- the forward pre-hook -------------------------------------------------------------------------------------


def _prepend_prompt(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook on the adapted model: the call with the prompt prepended (see the module docstring).

    It reads the prompt from the module it is called on, so a deep copy of the model uses its own prompt.
    """
    prompt = model._modules[PROMPT_MODULE]
    inputs = _keywords(model, args, kwargs)
    input_ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    if (input_ids is None) == (embeds is None):
        raise ValueError(
            f"PromptTuning: {type(model).__name__} was called with "
            f"{'both input_ids and inputs_embeds' if input_ids is not None else 'neither input_ids nor inputs_embeds'}"
            "; give exactly one of them (the prompt is prepended to the embeddings of the input)."
        )
    length = (input_ids if input_ids is not None else embeds).shape[1]
    cached = _cached_length(inputs)
    n = prompt.num_virtual_tokens
    prefill = cached == 0
    _check_positions(model, prompt, cached + (n if prefill else 0) + length)
    mask = inputs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"PromptTuning: attention_mask has shape {tuple(mask.shape)}; prompt tuning extends a 2-D mask "
                "(B, T) over the virtual tokens. Pass the 2-D padding mask and let the model build its own 4-D mask."
            )
        inputs["attention_mask"] = _prefixed(mask, torch.ones_like(mask[:, :1]), n)
    for key in ("position_ids", "cache_position"):
        if inputs.get(key) is not None:
            inputs[key] = _shifted_positions(inputs[key], n, prefill)
    if prefill:  # else decoding with a KV cache that holds the prompt already
        _prepend(model, prompt, inputs, length)
    return (), inputs


def _prepend(model: nn.Module, prompt: PromptEmbedding, inputs: dict[str, Any], length: int) -> None:
    """Put the prompt in front of the embeddings, token types and labels of ``inputs``, in place."""
    n = prompt.num_virtual_tokens
    embeds = inputs.get("inputs_embeds")
    if inputs.get("input_ids") is not None:
        embeds = model.get_input_embeddings()(inputs.pop("input_ids"))  # (B, T, d)
    inputs["inputs_embeds"] = torch.cat((prompt(embeds.shape[0], embeds.dtype), embeds), dim=1)  # (B, n+T, d)
    types = inputs.get("token_type_ids")
    if types is not None:
        inputs["token_type_ids"] = _prefixed(types, torch.zeros_like(types[:, :1]), n)
    labels = inputs.get("labels")
    if labels is not None and labels.dim() == 2 and labels.shape[1] == length and not labels.is_floating_point():
        inputs["labels"] = _prefixed(labels, torch.full_like(labels[:, :1], -100), n)  # per-token labels
    for key in _SPAN_LABELS:
        if inputs.get(key) is not None:
            inputs[key] = inputs[key] + n


def _keywords(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name: positional ones bound to ``model.forward``'s parameters."""
    inputs = dict(kwargs)
    if not args:
        return inputs
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(names):
        raise TypeError(
            f"PromptTuning: {type(model).__name__}.forward takes {len(names)} positional arguments "
            f"({', '.join(names)}), but {len(args)} were given. Pass the extra ones by name."
        )
    for name, value in zip(names, args):
        if name in inputs:
            raise TypeError(f"PromptTuning: {type(model).__name__}.forward got two values for {name!r}.")
        inputs[name] = value
    return inputs


def _cached_length(inputs: dict[str, Any]) -> int:
    """Tokens already in the KV cache (``cache``, or its deprecated name ``past_key_values``); 0 without one."""
    cache = inputs.get("cache", inputs.get("past_key_values"))
    if cache is None:
        return 0
    if callable(getattr(cache, "get_seq_length", None)):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:  # legacy ((k, v), ...): k (B, h, L, hd)
        return int(cache[0][0].shape[-2])
    return 0


def _check_positions(model: nn.Module, prompt: PromptEmbedding, total: int) -> None:
    limit = prompt.position_limit
    if limit is not None and total > limit:
        n = prompt.num_virtual_tokens
        raise ValueError(
            f"PromptTuning: prompt longer than the position limit: {n} virtual tokens + {total - n} real tokens = "
            f"{total} positions, but {type(model).__name__} has {limit} learned positions. Truncate the input to "
            f"{limit - n} tokens (e.g. the tokenizer's max_length) or use fewer virtual tokens."
        )


def _prefixed(values: Tensor, first: Tensor, n: int) -> Tensor:
    """``values`` (B, T) with ``first`` (B, 1) repeated ``n`` times in front: (B, n+T)."""
    return torch.cat((first.expand(-1, n), values), dim=1)


def _shifted_positions(positions: Tensor, n: int, prefill: bool) -> Tensor:
    """Positions of real tokens moved ``n`` on; at prefill with ``0 ... n-1`` for the prompt in front."""
    shifted = positions + n  # (..., T)
    if not prefill:
        return shifted
    head = torch.arange(n, dtype=positions.dtype, device=positions.device)  # (n,)
    return torch.cat((head.expand(*positions.shape[:-1], n), shifted), dim=-1)  # (..., n+T)


def _hook_ids(model: nn.Module) -> list[int]:
    return [key for key, hook in model._forward_pre_hooks.items() if hook is _prepend_prompt]


def _remove_hook(model: nn.Module) -> None:
    for key in _hook_ids(model):
        del model._forward_pre_hooks[key]
        model._forward_pre_hooks_with_kwargs.pop(key, None)


# --- the technique --------------------------------------------------------------------------------------------


def inject_prompt_tuning(
    model: nn.Module,
    num_virtual_tokens: int = 8,
    init: PromptInit = "random",
    init_text: str | None = None,
    tokenizer: Any = None,
    modules_to_save: list[str] | None = None,
) -> PromptEmbedding:
    """Prepend ``num_virtual_tokens`` trainable embeddings to every input of ``model``, in place; freeze the rest.

    After the call only the parameters of the adapters attached to ``model`` train: the prompt, the trainable
    copies of ``modules_to_save``, and any other technique's. Nothing is changed if an error is raised.

    Args:
        model: A Hugging Face ``PreTrainedModel`` (encoder-only or decoder-only; a ``torch.compile`` wrapper is
            looked through).
        num_virtual_tokens: ``n``, the number of virtual tokens.
        init: ``"random"`` (N(0, 1)), ``"vocab"`` (embeddings of random vocabulary tokens) or ``"text"``
            (embeddings of ``init_text``'s tokens, repeated or cut to ``n``).
        init_text: The text for ``init="text"``.
        tokenizer: The model's tokenizer for ``init="text"``: an object, or a name or directory for
            ``AutoTokenizer.from_pretrained`` (its ``name_or_path`` is written to the PEFT config).
        modules_to_save: Modules trained and saved in full, names or dotted suffixes. None: the task head of a
            Hugging Face task model (``classifier`` / ``score`` / ``qa_outputs``), which ``from_pretrained``
            creates at random, as PEFT's task types do; ``[]``: none.

    Returns:
        The :class:`PromptEmbedding` attached at ``model.lightning_peft_prompt``.

    Raises:
        RuntimeError: If ``model`` already has a prompt.
        ValueError: If a setting is invalid, the prompt fills the model's learned positions, the text tokenises
            to nothing or to ids outside the vocabulary, or the model is encoder-decoder.
        TypeError: If ``model`` has no input embeddings or an argument has the wrong type.

    Example:
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32))
        >>> inject_prompt_tuning(model, num_virtual_tokens=4)
        PromptEmbedding(num_virtual_tokens=4, dim=16)
        >>> sorted(n for n, p in model.named_parameters() if p.requires_grad)
        ['classifier.trained_module.bias', 'classifier.trained_module.weight', 'lightning_peft_prompt.weight']
        >>> model(torch.tensor([[5, 6, 7]])).logits.shape
        torch.Size([1, 2])
    """
    who = "inject_prompt_tuning"
    check_options(num_virtual_tokens, init, init_text, modules_to_save, who)
    model = unwrap(model)
    embeddings = _input_embeddings(model, who)
    _check_model(model, int(num_virtual_tokens), who)
    to_save = _select_modules_to_save(model, None if modules_to_save is None else list(modules_to_save), who)
    weight = _initial_prompt(embeddings, int(num_virtual_tokens), init, init_text, tokenizer, who)
    record = {"init": init, "init_text": init_text, "tokenizer": _tokenizer_name(tokenizer)}
    return _inject(model, weight, record, to_save)


def _inject(model: nn.Module, weight: Tensor, record: dict[str, Any], to_save: list[str]) -> PromptEmbedding:
    """Attach ``weight`` (n, d) as the prompt, wrap ``to_save`` (checked full names) and attach the adapter."""
    wrap_modules_to_save(model, to_save)
    prompt = PromptEmbedding(weight, _position_limit(model)).train(model.training)
    model.add_module(PROMPT_MODULE, prompt)
    model.register_forward_pre_hook(_prepend_prompt, with_kwargs=True)
    attach(model, PromptTuningAdapter(prompt.num_virtual_tokens, record, to_save))
    log.info("Prompt tuning: %d virtual tokens on %s%s", prompt.num_virtual_tokens, type(model).__name__,
             f", saving {', '.join(to_save)} in full" if to_save else "")
    return prompt


def prompt_embedding(model: nn.Module) -> PromptEmbedding | None:
    """The :class:`PromptEmbedding` of ``model``, or None if it has no prompt."""
    prompt = getattr(unwrap(model), "_modules", {}).get(PROMPT_MODULE)
    return prompt if isinstance(prompt, PromptEmbedding) else None


def unload_prompt_tuning(model: nn.Module) -> nn.Module:
    """Remove the prompt from ``model`` in place: the hook, the prompt module, and the ``modules_to_save`` wrappers
    (the untouched originals go back), so ``model`` is the base model as it was before the injection.

    Raises:
        RuntimeError: If ``model`` has no prompt.
    """
    adapter = attached(model).get("prompt_tuning")
    if adapter is None:
        raise RuntimeError(
            f"unload_prompt_tuning: {type(unwrap(model)).__name__} has no soft prompt; call "
            "inject_prompt_tuning(model, ...) first."
        )
    return remove_adapter(model, adapter, merge=False)


@register
class PromptTuningAdapter(Adapter):
    """Prompt tuning's side of the adapter protocol: what :func:`inject_prompt_tuning` did to a model.

    Args:
        num_virtual_tokens: ``n``.
        init: How the prompt started: ``{"init": ..., "init_text": ..., "tokenizer": name or None}``. Recorded for
            PEFT's config; :meth:`inject` does not re-run it (the weights are loaded afterwards).
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "prompt_tuning"
    peft_type: ClassVar[str] = "PROMPT_TUNING"
    peft_fields: ClassVar[frozenset[str]] = frozenset((  # peft 0.21.2's PromptTuningConfig
        "auto_mapping", "base_model_name_or_path", "inference_mode", "modules_to_save", "num_attention_heads",
        "num_layers", "num_transformer_submodules", "num_virtual_tokens", "peft_type", "peft_version",
        "prompt_tuning_init", "prompt_tuning_init_text", "revision", "task_type", "token_dim", "tokenizer_kwargs",
        "tokenizer_name_or_path",
    ))
    mergeable: ClassVar[bool] = False
    #: PEFT's file keys for prompt learning are full keys (``prompt_embeddings``, ``base_model.<path>.<param>``):
    #: the generic I/O adds no ``base_model.model.`` prefix and strips none.
    peft_key_prefix: ClassVar[str] = ""

    def __init__(self, num_virtual_tokens: int, init: dict[str, Any], modules_to_save: Iterable[str]) -> None:
        self.num_virtual_tokens = num_virtual_tokens
        self.init = dict(init)
        self.modules_to_save = tuple(modules_to_save)

    def __repr__(self) -> str:
        return (f"PromptTuningAdapter(num_virtual_tokens={self.num_virtual_tokens}, init={self.init['init']!r}, "
                f"modules_to_save={list(self.modules_to_save)})")

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {f"{PROMPT_MODULE}.weight": model.get_submodule(PROMPT_MODULE).weight}
        for name in self.modules_to_save:
            trained = model.get_submodule(name).trained_module
            state.update(trained.state_dict(prefix=f"{name}.trained_module.", keep_vars=True))
        return state

    def config_dict(self) -> dict[str, Any]:
        # "init" is nested under "config" so that resuming ignores it (it only steers training).
        return {"config": {"num_virtual_tokens": self.num_virtual_tokens, "init": dict(self.init)},
                "modules_to_save": list(self.modules_to_save)}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> PromptTuningAdapter:
        model = unwrap(model)
        n = config["config"]["num_virtual_tokens"]
        embeddings = _input_embeddings(model, "PromptTuning")
        _check_model(model, n, "PromptTuning")
        names = {name for name, _ in model.named_modules()}
        absent = [name for name in config["modules_to_save"] if name not in names]
        if absent:
            raise ValueError(
                f"PromptTuning: the recorded adapter names module {absent[0]!r}, which {type(model).__name__} does "
                "not have; the checkpoint was written for another model."
            )
        weight = torch.zeros(n, _token_dim(embeddings), dtype=_prompt_dtype(embeddings),
                             device=embeddings.weight.device)
        _inject(model, weight, config["config"]["init"], list(config["modules_to_save"]))
        return attached(model)["prompt_tuning"]

    def unload(self, model: nn.Module, merge: bool) -> None:
        if merge:
            raise RuntimeError(
                "PromptTuningAdapter: a soft prompt cannot be folded into the base weights; unload with merge=False "
                "(unload_prompt_tuning), or keep the model adapted and save the adapter (save_adapter)."
            )
        model = unwrap(model)
        _remove_hook(model)
        del model._modules[PROMPT_MODULE]
        for name in self.modules_to_save:
            set_submodule(model, name, model.get_submodule(name).original_module)
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """PEFT's full file keys: ``prompt_embeddings`` (n, d) and ``base_model.<module>.<param>`` for saved modules."""
        state = {PEFT_PROMPT_KEY: unwrap(model).get_submodule(PROMPT_MODULE).weight}
        for key, value in self.state(model).items():
            if not key.startswith(f"{PROMPT_MODULE}."):
                state[PEFT_MODULE_PREFIX + clean_key(plain_key(key))] = value
        return state

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        model = unwrap(model)
        config = getattr(model, "config", None)
        init = _PEFT_INITS.get(self.init.get("init"), "RANDOM")
        if init == "TEXT" and not self.init.get("tokenizer"):
            # PEFT's config refuses TEXT without a tokenizer name; a nameless tokenizer object is recorded as
            # RANDOM (loading never re-runs the initialisation: the weights come from the file).
            init = "RANDOM"
        return {
            "peft_type": self.peft_type,
            "task_type": _task_type(model),
            "base_model_name_or_path": base_model_name(model),
            "revision": None,
            "inference_mode": True,
            "num_virtual_tokens": self.num_virtual_tokens,
            "token_dim": _token_dim(_input_embeddings(model, "save_adapter")),
            "num_transformer_submodules": 1,
            "num_attention_heads": _config_value(config, "num_attention_heads", "n_head", "num_heads"),
            "num_layers": _config_value(config, "num_hidden_layers", "num_layers", "n_layer"),
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "prompt_tuning_init": init,
            "prompt_tuning_init_text": self.init.get("init_text"),
            "tokenizer_name_or_path": self.init.get("tokenizer") if init == "TEXT" else None,
            "tokenizer_kwargs": None,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        n = _peft_num_virtual_tokens(config, source)
        if n != self.num_virtual_tokens:
            raise ValueError(
                f"load_adapter: {source} has num_virtual_tokens={n}, but the model's prompt has "
                f"{self.num_virtual_tokens}. Load it into a model without a prompt."
            )

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> PromptTuningAdapter:
        if not isinstance(config, dict) or config.get("peft_type") != cls.peft_type:
            peft_type = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"load_adapter: {source} has peft_type={peft_type!r}; expected 'PROMPT_TUNING'.")
        model = unwrap(model)
        n = _peft_num_virtual_tokens(config, source)
        submodules = config.get("num_transformer_submodules")
        if submodules not in (None, 1):
            raise ValueError(
                f"load_adapter: {source} has num_transformer_submodules={submodules!r} (an encoder-decoder prompt); "
                "lightning-peft prompts one stack only. Load it with Hugging Face PEFT instead."
            )
        embeddings = _input_embeddings(model, "load_adapter")
        dim = _token_dim(embeddings)
        if config.get("token_dim") not in (None, dim):
            raise ValueError(
                f"load_adapter: {source} has token_dim={config['token_dim']}, but {type(model).__name__}'s input "
                f"embeddings are {dim} wide. The adapter was trained on another model."
            )
        _check_model(model, n, "load_adapter")
        names = [name for name, _ in model.named_modules() if name]
        # PEFT's SEQ_CLS writes ["classifier", "score", ...] whatever the model calls its head: drop the absent.
        wanted = [m for m in dict.fromkeys(config.get("modules_to_save") or [])
                  if any(name == m or name.endswith(f".{m}") for name in names)]
        to_save = _select_modules_to_save(model, wanted, "load_adapter")
        peft_init = {v: k for k, v in _PEFT_INITS.items()}.get(str(config.get("prompt_tuning_init")), "random")
        text = peft_init == "text"
        record = {"init": peft_init, "init_text": config.get("prompt_tuning_init_text") if text else None,
                  "tokenizer": config.get("tokenizer_name_or_path") if text else None}
        weight = torch.zeros(n, dim, dtype=_prompt_dtype(embeddings), device=embeddings.weight.device)
        _inject(model, weight, record, to_save)
        return attached(model)["prompt_tuning"]


def _peft_num_virtual_tokens(config: dict[str, Any], source: str) -> int:
    n = config.get("num_virtual_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"load_adapter: {source} has num_virtual_tokens={n!r}; it is not a complete prompt-tuning "
                         "config (a positive integer is needed).")
    return n


def _task_type(model: nn.Module) -> str:
    """PEFT's task type for ``model``: which ``PeftModelFor*`` class ``PeftModel.from_pretrained`` builds."""
    name = type(model).__name__
    return next((task for suffix, task in _TASK_TYPES.items() if name.endswith(suffix)), "FEATURE_EXTRACTION")


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
