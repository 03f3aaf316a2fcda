"""What prompt and prefix tuning share when they rewrite a call of a Hugging Face model in a forward pre-hook.

Both put ``n`` positions in front of the real tokens (prompt tuning: virtual tokens in the input; prefix tuning:
keys and values in the attention cache), so both bind the call's arguments by name, need the batch's input, extend
the 2-D padding mask with ``n`` ones in front, move explicit positions ``n`` on, and read how much the attention
cache already holds. Shapes: ``B`` batch, ``T`` real tokens, ``n`` positions put in front.

>>> import torch
>>> extend_mask(torch.tensor([[1, 0]]), 2, torch.nn.Identity(), "PromptTuning")
tensor([[1, 1, 1, 0]])
>>> shift_positions(torch.tensor([[0, 1]]), 2, head=True)
tensor([[0, 1, 2, 3]])
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

#: The attention cache's argument: transformers 5's name first, then the older one.
CACHE_ARGUMENTS = ("cache", "past_key_values")


def bind(module: nn.Module, args: tuple, kwargs: dict[str, Any], who: str) -> dict[str, Any]:
    """The call's arguments by name: positional ones bound to ``module.forward``'s parameters."""
    inputs = dict(kwargs)
    if not args:
        return inputs
    names = [p.name for p in inspect.signature(module.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(names):
        raise TypeError(
            f"{who}: {type(module).__name__}.forward takes {len(names)} positional arguments "
            f"({', '.join(names)}), but {len(args)} were given. Pass the extra ones by name."
        )
    for name, value in zip(names, args):
        if name in inputs:
            raise TypeError(f"{who}: {type(module).__name__}.forward got two values for {name!r}.")
        inputs[name] = value
    return inputs


def the_input(inputs: dict[str, Any], module: nn.Module, who: str) -> Tensor:
    """The call's ``input_ids`` (B, T) or ``inputs_embeds`` (B, T, d): exactly one of them must be given."""
    input_ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    if (input_ids is None) == (embeds is None):
        given = "both input_ids and inputs_embeds" if input_ids is not None else "neither input_ids nor inputs_embeds"
        raise ValueError(
            f"{who}: {type(module).__name__} was called with {given}; give exactly one of them (the positions in "
            "front are sized by the batch of the input)."
        )
    return input_ids if input_ids is not None else embeds


def given_cache(inputs: dict[str, Any]) -> Any:
    """The attention cache the call passes (under either name), or None."""
    return next((inputs[name] for name in CACHE_ARGUMENTS if inputs.get(name) is not None), None)


def cached_length(cache: Any) -> int:
    """Tokens already in an attention cache; 0 without one."""
    if cache is None:
        return 0
    if callable(getattr(cache, "get_seq_length", None)):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:  # legacy ((k, v), ...): k (B, h, L, hd)
        return int(cache[0][0].shape[-2])
    return 0


def prefixed(values: Tensor, first: Tensor, n: int) -> Tensor:
    """``values`` (B, T) with ``first`` (B, 1) repeated ``n`` times in front: (B, n+T)."""
    return torch.cat((first.expand(-1, n), values), dim=1)


def extend_mask(mask: Tensor, n: int, module: nn.Module, who: str) -> Tensor:
    """The 2-D padding mask (B, S) with ``n`` ones in front: (B, n+S)."""
    if mask.dim() != 2:
        raise ValueError(
            f"{who}: {type(module).__name__} got a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)}; the "
            f"{n} positions in front extend the 2-D (batch, length) padding mask. Pass the 2-D mask and let the model "
            "build its own 4-D mask."
        )
    return prefixed(mask, torch.ones_like(mask[:, :1]), n)


def shift_positions(positions: Tensor, n: int, head: bool) -> Tensor:
    """Positions of the real tokens (..., T) moved ``n`` on; with ``head``, ``0 ... n-1`` in front (..., n+T) for
    positions that are part of the sequence (prompt tuning's virtual tokens)."""
    shifted = positions + n  # (..., T)
    if not head:
        return shifted
    front = torch.arange(n, dtype=positions.dtype, device=positions.device)  # (n,)
    return torch.cat((front.expand(*positions.shape[:-1], n), shifted), dim=-1)  # (..., n+T)
