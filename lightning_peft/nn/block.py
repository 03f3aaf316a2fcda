"""`TransformerBlock`: one transformer layer, `FlashAttention` and a feed-forward, each a residual sublayer.

Paper: Vaswani et al. 2017, "Attention Is All You Need"; the pre-norm variant as in GPT-2 and Llama.

Rule. One block, two sublayers, each a residual branch:

    post-norm (BERT):  x = norm_1(x + drop(attn(x)));       x = norm_2(x + drop(mlp(x)))
    pre-norm (Llama):  x = x + drop(attn(norm_1(x)));        x = x + drop(mlp(norm_2(x)))
    sandwich (Gemma 2): x = x + drop(post_1(attn(norm_1(x))));  x = x + drop(post_2(mlp(norm_2(x))))

Shapes: block input and output ``(B, L, H)``; ``key_padding_mask`` ``(B, L)``, True for real tokens.

Hooks for what stacks on the block: ``feed_forward=`` replaces the dense ``mlp`` by any module mapping
``(B, L, H) -> (B, L, H)`` (a mixture of experts); `TransformerBlock.attention_branch` and
`TransformerBlock.feed_forward_branch` are the two residual functions ``F`` and ``G`` of a pre-norm block without
their residual, which reversible coupling needs; `TransformerBlock.attention_sublayer` returns the attention each
token received when asked, which token pruning needs (`lightning_peft.nn.TokenPruner`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_peft._checks import choice, integer, probability
from lightning_peft.nn.attention import FlashAttention
from lightning_peft.nn.feed_forward import NORMS, FeedForward, norm_layer
from lightning_peft.nn.kv_cache import LayerKVCache

__all__ = ["TransformerBlock"]


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
        qkv_bias: Biases on q/k/v only (Qwen2); ``None`` = ``bias`` (see `FlashAttention`).
        rope_scaling: Rotary frequency scaling (``linear``, ``llama3``; see `lightning_peft.nn.RotaryEmbedding`).
        sliding_window: Causal attention over the last ``sliding_window`` positions only (Mistral).
        norm_offset: RMSNorm computes ``(norm_offset + weight) * x_normalised`` (Gemma: 1.0).
        qk_norm: RMSNorms over each head's queries and keys (Qwen3, Gemma 3; see `FlashAttention`).
        attention_scale: The attention score scale; ``None`` = ``1 / sqrt(head_dim)``.
        softcap: Soft-capping of the attention scores (Gemma 2; see `FlashAttention`).
        sandwich_norm: A norm on each branch's output too, before the residual sum (``attn_post_norm``,
            ``mlp_post_norm``; Gemma 2 and 3; Ding et al. 2021, "CogView", arXiv:2105.13290: Sandwich-LN); pre-norm
            only.

    Examples:
        >>> import torch
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
        qkv_bias: bool | None = None,
        rope_scaling: dict | None = None,
        sliding_window: int | None = None,
        norm_offset: float = 0.0,
        qk_norm: bool = False,
        attention_scale: float | None = None,
        softcap: float | None = None,
        sandwich_norm: bool = False,
    ) -> None:
        super().__init__()
        integer("TransformerBlock", "hidden_size", hidden_size, minimum=1)
        integer("TransformerBlock", "ffn_size", ffn_size, minimum=1)
        choice("TransformerBlock", "norm", norm, NORMS)
        probability("TransformerBlock", "dropout", dropout)
        probability("TransformerBlock", "attention_dropout", attention_dropout)
        self.attn = FlashAttention(
            hidden_size, num_heads, num_kv_heads=num_kv_heads, causal=causal, dropout=attention_dropout,
            rotary=rotary, bias=bias, rope_theta=rope_theta, head_dim=head_dim, backend=backend, qkv_bias=qkv_bias,
            rope_scaling=rope_scaling, sliding_window=sliding_window, qk_norm=qk_norm, norm_eps=norm_eps,
            norm_offset=norm_offset, scale=attention_scale, softcap=softcap,
        )
        self.mlp = feed_forward if feed_forward is not None else FeedForward(
            hidden_size, ffn_size, activation=activation, gated=gated, bias=bias
        )
        self.attn_norm = norm_layer(norm, hidden_size, norm_eps, norm_offset)
        self.mlp_norm = norm_layer(norm, hidden_size, norm_eps, norm_offset)
        if sandwich_norm and not norm_first:
            raise ValueError("TransformerBlock(sandwich_norm=True, norm_first=False): the sandwich norms sit inside "
                             "pre-norm residual branches; set norm_first=True or sandwich_norm=False.")
        self.attn_post_norm = norm_layer(norm, hidden_size, norm_eps, norm_offset) if sandwich_norm else None
        self.mlp_post_norm = norm_layer(norm, hidden_size, norm_eps, norm_offset) if sandwich_norm else None
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def attention_branch(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``(F(x), importance)``: the attention branch without its residual (pre-norm: ``attn(norm_1(x))``).

        The arguments after ``x`` are `FlashAttention.forward`'s (``key_padding_mask``, ``position_ids``,
        ``cu_seqlens``, ``need_importance``, ``kv_cache``, ``rotary_tables``), passed on as given; ``importance``
        is None unless asked.
        """
        out = self.attn(self.attn_norm(x) if self.norm_first else x, *args, **kwargs)
        out, importance = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        return (out if self.attn_post_norm is None else self.attn_post_norm(out)), importance

    def feed_forward_branch(self, x: Tensor) -> Tensor:
        """``G(x)``: the feed-forward branch without its residual (pre-norm: ``mlp(norm_2(x))``)."""
        out = self.mlp(self.mlp_norm(x) if self.norm_first else x)
        return out if self.mlp_post_norm is None else self.mlp_post_norm(out)

    def attention_sublayer(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``(x', importance)``: the first residual sublayer; ``importance`` (B, L) when asked, else None (the
        arguments are `attention_branch`'s)."""
        delta, importance = self.attention_branch(x, *args, **kwargs)
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
        kv_cache: LayerKVCache | None = None,
        rotary_tables: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Both residual sublayers; ``between(x, importance) -> x`` runs between them (token pruning selects the
        tokens there), so the whole block is one call of the module: the hooks that gather its parameters (FSDP2)
        or move its inputs (a device map) see all of it. ``kv_cache`` (incremental decoding) and ``rotary_tables``
        (the rotary ``cos``, ``sin`` a decoder computed once for all its layers) go to `FlashAttention.forward`."""
        x, importance = self.attention_sublayer(x, key_padding_mask, position_ids, cu_seqlens, need_importance,
                                                kv_cache=kv_cache, rotary_tables=rotary_tables)
        if between is not None:
            x = between(x, importance)
        return self.feed_forward_sublayer(x)
