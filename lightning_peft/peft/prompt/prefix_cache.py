"""The parts of prefix tuning that act on the model: the prefix's shape, the module that holds it, and the forward
pre-hook that passes it as the attention cache (see `lightning_peft.peft.prompt.prefix_tuning` for the technique).

Shapes: ``L`` layers, ``H`` key/value heads, ``d_h`` head size, ``d_kv = H d_h``, ``n`` prefix positions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...nn.checkpointing import checkpointed_modules
from .._hf_call import CACHE_ARGUMENTS, bind, cached_length, extend_mask, given_cache, shift_positions, the_input

#: Name of the module that holds the prefix on the adapted model.
PREFIX_ATTRIBUTE = "lightning_peft_prefix"
_WHO = "prefix tuning"
_CHECKPOINTING_REASON = (
    "prefix tuning passes its prefix as the attention cache, which every layer writes into in place; a recomputed "
    "layer would write it a second time (and transformers' own checkpointing drops the cache in training). Train "
    "prefix tuning without activation checkpointing (remove the ActivationCheckpointing callback), or use LoRA or "
    "prompt tuning with it."
)


@dataclass(frozen=True)
class Geometry:
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


def geometry(model: nn.Module) -> Geometry:
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
        return Geometry(layers, heads, hidden // heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return Geometry(layers, kv_heads, head_dim)


class PrefixEncoder(nn.Module):
    """The trained prefix: a table ``(n, L * 2 * d_kv)``, or the MLP that produces it (PEFT's layout and names).

    Args:
        num_virtual_tokens: ``n``.
        width: ``L * 2 * d_kv``, the columns of the table.
        token_dim: ``d``, the MLP input size (with ``encoder_hidden_size``).
        encoder_hidden_size: ``h``; None: no MLP, the table itself is the parameter.
    """

    #: Read by `lightning_peft.nn.apply_activation_checkpointing`, which refuses a model holding this module.
    refuses_activation_checkpointing = _CHECKPOINTING_REASON

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


class PrefixHook:
    """Forward pre-hook (``with_kwargs=True``) on the module that takes the cache: puts the prefix in front."""

    def __init__(self, encoder: PrefixEncoder, geometry: Geometry, cache_argument: str, model: nn.Module) -> None:
        self.encoder = encoder
        self.geometry = geometry
        self.cache_argument = cache_argument
        self.model = model

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = bind(module, args, kwargs, _WHO)
        if module.training and torch.is_grad_enabled():
            refuse_gradient_checkpointing(self.model, _WHO)
        cache = given_cache(kwargs)
        for name in CACHE_ARGUMENTS:
            kwargs.pop(name, None)
        n = self.encoder.embedding.num_embeddings
        if cached_length(cache) == 0:
            cache = self.cache(the_input(kwargs, module, _WHO).shape[0])
        kwargs[self.cache_argument] = cache
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = extend_mask(kwargs["attention_mask"], n, module, _WHO)  # (B, n + S)
        if kwargs.get("position_ids") is not None:  # the real tokens come after the prefix
            kwargs["position_ids"] = shift_positions(kwargs["position_ids"], n, head=False)
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


def refuse_gradient_checkpointing(model: nn.Module, who: str) -> None:
    """Refuse transformers' gradient checkpointing and lightning-peft's activation checkpointing, with the reason."""
    ours = checkpointed_modules(model)
    if ours:
        raise RuntimeError(
            f"{who}: activation checkpointing is on in {type(model).__name__} ({', '.join(ours) or 'the model'}, "
            f"lightning_peft.nn.apply_activation_checkpointing or the ActivationCheckpointing callback); "
            f"{_CHECKPOINTING_REASON}"
        )
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise RuntimeError(
            f"{who}: gradient checkpointing is on in {type(model).__name__}; transformers then drops the attention "
            "cache in training, and with it the prefix. Call model.activation_checkpointing_disable() "
            "(gradient_checkpointing_disable() before transformers 5); Hugging Face PEFT refuses this combination too."
        )


def cache_module(model: nn.Module) -> tuple[str, nn.Module, str]:
    """``(name, module, argument)``: the model, else its backbone, whose forward takes the attention cache."""
    candidates = [("", model)]
    backbone = getattr(model, "base_model", None)
    if isinstance(backbone, nn.Module) and backbone is not model:
        names = {id(m): n for n, m in model.named_modules()}
        if id(backbone) in names:
            candidates.append((names[id(backbone)], backbone))
    for name, module in candidates:
        parameters = inspect.signature(module.forward).parameters
        for argument in CACHE_ARGUMENTS:
            if argument in parameters:
                return name, module, argument
    backbone_text = (f" nor that of its backbone {candidates[1][0]!r} ({type(candidates[1][1]).__name__})"
                     if len(candidates) > 1 else "")
    raise TypeError(
        f"inject_prefix_tuning: the forward of {type(model).__name__}{backbone_text} takes no attention cache "
        f"(an argument {' or '.join(CACHE_ARGUMENTS)}); prefix tuning passes its prefix as that cache. Use a Hugging "
        "Face model that takes one (GPT-2, Llama, BERT, ...), or prompt tuning, which needs only input embeddings."
    )
