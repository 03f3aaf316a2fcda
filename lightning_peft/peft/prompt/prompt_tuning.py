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
attached to the Hugging Face model under `PROMPT_MODULE` (state-dict key ``lightning_peft_prompt.weight``),
and a forward pre-hook on that model rewrites each call (positional arguments are bound to the ``forward``
signature first) as Hugging Face PEFT's ``PeftModelFor*`` classes do, so outputs equal PEFT's:

| argument | given | passed to the model |
| --- | --- | --- |
| ``input_ids`` | (B, T) | None; ``inputs_embeds`` = [P; E(input_ids)] (B, n+T, d) |
| ``inputs_embeds`` | (B, T, d) | [P; inputs_embeds] (B, n+T, d) |
| ``attention_mask`` | (B, T) | [1 ... 1; mask] (B, n+T) |
| ``token_type_ids`` | (B, T) | [0 ... 0; ids] (B, n+T) |
| ``position_ids`` | (..., T) | [0 ... n-1; ids + n] (..., n+T) |
| ``labels`` | (B, T) integer (per token) | [-100 ... -100; labels] (B, n+T); (B,) unchanged |
| ``start/end_positions`` | (B,) (question answering) | + n |

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
`PromptTuningAdapter.peft_key_prefix` is empty.

Shapes: ``B`` batch, ``T`` real tokens, ``n`` virtual tokens, ``d`` the input-embedding width, ``V`` vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..._checks import choice, integer, names
from .._base_identity import task_type
from .._common import adapter_dtype, refuse_absent, refuse_second_injection, require
from .embedding import (
    PROMPT_MODULE,
    PromptEmbedding,
    initial_prompt,
    input_embeddings,
    position_limit,
    prepend_prompt,
    token_dim,
    tokenizer_name,
)
from .shared import (
    PEFT_MODULE_PREFIX,
    PEFT_PROMPT_KEY,
    PROMPT_LEARNING_FIELDS,
    PromptLearningAdapter,
)
from ..adapter import attach, attached, register, remove_adapter, unwrap
from ..modules_to_save import present_modules, select_modules_to_save, wrap_modules_to_save

__all__ = ["PEFT_MODULE_PREFIX", "PEFT_PROMPT_KEY", "PROMPT_MODULE", "PromptEmbedding", "PromptTuningAdapter",
           "check_options", "inject_prompt_tuning", "prompt_embedding", "unload_prompt_tuning"]

log = logging.getLogger(__name__)

PromptInit = Literal["random", "vocab", "text"]

_INITS = ("random", "vocab", "text")
_PEFT_INITS = {"random": "RANDOM", "vocab": "SAMPLE_VOCAB", "text": "TEXT"}
_WHO = "PromptTuning"


# --- checks --------------------------------------------------------------------------------------------------


def check_options(num_virtual_tokens: object, init: object, init_text: object, modules_to_save: object,
                  who: str) -> None:
    """Raise for invalid options (the checks that need no model); ``who`` names the caller in the message.

    Shared by [`inject_prompt_tuning`][lightning_peft.peft.inject_prompt_tuning] and the ``PromptTuning`` callback,
    which checks in ``__init__``.
    """
    integer(who, "num_virtual_tokens", num_virtual_tokens, minimum=1, example="20")
    choice(who, "init", init, _INITS)
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
    if modules_to_save is not None:
        names(who, "modules_to_save", modules_to_save)


def _check_model(model: nn.Module, num_virtual_tokens: int, who: str) -> None:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{who}: {type(model).__name__} is an encoder-decoder model; prompt tuning here supports encoder-only and "
            "decoder-only models. Use Hugging Face PEFT (task_type='SEQ_2_SEQ_LM') for it."
        )
    there = hasattr(model, PROMPT_MODULE) or PromptTuningAdapter.kind in attached(model)
    refuse_second_injection(who, model, f"a soft prompt ({PROMPT_MODULE})" if there else None, "prompt tuning was")
    limit = position_limit(model)
    if limit is not None and num_virtual_tokens >= limit:
        raise ValueError(
            f"{who}(num_virtual_tokens={num_virtual_tokens}): {type(model).__name__} has {limit} learned positions, "
            "so the prompt leaves no room for a real token. Use fewer virtual tokens."
        )


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
        The [`PromptEmbedding`][lightning_peft.peft.PromptEmbedding] attached at ``model.lightning_peft_prompt``.

    Raises:
        RuntimeError: If ``model`` already has a prompt.
        ValueError: If a setting is invalid, the prompt fills the model's learned positions, the text tokenises
            to nothing or to ids outside the vocabulary, or the model is encoder-decoder.
        TypeError: If ``model`` has no input embeddings or an argument has the wrong type.

    Examples:
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
    embeddings = input_embeddings(model, who)
    _check_model(model, int(num_virtual_tokens), who)
    to_save = select_modules_to_save(model, None if modules_to_save is None else list(modules_to_save), who)
    weight = initial_prompt(embeddings, int(num_virtual_tokens), init, init_text, tokenizer, who)
    record = {"init": init, "init_text": init_text, "tokenizer": tokenizer_name(tokenizer)}
    return _inject(model, weight, record, to_save)


def _inject(model: nn.Module, weight: Tensor, record: dict[str, Any], to_save: list[str]) -> PromptEmbedding:
    """Attach ``weight`` (n, d) as the prompt, wrap ``to_save`` (checked full names) and attach the adapter."""
    wrap_modules_to_save(model, to_save)
    prompt = PromptEmbedding(weight, position_limit(model)).train(model.training)
    model.add_module(PROMPT_MODULE, prompt)
    model.register_forward_pre_hook(prepend_prompt, with_kwargs=True)
    attach(model, PromptTuningAdapter(prompt.num_virtual_tokens, record, to_save))
    log.info("Prompt tuning: %d virtual tokens on %s%s", prompt.num_virtual_tokens, type(model).__name__,
             f", saving {', '.join(to_save)} in full" if to_save else "")
    return prompt


def _empty_prompt(model: nn.Module, n: int, who: str) -> Tensor:
    """A zero prompt (n, d) for a prompt whose weights are loaded afterwards."""
    embeddings = input_embeddings(model, who)
    weight = embeddings.weight
    return torch.zeros(n, token_dim(embeddings), dtype=adapter_dtype(weight), device=weight.device)


def prompt_embedding(model: nn.Module) -> PromptEmbedding | None:
    """The [`PromptEmbedding`][lightning_peft.peft.PromptEmbedding] of ``model``, or None if it has no prompt."""
    prompt = getattr(unwrap(model), "_modules", {}).get(PROMPT_MODULE)
    return prompt if isinstance(prompt, PromptEmbedding) else None


def unload_prompt_tuning(model: nn.Module) -> nn.Module:
    """Remove the prompt from ``model`` in place: the hook, the prompt module, and the ``modules_to_save`` wrappers
    (the untouched originals go back), so ``model`` is the base model as it was before the injection.

    Raises:
        RuntimeError: If ``model`` has no prompt.
    """
    adapter = require(model, PromptTuningAdapter.kind, "unload_prompt_tuning", "soft prompt", "inject_prompt_tuning")
    return remove_adapter(model, adapter, merge=False)


@register
class PromptTuningAdapter(PromptLearningAdapter):
    """Prompt tuning's side of the adapter protocol: what
    [`inject_prompt_tuning`][lightning_peft.peft.inject_prompt_tuning] did to a model.

    Args:
        num_virtual_tokens: ``n``.
        init: How the prompt started: ``{"init": ..., "init_text": ..., "tokenizer": name or None}``. Recorded for
            PEFT's config; `inject` does not re-run it (the weights are loaded afterwards).
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "prompt_tuning"
    peft_type: ClassVar[str] = "PROMPT_TUNING"
    peft_fields: ClassVar[frozenset[str]] = PROMPT_LEARNING_FIELDS | {  # peft 0.21.2's PromptTuningConfig
        "prompt_tuning_init", "prompt_tuning_init_text", "tokenizer_kwargs", "tokenizer_name_or_path"}
    #: Keys that only steer training, how the prompt started: ``config_dict()["config"]["init"]``, and the fields of
    #: that record as the ``PromptTuning`` callback's settings name them one by one.
    training_only: ClassVar[tuple[str, ...]] = ("init", "init_text", "tokenizer")
    module_name: ClassVar[str] = PROMPT_MODULE
    technique: ClassVar[str] = "prompt tuning"
    thing: ClassVar[str] = "prompt"
    not_a_weight: ClassVar[str] = "extra input embeddings"

    def __init__(self, num_virtual_tokens: int, init: dict[str, Any], modules_to_save: Iterable[str]) -> None:
        super().__init__(modules_to_save)
        self.num_virtual_tokens = num_virtual_tokens
        self.init = dict(init)

    def __repr__(self) -> str:
        return (f"PromptTuningAdapter(num_virtual_tokens={self.num_virtual_tokens}, init={self.init['init']!r}, "
                f"modules_to_save={list(self.modules_to_save)})")

    def config_dict(self) -> dict[str, Any]:
        # "init" is nested under "config" so that resuming ignores it (it only steers training).
        return {"config": {"num_virtual_tokens": self.num_virtual_tokens, "init": dict(self.init)},
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether the prompt has the length ``config["config"]["num_virtual_tokens"]`` asks for (a
        `config_dict`, or a callback's request of that shape): the initialisation only steers training."""
        return config.get("config", {}).get("num_virtual_tokens") == self.num_virtual_tokens

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> PromptTuningAdapter:
        model = unwrap(model)
        n = config["config"]["num_virtual_tokens"]
        weight = _empty_prompt(model, n, _WHO)
        _check_model(model, n, _WHO)
        refuse_absent(model, config["modules_to_save"], "PromptTuning: the recorded adapter")
        _inject(model, weight, config["config"]["init"], list(config["modules_to_save"]))
        return attached(model)[cls.kind]

    def table(self, model: nn.Module) -> Tensor:
        return unwrap(model).get_submodule(PROMPT_MODULE).weight

    def remove_hook(self, model: nn.Module) -> None:
        for key in [key for key, hook in model._forward_pre_hooks.items() if hook is prepend_prompt]:
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        model = unwrap(model)
        config = getattr(model, "config", None)
        init = _PEFT_INITS.get(self.init.get("init"), "RANDOM")
        if init == "TEXT" and not self.init.get("tokenizer"):
            # PEFT's config refuses TEXT without a tokenizer name; a nameless tokenizer object is recorded as
            # RANDOM (loading never re-runs the initialisation: the weights come from the file).
            init = "RANDOM"
        return {
            **self.peft_common(model, task_type(model) or "FEATURE_EXTRACTION", self.num_virtual_tokens,
                               token_dim(input_embeddings(model, "save_adapter")),
                               _config_value(config, "num_attention_heads", "n_head", "num_heads"),
                               _config_value(config, "num_hidden_layers", "num_layers", "n_layer")),
            "prompt_tuning_init": init,
            "prompt_tuning_init_text": self.init.get("init_text"),
            "tokenizer_name_or_path": self.init.get("tokenizer") if init == "TEXT" else None,
            "tokenizer_kwargs": None,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        n = self.peft_num_virtual_tokens(config, source)
        if n != self.num_virtual_tokens:
            raise ValueError(
                f"load_adapter: {source} has num_virtual_tokens={n}, but the model's prompt has "
                f"{self.num_virtual_tokens}. Load it into a model without a prompt."
            )

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> PromptTuningAdapter:
        n = cls.peft_num_virtual_tokens(config, source)
        model = unwrap(model)
        weight = _empty_prompt(model, n, "load_adapter")
        if config.get("token_dim") not in (None, weight.shape[1]):
            raise ValueError(
                f"load_adapter: {source} has token_dim={config['token_dim']}, but {type(model).__name__}'s input "
                f"embeddings are {weight.shape[1]} wide. The adapter was trained on another model."
            )
        _check_model(model, n, "load_adapter")
        present = present_modules(model, config.get("modules_to_save"), source)
        to_save = select_modules_to_save(model, present, "load_adapter")
        peft_init = {v: k for k, v in _PEFT_INITS.items()}.get(str(config.get("prompt_tuning_init")), "random")
        text = peft_init == "text"
        record = {"init": peft_init, "init_text": config.get("prompt_tuning_init_text") if text else None,
                  "tokenizer": config.get("tokenizer_name_or_path") if text else None}
        _inject(model, weight, record, to_save)
        return attached(model)[cls.kind]


def _config_value(config: Any, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None
