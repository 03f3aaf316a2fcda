"""What `TransformerEncoder` and `TransformerDecoder` share: initialisation, per-layer feed-forwards (dense or
`MoE`), the reversible run of their layers, and the attention-mask check.

Reversible (Gomez et al. 2017, "The Reversible Residual Network", arXiv:1707.04585; Kitaev et al. 2020,
"Reformer", arXiv:2001.04451): the pre-norm blocks run as couplings on ``cat([x, x])`` ``(B, L, 2H)``,

    y1 = x1 + F(x2),  y2 = x2 + G(y1)      F = drop(attn(norm_1(.))), G = drop(mlp(norm_2(.)))

and the two halves of the output are averaged back to ``(B, L, H)``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft.nn.attention_functional import _check_cu_seqlens
from lightning_peft.nn.block import TransformerBlock
from lightning_peft.nn.moe import MoE
from lightning_peft.nn.reversible import ReversibleSequence

__all__ = ["check_packed", "check_reversible", "feed_forwards", "init_weights", "key_padding_mask", "run_reversible"]


def init_weights(module: nn.Module, std: float) -> None:
    """BERT / Llama initialisation: normal(0, std) weights, zero biases, unit norms; padding rows stay zero."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, std=std)
        if isinstance(sub, nn.Linear) and sub.bias is not None:
            nn.init.zeros_(sub.bias)
        if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
            with torch.no_grad():
                sub.weight[sub.padding_idx].zero_()


def feed_forwards(
    moe: dict[str, Any] | None, num_layers: int, hidden_size: int, ffn_size: int, defaults: dict[str, Any], who: str
) -> list[nn.Module | None]:
    """One feed-forward per layer: a `MoE` built from ``moe`` (its experts ``ffn_size`` wide, ``defaults`` for the
    expert activation, gating and bias unless ``moe`` sets them), or None for the block's dense feed-forward."""
    if moe is None:
        return [None] * num_layers
    if not isinstance(moe, dict):
        raise TypeError(f"{who}(moe={moe!r}): give the MoE options as a dict, e.g. {{'num_experts': 8, 'top_k': 2}}.")
    layers = []
    for index in range(num_layers):
        layer = MoE(hidden_size, ffn_size, **{**defaults, **moe})
        layer.name = f"layers.{index}.mlp"
        layers.append(layer)
    return layers


class _Branch(nn.Module):
    """A block's residual branch as a module for `ReversibleSequence` (built per forward, never stored: the
    encoder or decoder owns the block; the branch registers it so the sequence finds its parameters)."""

    def __init__(self, block: TransformerBlock, which: str) -> None:
        super().__init__()
        self.block = block
        self.which = which

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:  # the branch with the block's residual dropout
        if self.which == "attention":
            return self.block.dropout(self.block.attention_branch(x, **kwargs)[0])
        return self.block.dropout(self.block.feed_forward_branch(x))


def run_reversible(layers: nn.ModuleList, x: Tensor, **kwargs: Any) -> Tensor:
    """The pre-norm ``layers`` as reversible couplings on ``cat([x, x])`` (Reformer); the mean of the two halves out."""
    stack = ReversibleSequence([_Branch(layer, "attention") for layer in layers],
                               [_Branch(layer, "feed_forward") for layer in layers])
    y = stack(torch.cat([x, x], dim=-1), **kwargs)  # (B, L, 2H)
    first, second = y.chunk(2, dim=-1)
    return (first + second) / 2


def check_reversible(who: str, reversible: bool, norm_first: bool, moe: dict[str, Any] | None) -> None:
    """Refuses reversible=True with MoE feed-forwards or post-norm blocks (naming ``who``)."""
    if reversible and moe is not None:
        raise ValueError(
            f"{who}(reversible=True, moe=...): a reversible stack runs its forward without building a graph, so the "
            "experts' load-balancing and z-losses could not train the router (and the recomputation in backward "
            "would overwrite them). Use moe with reversible=False, or a dense feed-forward with reversible=True."
        )
    if reversible and not norm_first:
        raise ValueError(
            f"{who}(reversible=True, norm_first=False): reversible coupling needs pre-norm blocks, whose residual "
            "branches F and G carry no normalisation after the sum; post-norm blocks (BERT's) cannot be inverted. "
            "Set norm_first=True (a model trained from scratch) or reversible=False."
        )


def key_padding_mask(attention_mask: Tensor | None, input_ids: Tensor, who: str, past: int = 0) -> Tensor | None:
    """A bool (B, past + L) mask (True = real) from a 0/1 or bool mask; None when every token is real. ``past``:
    tokens held in a key/value cache before ``input_ids``, which the mask covers too."""
    if attention_mask is None:
        return None
    expected = (input_ids.shape[0], past + input_ids.shape[1])
    if tuple(attention_mask.shape) != expected:
        cached = f" after {past} cached tokens (the mask covers both)" if past else ""
        raise ValueError(
            f"{who}: attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}"
            f"{cached}; give one 0/1 (or bool) entry per token, 1 for real tokens: shape {expected}."
        )
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"{who}: attention_mask has dtype {attention_mask.dtype}; give a bool or integer 0/1 mask (1 = real "
            "token), not an additive float mask."
        )
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask



def check_packed(cu_seqlens: Tensor, attention_mask: Tensor | None, input_ids: Tensor, who: str) -> int:
    """Refuses ``cu_seqlens`` with an attention mask or a batch of more than one row; checks its boundaries and
    returns the longest sequence's length."""
    if attention_mask is not None or input_ids.shape[0] != 1:
        given = f"an attention_mask of shape {tuple(attention_mask.shape)}" if attention_mask is not None else (
            f"input_ids of shape {tuple(input_ids.shape)}")
        raise ValueError(
            f"{who}: cu_seqlens packs sequences into one row without padding (input_ids (1, T), no attention_mask); "
            f"got {given}. Give a packed batch (SFTDataModule(packing=True)) without attention_mask, or a padded "
            "batch without cu_seqlens."
        )
    bounds = _check_cu_seqlens(cu_seqlens, input_ids.shape[1], who)
    return max(b - a for a, b in itertools.pairwise(bounds))
