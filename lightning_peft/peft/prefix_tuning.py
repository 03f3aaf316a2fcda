"""Prefix tuning: trained key/value vectors in front of every attention layer, passed as the model's attention cache.

Paper: Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation", arXiv:2101.00190.

The base model is frozen. Every attention layer ``l`` attends over ``n`` trained key/value vectors before the real
tokens' own; the queries are the real tokens only::

    K_l = [P_l^K ; X W_K]    V_l = [P_l^V ; X W_V]    out_l = softmax(Q K_l^T / sqrt(d_h) + mask) V_l

The prefix reaches the model as its attention cache (``cache`` in transformers 5, ``past_key_values`` before): a
forward pre-hook on the Hugging Face model fills a ``DynamicCache`` with ``P``, puts ``n`` ones in front of the
``attention_mask``, and adds ``n`` to explicit ``position_ids``. The model counts the cache, so the real tokens sit at
positions ``n, n+1, ...`` (after the prefix). All of it is what Hugging Face PEFT 0.21.2 does, so a model adapted here
and the same prefix under PEFT give the same outputs.

Reparameterisation (``prefix_projection=True``, the paper's MLP, PEFT's ``PrefixEncoder``): ``P = MLP(E)`` with
``E`` an ``(n, d)`` embedding and ``MLP = Linear(d, h) -> tanh -> Linear(h, 2 L d_kv)``. After training,
:func:`fold_prefix_projection` replaces the MLP by the table it produces (outputs are bit-identical).

Shapes (``L`` layers, ``H`` key/value heads, ``d_h`` head size, ``d_kv = H d_h``: grouped-query models such as Llama
have fewer key/value heads than query heads, and the prefix has the key/value ones):

=================  ==============================  =====================================================
tensor             shape                           note
=================  ==============================  =====================================================
table              ``(n, L * 2 * H * d_h)``        PEFT's ``prompt_embeddings``; columns ``(l, k/v, h, d)``
MLP input ``E``    ``(n, d)``                      ``d`` = ``token_dim`` (= ``d_kv``), only with projection
key / value of l   ``(B, H, n, d_h)``              one ``DynamicCache`` layer
attention mask     ``(B, n + past + T)``           ``n`` ones in front of the caller's mask
=================  ==============================  =====================================================

The parameters live in a small module at ``model.lightning_peft_prefix`` (:data:`PREFIX_ATTRIBUTE`; state-dict
keys ``lightning_peft_prefix.embedding.weight`` and, with the projection, ``lightning_peft_prefix.transform.*``).
Supported: Hugging Face decoder models (GPT-2, Llama, ...) and encoder models (BERT, ...) whose forward, or whose
backbone's forward (``BertForSequenceClassification`` -> ``bert``), takes an attention cache; ``generate()`` works on
causal LMs. Not supported: encoder-decoder models, gradient checkpointing (transformers then drops the cache in
training), and models PEFT builds a special cache for (Gemma 2/3/4, Bloom, GPTBigCode).

Example:
    >>> import torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from lightning_peft.peft.prefix_tuning import inject_prefix_tuning
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
import inspect
import logging
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .adapter import (
    Adapter, attach, attached, base_model_name, clean_key, detach, refreeze, register, remove_adapter, unwrap,
)
from ._common import name_matches, task_heads
from .adapter import trainable_parameters
from .modules_to_save import plain_key, saved_elsewhere, select_named, set_submodule, wrap_modules_to_save

log = logging.getLogger(__name__)

PREFIX_ATTRIBUTE = "lightning_peft_prefix"
_CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers 5 name first, then the older one
# model_type values for which PEFT 0.21.2 post-processes the cache or builds another kind of cache.
_SPECIAL_CACHES = ("bloom", "gpt_bigcode", "gemma2", "gemma3_text", "gemma4")
# PEFT task types by the class-name suffix of a Hugging Face model (a PeftModel without one ignores the prefix).
_TASK_TYPES = {
    "ForCausalLM": "CAUSAL_LM",
    "LMHeadModel": "CAUSAL_LM",
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
}


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
        normal(self, "num_virtual_tokens", _positive(self.num_virtual_tokens, "num_virtual_tokens", 20))
        if not isinstance(self.prefix_projection, bool):
            raise TypeError(f"PrefixTuning(prefix_projection={self.prefix_projection!r}): give True or False.")
        if self.encoder_hidden_size is not None:
            normal(self, "encoder_hidden_size", _positive(self.encoder_hidden_size, "encoder_hidden_size", 512))
            if not self.prefix_projection:
                raise ValueError(
                    f"PrefixTuning(encoder_hidden_size={self.encoder_hidden_size}) sizes the projection MLP, but "
                    "prefix_projection=False has none. Set prefix_projection=True, or leave encoder_hidden_size out."
                )
        names = self.modules_to_save
        if names is not None:
            if isinstance(names, str) or not isinstance(names, Iterable) or not all(isinstance(m, str) for m in names):
                raise TypeError(
                    f"PrefixTuning(modules_to_save={names!r}): give a list of module names, e.g. ['classifier']."
                )
            normal(self, "modules_to_save", sorted(names) if isinstance(names, (set, frozenset)) else list(names))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``PrefixTuningConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)


def _positive(value: object, what: str, example: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"PrefixTuning({what}={value!r}): {what} must be a positive integer, e.g. {example}.")
    if value <= 0:
        raise ValueError(f"PrefixTuning({what}={value!r}): {what} must be a positive integer.")
    return int(value)


@dataclass(frozen=True)
class _Geometry:
    """The prefix's shape for one model, as PEFT derives it (``_prepare_prompt_learning_config``)."""

    num_layers: int
    num_heads: int  # key/value heads
    head_dim: int

    @property
    def token_dim(self) -> int:  # d_kv
        return self.num_heads * self.head_dim

    @property
    def width(self) -> int:  # columns of the table
        return self.num_layers * 2 * self.token_dim


def _geometry(model: nn.Module) -> _Geometry:
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()

    def field(*names: str) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        raise ValueError(
            f"inject_prefix_tuning: the config of {type(model).__name__} has none of {list(names)}, so the prefix "
            "cannot be sized (layers, heads, hidden size). Use a Hugging Face model with a standard config."
        )

    layers = field("num_hidden_layers", "num_layers", "n_layer")
    hidden = field("hidden_size", "n_embd", "d_model")
    heads = field("num_attention_heads", "n_head", "num_heads")
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is None:
        return _Geometry(layers, heads, hidden // heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return _Geometry(layers, kv_heads, head_dim)


class PrefixEncoder(nn.Module):
    """The trained prefix: a table ``(n, L * 2 * d_kv)``, or the MLP that produces it (PEFT's layout and names).

    Args:
        num_virtual_tokens: ``n``.
        width: ``L * 2 * d_kv``, the columns of the table.
        token_dim: ``d``, the MLP input size (with ``encoder_hidden_size``).
        encoder_hidden_size: ``h``; None: no MLP, the table itself is the parameter.
    """

    def __init__(self, num_virtual_tokens: int, width: int, token_dim: int, encoder_hidden_size: int | None) -> None:
        super().__init__()
        if encoder_hidden_size is None:
            self.embedding = nn.Embedding(num_virtual_tokens, width)  # (n, L*2*d_kv), N(0, 1) as in PEFT
            self.transform = None
        else:
            self.embedding = nn.Embedding(num_virtual_tokens, token_dim)  # (n, d)
            self.transform = nn.Sequential(
                nn.Linear(token_dim, encoder_hidden_size), nn.Tanh(), nn.Linear(encoder_hidden_size, width)
            )

    def table(self) -> Tensor:
        """The prefix, ``(n, L * 2 * d_kv)``."""
        weight = self.embedding.weight
        return weight if self.transform is None else self.transform(weight)


class _PrefixHook:
    """Forward pre-hook (``with_kwargs=True``) on the module that takes the cache: puts the prefix in front."""

    def __init__(self, encoder: PrefixEncoder, geometry: _Geometry, cache_argument: str, model: nn.Module) -> None:
        self.encoder = encoder
        self.geometry = geometry
        self.cache_argument = cache_argument
        self.model = model

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = {**_by_name(module, args), **kwargs}
        if module.training and torch.is_grad_enabled():
            _refuse_gradient_checkpointing(self.model, "prefix tuning")
        given = [kwargs.pop(name, None) for name in _CACHE_ARGUMENTS]
        cache = next((c for c in given if c is not None), None)
        n = self.encoder.embedding.num_embeddings
        if cache is None or cache.get_seq_length() == 0:
            cache = self.cache(_batch_size(kwargs, type(module).__name__))
        kwargs[self.cache_argument] = cache
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.ndim != 2:
                raise ValueError(
                    f"prefix tuning: {type(module).__name__} got a {mask.ndim}-D attention_mask; the prefix needs the "
                    "2-D (batch, length) padding mask, to put its own positions in front. Pass the 2-D mask."
                )
            kwargs["attention_mask"] = torch.cat([mask.new_ones(mask.shape[0], n), mask], dim=1)  # (B, n + S)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"] + n  # the real tokens come after the prefix
        return (), kwargs

    def cache(self, batch_size: int):
        """A ``DynamicCache`` holding the prefix for ``batch_size`` rows (what PEFT's ``get_prompt`` builds)."""
        from transformers import DynamicCache

        g = self.geometry
        table = self.encoder.table().to(getattr(self.model, "dtype", None) or self.encoder.embedding.weight.dtype)
        n = table.shape[0]
        kv = table.view(n, 2 * g.num_layers, g.num_heads, g.head_dim).permute(1, 2, 0, 3)  # (2L, H, n, d_h)
        kv = kv.unsqueeze(1).expand(-1, batch_size, -1, -1, -1)  # (2L, B, H, n, d_h)
        return DynamicCache([(kv[2 * layer], kv[2 * layer + 1]) for layer in range(g.num_layers)])


def _by_name(module: nn.Module, args: tuple) -> dict[str, Any]:
    """Positional arguments of ``module.forward`` by name (a backbone may get ``input_ids`` positionally)."""
    if not args:
        return {}
    names = [p.name for p in inspect.signature(module.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(names):
        raise TypeError(f"prefix tuning: {type(module).__name__}.forward got {len(args)} positional arguments; "
                        f"it takes at most {len(names)} ({', '.join(names)}).")
    return dict(zip(names, args))


def _batch_size(kwargs: dict[str, Any], who: str) -> int:
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            return kwargs[name].shape[0]
    raise ValueError(f"prefix tuning: {who} was called without input_ids or inputs_embeds; pass one of them.")


def _refuse_gradient_checkpointing(model: nn.Module, who: str) -> None:
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise RuntimeError(
            f"{who}: gradient checkpointing is on in {type(model).__name__}; transformers then drops the attention "
            "cache in training, and with it the prefix. Call model.activation_checkpointing_disable() "
            "(gradient_checkpointing_disable() before transformers 5); Hugging Face PEFT refuses this combination too."
        )


def _cache_module(model: nn.Module) -> tuple[str, nn.Module, str]:
    """``(name, module, argument)``: the model, else its backbone, whose forward takes the attention cache."""
    candidates = [("", model)]
    backbone = getattr(model, "base_model", None)
    if isinstance(backbone, nn.Module) and backbone is not model:
        names = {id(m): n for n, m in model.named_modules()}
        if id(backbone) in names:
            candidates.append((names[id(backbone)], backbone))
    for name, module in candidates:
        parameters = inspect.signature(module.forward).parameters
        for argument in _CACHE_ARGUMENTS:
            if argument in parameters:
                return name, module, argument
    backbone_text = (f" nor that of its backbone {candidates[1][0]!r} ({type(candidates[1][1]).__name__})"
                     if len(candidates) > 1 else "")
    raise TypeError(
        f"inject_prefix_tuning: the forward of {type(model).__name__}{backbone_text} takes no attention cache "
        f"(an argument {' or '.join(_CACHE_ARGUMENTS)}); prefix tuning passes its prefix as that cache. Use a Hugging "
        "Face model that takes one (GPT-2, Llama, BERT, ...), or prompt tuning, which needs only input embeddings."
    )


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
    _refuse_gradient_checkpointing(model, "inject_prefix_tuning")


def _select_modules_to_save(model: nn.Module, names: list[str] | None) -> list[str]:
    if names is None:
        # A head another adapter (LoRA's modules_to_save) already trains and saves stays with that adapter.
        heads = [h for h in task_heads(model) if not saved_elsewhere(model, h)]
        if heads:
            log.info("PrefixTuning: %s's task head %s is trained and saved in full (modules_to_save); pass "
                     "modules_to_save=[] to keep it frozen.", type(model).__name__, heads)
        return heads
    return select_named(model, names, "PrefixTuning")


def _task_type(model: nn.Module) -> str | None:
    name = type(model).__name__
    for suffix, task in _TASK_TYPES.items():
        if name.endswith(suffix):
            return task
    return "FEATURE_EXTRACTION" if getattr(model, "base_model", None) is model else None


@register
class PrefixTuningAdapter(Adapter):
    """Prefix tuning's side of the adapter protocol: what :func:`inject_prefix_tuning` did to a model.

    PEFT's file keys for prompt-learning methods carry no ``base_model.model.`` prefix: the prefix is
    ``prompt_embeddings`` and a ``modules_to_save`` tensor is ``base_model.<module path>.<tensor>``, so
    :meth:`peft_state` gives the file's keys verbatim (``peft_key_prefix = ""``).

    Args:
        config: The config used (``prefix_projection`` as asked; :attr:`projected` says whether the MLP is still there).
        modules_to_save: Full names of the modules trained and saved in full.
        handle: The forward pre-hook's handle.
    """

    kind: ClassVar[str] = "prefix_tuning"
    peft_type: ClassVar[str] = "PREFIX_TUNING"
    peft_fields: ClassVar[frozenset[str]] = frozenset((  # peft 0.21.2's PrefixTuningConfig
        "auto_mapping", "base_model_name_or_path", "encoder_hidden_size", "inference_mode", "init_weights",
        "modules_to_save", "num_attention_heads", "num_layers", "num_transformer_submodules", "num_virtual_tokens",
        "peft_type", "peft_version", "prefix_projection", "revision", "task_type", "token_dim",
    ))
    mergeable: ClassVar[bool] = False
    peft_key_prefix: ClassVar[str] = ""

    def __init__(self, config: PrefixTuningConfig, modules_to_save: Iterable[str], handle: Any) -> None:
        self.config = config
        self.modules_to_save = tuple(modules_to_save)
        self.handle = handle

    def __repr__(self) -> str:
        return f"PrefixTuningAdapter({self.config}, modules_to_save={list(self.modules_to_save)})"

    @staticmethod
    def encoder(model: nn.Module) -> PrefixEncoder:
        return getattr(unwrap(model), PREFIX_ATTRIBUTE)

    def projected(self, model: nn.Module) -> bool:
        """Whether the prefix is still produced by the MLP (not yet folded)."""
        return self.encoder(model).transform is not None

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state = dict(self.encoder(model).state_dict(prefix=f"{PREFIX_ATTRIBUTE}.", keep_vars=True))
        for name in self.modules_to_save:
            trained = model.get_submodule(name).trained_module
            state.update(trained.state_dict(prefix=f"{name}.trained_module.", keep_vars=True))
        return state

    def config_dict(self) -> dict[str, Any]:
        # The current layout (a folded adapter records prefix_projection=False), so inject rebuilds these tensors.
        return {"config": self.config.to_dict(), "modules_to_save": list(self.modules_to_save)}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> PrefixTuningAdapter:
        model = unwrap(model)
        names = {n for n, _ in model.named_modules()}
        absent = [n for n in config["modules_to_save"] if n not in names]
        if absent:
            raise ValueError(
                f"PrefixTuning: the recorded adapter names module {absent[0]!r}, which {type(model).__name__} does "
                "not have; the checkpoint was written for another model."
            )
        ours = PrefixTuningConfig(**{**config["config"], "modules_to_save": list(config["modules_to_save"])})
        inject_prefix_tuning(model, **ours.to_dict())
        return attached(model)[cls.kind]

    def unload(self, model: nn.Module, merge: bool) -> None:
        if merge:
            raise RuntimeError(
                "PrefixTuning: a prefix cannot be merged into the base weights (it is extra attention keys and values, "
                "not a weight update). Unload with merge=False, or keep the adapter and save it with save_adapter."
            )
        model = unwrap(model)
        self.handle.remove()
        delattr(model, PREFIX_ATTRIBUTE)
        for name in self.modules_to_save:
            set_submodule(model, name, model.get_submodule(name).original_module)
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """``prompt_embeddings`` (the table, folded if the MLP is still there) and the ``modules_to_save`` tensors."""
        state = {"prompt_embeddings": self.encoder(model).table()}
        for key, value in self.state(model).items():
            if not key.startswith(f"{PREFIX_ATTRIBUTE}."):
                state[f"base_model.{clean_key(plain_key(key))}"] = value
        return state

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        model = unwrap(model)
        g = _geometry(model)
        transform = self.encoder(model).transform
        return {
            "peft_type": self.peft_type,
            "task_type": _task_type(model),
            "base_model_name_or_path": base_model_name(model),
            "revision": None,
            "inference_mode": True,
            "num_virtual_tokens": self.config.num_virtual_tokens,
            "token_dim": g.token_dim,
            "num_transformer_submodules": 1,
            "num_attention_heads": g.num_heads,
            "num_layers": g.num_layers,
            "encoder_hidden_size": g.token_dim if transform is None else transform[0].out_features,
            "prefix_projection": transform is not None,
            "init_weights": None,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
        }

    def peft_problems(self, model: nn.Module) -> list[str]:
        if _task_type(unwrap(model)) is None:
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
        names = [m for m, _ in unwrap(model).named_modules() if m]
        # PEFT's SEQ_CLS task writes ["classifier", "score"] whatever the model calls its head: drop the absent.
        asked = dict.fromkeys(config.get("modules_to_save") or [])
        present = [m for m in asked if any(name_matches(x, [m]) for x in names)]
        # The file holds the table (PEFT folds a projection when it saves), so the adapter is a plain table.
        inject_prefix_tuning(model, num_virtual_tokens=n, modules_to_save=present)
        return attached(model)[cls.kind]


def _peft_geometry(model: nn.Module, config: dict[str, Any], source: str) -> int:
    """``num_virtual_tokens`` of a PEFT ``PrefixTuningConfig`` dict; raises if its shape is not ``model``'s."""
    if config.get("peft_type") != PrefixTuningAdapter.peft_type:
        raise ValueError(f"load_adapter: {source} has peft_type={config.get('peft_type')!r}, not 'PREFIX_TUNING'.")
    if config.get("num_transformer_submodules", 1) not in (1, None):
        raise ValueError(
            f"load_adapter: {source} has num_transformer_submodules={config['num_transformer_submodules']} (an "
            "encoder-decoder prefix); lightning-peft's prefix tuning covers decoder and encoder models only."
        )
    g = _geometry(unwrap(model))
    ours = {"num_layers": g.num_layers, "token_dim": g.token_dim, "num_attention_heads": g.num_heads}
    for key, value in ours.items():
        if config.get(key) is not None and config[key] != value:
            raise ValueError(
                f"load_adapter: {source} has {key}={config[key]}, but {type(unwrap(model)).__name__} needs {value} "
                "(its key/value shape); the prefix was trained for another model."
            )
    n = config.get("num_virtual_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"load_adapter: {source} has num_virtual_tokens={n!r}; it is not a complete prefix config.")
    return n


def prefix_tuning_spec(model: nn.Module) -> PrefixTuningAdapter | None:
    """The :class:`PrefixTuningAdapter` :func:`inject_prefix_tuning` left on ``model``, or None."""
    return attached(model).get(PrefixTuningAdapter.kind)


def _require(model: nn.Module, who: str) -> PrefixTuningAdapter:
    spec = prefix_tuning_spec(model)
    if spec is None:
        raise RuntimeError(
            f"{who}: {type(unwrap(model)).__name__} has no prefix-tuning adapter; call "
            "inject_prefix_tuning(model, ...) first."
        )
    return spec


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
        prefix_projection: Produce the prefix with an MLP (fold it with :func:`fold_prefix_projection` afterwards).
        encoder_hidden_size: Hidden size of that MLP; None: the key/value width.
        modules_to_save: Modules trained and saved in full. None: a Hugging Face task model's head; ``[]``: none.

    Returns:
        The new :class:`PrefixEncoder` (``model.lightning_peft_prefix``).

    Raises:
        RuntimeError: If ``model`` already has a prefix, or gradient checkpointing is on.
        TypeError: If ``model`` takes no attention cache, is an encoder-decoder model, or an argument has a wrong type.
        ValueError: If an argument is out of range or ``modules_to_save`` matches nothing.
    """
    config = PrefixTuningConfig(num_virtual_tokens, prefix_projection, encoder_hidden_size, modules_to_save)
    model = unwrap(model)
    if prefix_tuning_spec(model) is not None or hasattr(model, PREFIX_ATTRIBUTE):
        raise RuntimeError(
            f"inject_prefix_tuning: {type(model).__name__} already has a prefix ({PREFIX_ATTRIBUTE}); prefix tuning "
            "was injected twice. Use the model as it is, or build a fresh one."
        )
    name, module, argument = _cache_module(model)
    _check_model(model)
    geometry = _geometry(model)
    to_save = _select_modules_to_save(model, config.modules_to_save)
    hidden = (config.encoder_hidden_size or geometry.token_dim) if config.prefix_projection else None
    reference = next(iter(model.parameters()), None)
    encoder = PrefixEncoder(config.num_virtual_tokens, geometry.width, geometry.token_dim, hidden)
    if reference is not None:
        encoder.to(device=reference.device, dtype=reference.dtype)
    wrap_modules_to_save(model, to_save)
    model.add_module(PREFIX_ATTRIBUTE, encoder)
    handle = module.register_forward_pre_hook(_PrefixHook(encoder, geometry, argument, model), with_kwargs=True)
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
