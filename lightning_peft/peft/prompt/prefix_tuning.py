"""Prefix tuning: trained key/value vectors in front of every attention layer, passed as the model's attention cache.

Paper: Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation", arXiv:2101.00190.

The base model is frozen. Every attention layer ``l`` attends over ``n`` trained key/value vectors before the real
tokens' own; the queries are the real tokens only:

```text
K_l = [P_l^K ; X W_K]    V_l = [P_l^V ; X W_V]    out_l = softmax(Q K_l^T / sqrt(d_h) + mask) V_l
```

The prefix reaches the model as its attention cache (``cache`` in transformers 5, ``past_key_values`` before): a
forward pre-hook on the Hugging Face model fills a ``DynamicCache`` with ``P``, puts ``n`` ones in front of the
``attention_mask``, and adds ``n`` to explicit ``position_ids``. The model counts the cache, so the real tokens sit at
positions ``n, n+1, ...`` (after the prefix). All of it is what Hugging Face PEFT 0.21.2 does, so a model adapted here
and the same prefix under PEFT give the same outputs.

Reparameterisation (``prefix_projection=True``, the paper's MLP, PEFT's ``PrefixEncoder``): ``P = MLP(E)`` with ``E`` an
``(n, d)`` embedding and ``MLP = Linear(d, h) -> tanh -> Linear(h, 2 L d_kv)``. After training,
[`fold_prefix_projection`][lightning_peft.peft.fold_prefix_projection] replaces the MLP by the table it produces
(outputs are bit-identical).

Shapes (``L`` layers, ``H`` key/value heads, ``d_h`` head size, ``d_kv = H d_h``: grouped-query models such as Llama
have fewer key/value heads than query heads, and the prefix has the key/value ones):

| tensor | shape | note |
| --- | --- | --- |
| table | ``(n, L * 2 * H * d_h)`` | PEFT's ``prompt_embeddings``; columns ``(l, k/v, h, d)`` |
| MLP input ``E`` | ``(n, d)`` | ``d`` = ``token_dim`` (= ``d_kv``), only with projection |
| key / value of l | ``(B, H, n, d_h)`` | one ``DynamicCache`` layer |
| attention mask | ``(B, n + past + T)`` | ``n`` ones in front of the caller's mask |

The parameters live in a small module at ``model.lightning_peft_prefix`` (`PREFIX_ATTRIBUTE`; state-dict
keys ``lightning_peft_prefix.embedding.weight`` and, with the projection, ``lightning_peft_prefix.transform.*``).
Supported: Hugging Face decoder models (GPT-2, Llama, ...) and encoder models (BERT, ...) whose forward, or whose
backbone's forward (``BertForSequenceClassification`` -> ``bert``), takes an attention cache; ``generate()`` works on
causal LMs. Not supported: encoder-decoder models, gradient checkpointing (transformers then drops the cache in
training), and models PEFT builds a special cache for (Gemma 2/3/4, Bloom, GPTBigCode).

Examples:
    >>> import torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from lightning_peft.peft.prompt.prefix_tuning import inject_prefix_tuning
    >>> config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, eos_token_id=0)
    >>> model = GPT2LMHeadModel(config)
    >>> prefix = inject_prefix_tuning(model, num_virtual_tokens=4)
    >>> tuple(prefix.table().shape)  # (n, L * 2 * d_kv)
    (4, 64)
    >>> model(input_ids=torch.zeros(1, 3, dtype=torch.long)).logits.shape
    torch.Size([1, 3, 64])
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..._checks import boolean, integer, names
from .._base_identity import task_type
from .._common import refuse_absent, refuse_second_injection, require
from .prefix_cache import PREFIX_ATTRIBUTE, PrefixEncoder, PrefixHook, cache_module, geometry, refuse_gradient_checkpointing
from .shared import PROMPT_LEARNING_FIELDS, PromptLearningAdapter
from ..adapter import attach, attached, refreeze, register, remove_adapter, trainable_parameters, unwrap
from ..modules_to_save import present_modules, select_modules_to_save, wrap_modules_to_save

__all__ = ["PREFIX_ATTRIBUTE", "PrefixEncoder", "PrefixTuningAdapter", "PrefixTuningConfig", "fold_prefix_projection",
           "inject_prefix_tuning", "prefix_tuning_spec", "unload_prefix_tuning"]

log = logging.getLogger(__name__)

# model_type values for which PEFT 0.21.2 post-processes the cache or builds another kind of cache.
_SPECIAL_CACHES = ("bloom", "gpt_bigcode", "gemma2", "gemma3_text", "gemma4")
_WHO = "PrefixTuning"


@dataclass(frozen=True)
class PrefixTuningConfig:
    """What prefix tuning adds. Validated on construction.

    Args:
        num_virtual_tokens: Number ``n`` of key/value vectors in front of every attention layer.
        prefix_projection: Produce the prefix with the paper's MLP (trains more stably; fold it after training).
        encoder_hidden_size: Hidden size ``h`` of that MLP; None: the key/value width ``d_kv`` (PEFT's default).
        modules_to_save: Modules trained and saved in full (names or dotted suffixes), e.g. a new classifier head.
            None: a Hugging Face task model's head (``classifier`` / ``score`` / ``qa_outputs``); ``[]``: none.
    """

    num_virtual_tokens: int = 20
    prefix_projection: bool = False
    encoder_hidden_size: int | None = None
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen: normalised values are set this way; the caller's objects are not mutated
        normal(self, "num_virtual_tokens", integer(_WHO, "num_virtual_tokens", self.num_virtual_tokens, minimum=1,
                                                   example="20"))
        boolean(_WHO, "prefix_projection", self.prefix_projection)
        if self.encoder_hidden_size is not None:
            normal(self, "encoder_hidden_size", integer(_WHO, "encoder_hidden_size", self.encoder_hidden_size,
                                                        minimum=1, example="512"))
            if not self.prefix_projection:
                raise ValueError(
                    f"PrefixTuning(encoder_hidden_size={self.encoder_hidden_size}) sizes the projection MLP, but "
                    "prefix_projection=False has none. Set prefix_projection=True, or leave encoder_hidden_size out."
                )
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", names(_WHO, "modules_to_save", self.modules_to_save))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``PrefixTuningConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    def agrees(self, asked: PrefixTuningConfig) -> bool:
        """Whether a prefix made with this config is the one ``asked`` describes: a folded projection counts as the
        projection it came from, and ``modules_to_save`` left None on either side agrees with any."""
        if self.num_virtual_tokens != asked.num_virtual_tokens:
            return False
        if asked.modules_to_save is not None and self.modules_to_save is not None:
            if list(self.modules_to_save) != list(asked.modules_to_save):
                return False
        if self.prefix_projection:
            return (asked.prefix_projection, asked.encoder_hidden_size) == (True, self.encoder_hidden_size)
        return True  # a table: trained without projection, or folded at the end of a fit


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"inject_prefix_tuning: {type(model).__name__} is an encoder-decoder model; lightning-peft's prefix tuning "
            "covers decoder and encoder models (GPT-2, Llama, BERT). Use Hugging Face PEFT for this model."
        )
    model_type = getattr(config, "model_type", "")
    if model_type in _SPECIAL_CACHES:
        raise TypeError(
            f"inject_prefix_tuning: {type(model).__name__} (model_type {model_type!r}) needs a special attention cache "
            "that Hugging Face PEFT builds for it and lightning-peft does not. Use Hugging Face PEFT for this model."
        )
    refuse_gradient_checkpointing(model, "inject_prefix_tuning")


@register
class PrefixTuningAdapter(PromptLearningAdapter):
    """Prefix tuning's side of the adapter protocol: what
    [`inject_prefix_tuning`][lightning_peft.peft.inject_prefix_tuning] did to a model.

    PEFT's file keys for prompt-learning methods carry no ``base_model.model.`` prefix: the prefix is
    ``prompt_embeddings`` and a ``modules_to_save`` tensor is ``base_model.<module path>.<tensor>``, so
    `peft_state` gives the file's keys verbatim (``peft_key_prefix = ""``).

    Args:
        config: The config used (``prefix_projection`` as asked;
            [`projected`][lightning_peft.peft.PrefixTuningAdapter.projected] says whether the MLP is still there).
        modules_to_save: Full names of the modules trained and saved in full.
        handle: The forward pre-hook's handle.
    """

    kind: ClassVar[str] = "prefix_tuning"
    peft_type: ClassVar[str] = "PREFIX_TUNING"
    peft_fields: ClassVar[frozenset[str]] = PROMPT_LEARNING_FIELDS | {  # peft 0.21.2's PrefixTuningConfig
        "encoder_hidden_size", "init_weights", "prefix_projection"}
    module_name: ClassVar[str] = PREFIX_ATTRIBUTE
    technique: ClassVar[str] = "prefix tuning"
    thing: ClassVar[str] = "prefix"
    not_a_weight: ClassVar[str] = "extra attention keys and values"

    def __init__(self, config: PrefixTuningConfig, modules_to_save: Iterable[str], handle: Any) -> None:
        super().__init__(modules_to_save)
        self.config = config
        self.handle = handle

    def __repr__(self) -> str:
        return f"PrefixTuningAdapter({self.config}, modules_to_save={list(self.modules_to_save)})"

    @staticmethod
    def encoder(model: nn.Module) -> PrefixEncoder:
        return getattr(unwrap(model), PREFIX_ATTRIBUTE)

    def projected(self, model: nn.Module) -> bool:
        """Whether the prefix is still produced by the MLP (not yet folded)."""
        return self.encoder(model).transform is not None

    def config_dict(self) -> dict[str, Any]:
        # The current layout (a folded adapter records prefix_projection=False), so inject rebuilds these tensors.
        return {"config": self.config.to_dict(), "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether the prefix is the one ``config["config"]`` asks for (a `config_dict`, or a callback's request of that
        shape), by [`PrefixTuningConfig.agrees`][lightning_peft.peft.PrefixTuningConfig.agrees]."""
        return self.config.agrees(PrefixTuningConfig(**config["config"]))

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> PrefixTuningAdapter:
        model = unwrap(model)
        refuse_absent(model, config["modules_to_save"], "PrefixTuning: the recorded adapter")
        ours = PrefixTuningConfig(**{**config["config"], "modules_to_save": list(config["modules_to_save"])})
        inject_prefix_tuning(model, **ours.to_dict())
        return attached(model)[cls.kind]

    def table(self, model: nn.Module) -> Tensor:
        """The table, folded if the MLP is still there: ``(n, L * 2 * d_kv)``."""
        return self.encoder(model).table()

    def remove_hook(self, model: nn.Module) -> None:
        self.handle.remove()

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        model = unwrap(model)
        g = geometry(model)
        transform = self.encoder(model).transform
        return {
            **self.peft_common(model, task_type(model), self.config.num_virtual_tokens, g.token_dim, g.num_heads,
                               g.num_layers),
            "encoder_hidden_size": g.token_dim if transform is None else transform[0].out_features,
            "prefix_projection": transform is not None,
            "init_weights": None,
        }

    def peft_problems(self, model: nn.Module) -> list[str]:
        if task_type(unwrap(model)) is None:
            return [f"PEFT has no task type for {type(unwrap(model)).__name__}, and a PeftModel without one runs the "
                    "base model without the prefix"]
        return []

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        if self.projected(model):
            raise RuntimeError(
                f"load_adapter: the model's prefix is produced by a projection MLP, and {source} holds only the table "
                "(prompt_embeddings). Call fold_prefix_projection(model) first, or load into a model without prefix "
                "tuning."
            )
        n = _peft_geometry(model, config, source)
        if n != self.config.num_virtual_tokens:
            raise ValueError(
                f"load_adapter: {source} has num_virtual_tokens={n}, but the model's prefix has "
                f"{self.config.num_virtual_tokens}. Load it into a model without prefix tuning."
            )

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> PrefixTuningAdapter:
        n = _peft_geometry(model, config, source)
        present = present_modules(unwrap(model), config.get("modules_to_save"), source)
        # The file holds the table (PEFT folds a projection when it saves), so the adapter is a plain table.
        inject_prefix_tuning(model, num_virtual_tokens=n, modules_to_save=present)
        return attached(model)[cls.kind]


def _peft_geometry(model: nn.Module, config: dict[str, Any], source: str) -> int:
    """``num_virtual_tokens`` of a PEFT ``PrefixTuningConfig`` dict; raises if its shape is not ``model``'s."""
    n = PrefixTuningAdapter.peft_num_virtual_tokens(config, source)
    g = geometry(unwrap(model))
    ours = {"num_layers": g.num_layers, "token_dim": g.token_dim, "num_attention_heads": g.num_heads}
    for key, value in ours.items():
        if config.get(key) is not None and config[key] != value:
            raise ValueError(
                f"load_adapter: {source} has {key}={config[key]}, but {type(unwrap(model)).__name__} needs {value} "
                "(its key/value shape); the prefix was trained for another model."
            )
    return n


def prefix_tuning_spec(model: nn.Module) -> PrefixTuningAdapter | None:
    """The [`PrefixTuningAdapter`][lightning_peft.peft.PrefixTuningAdapter]
    [`inject_prefix_tuning`][lightning_peft.peft.inject_prefix_tuning] left on ``model``, or None."""
    return attached(model).get(PrefixTuningAdapter.kind)


def _require(model: nn.Module, who: str) -> PrefixTuningAdapter:
    return require(model, PrefixTuningAdapter.kind, who, "prefix-tuning adapter", "inject_prefix_tuning")


def inject_prefix_tuning(
    model: nn.Module,
    num_virtual_tokens: int = 20,
    prefix_projection: bool = False,
    encoder_hidden_size: int | None = None,
    modules_to_save: list[str] | None = None,
) -> PrefixEncoder:
    """Give every attention layer of ``model`` a trained prefix, in place, and freeze everything else.

    After the call only the parameters of the adapters attached to ``model`` train: the prefix (table or MLP), the
    trainable copies of ``modules_to_save``, and any other technique's. Nothing is changed if an error is raised.

    Args:
        model: A Hugging Face decoder or encoder model (``PreTrainedModel``) whose forward, or whose backbone's,
            takes an attention cache; a ``torch.compile`` wrapper is looked through.
        num_virtual_tokens: Number ``n`` of prefix positions.
        prefix_projection: Produce the prefix with an MLP (fold it with
            [`fold_prefix_projection`][lightning_peft.peft.fold_prefix_projection] afterwards).
        encoder_hidden_size: Hidden size of that MLP; None: the key/value width.
        modules_to_save: Modules trained and saved in full. None: a Hugging Face task model's head; ``[]``: none.

    Returns:
        The new [`PrefixEncoder`][lightning_peft.peft.PrefixEncoder] (``model.lightning_peft_prefix``).

    Raises:
        RuntimeError: If ``model`` already has a prefix, or gradient checkpointing is on.
        TypeError: If ``model`` takes no attention cache, is an encoder-decoder model, or an argument has a wrong type.
        ValueError: If an argument is out of range or ``modules_to_save`` matches nothing.
    """
    config = PrefixTuningConfig(num_virtual_tokens, prefix_projection, encoder_hidden_size, modules_to_save)
    model = unwrap(model)
    there = prefix_tuning_spec(model) is not None or hasattr(model, PREFIX_ATTRIBUTE)
    refuse_second_injection("inject_prefix_tuning", model, f"a prefix ({PREFIX_ATTRIBUTE})" if there else None,
                            "prefix tuning was")
    name, module, argument = cache_module(model)
    _check_model(model)
    shape = geometry(model)
    to_save = select_modules_to_save(model, config.modules_to_save, _WHO)
    hidden = (config.encoder_hidden_size or shape.token_dim) if config.prefix_projection else None
    reference = next(iter(model.parameters()), None)
    encoder = PrefixEncoder(config.num_virtual_tokens, shape.width, shape.token_dim, hidden)
    if reference is not None:
        encoder.to(device=reference.device, dtype=reference.dtype)
    wrap_modules_to_save(model, to_save)
    model.add_module(PREFIX_ATTRIBUTE, encoder)
    handle = module.register_forward_pre_hook(PrefixHook(encoder, shape, argument, model), with_kwargs=True)
    attach(model, PrefixTuningAdapter(config, to_save, handle))
    log.info("PrefixTuning: %d virtual tokens on %s (cache passed to %s); %s", config.num_virtual_tokens,
             type(model).__name__, name or "the model itself", trainable_parameters(model))
    return encoder


def fold_prefix_projection(model: nn.Module) -> Tensor:
    """Replace the prefix MLP of ``model`` by the table it produces, in place; outputs stay bit-identical.

    Idempotent: a prefix that is already a table is left alone. The folded adapter has ``n * L * 2 * d_kv``
    parameters, which is what PEFT saves (``prompt_embeddings``) and what training can continue from.

    Returns:
        The table, ``(n, L * 2 * d_kv)`` (the new parameter, detached).

    Raises:
        RuntimeError: If ``model`` has no prefix-tuning adapter.
    """
    spec = _require(model, "fold_prefix_projection")
    encoder = spec.encoder(model)
    if encoder.transform is not None:
        with torch.no_grad():
            table = encoder.table()  # (n, L*2*d_kv)
        encoder.embedding = nn.Embedding(*table.shape, device=table.device, dtype=table.dtype)
        with torch.no_grad():
            encoder.embedding.weight.copy_(table)
        encoder.transform = None
        spec.config = dataclasses.replace(spec.config, prefix_projection=False, encoder_hidden_size=None)
        refreeze(model)
    return encoder.embedding.weight.detach()


def unload_prefix_tuning(model: nn.Module) -> nn.Module:
    """Remove prefix tuning from ``model`` in place: the hook, the prefix, and the ``modules_to_save`` copies
    (the original modules come back). Returns the plain model.

    Raises:
        RuntimeError: If ``model`` has no prefix-tuning adapter.
    """
    return remove_adapter(model, _require(model, "unload_prefix_tuning"), merge=False)
