"""Exact attention with a flash-attention kernel: the ``flash-attn`` package on CUDA, PyTorch's fused SDPA elsewhere.

Papers: Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", arXiv:2205.14135,
and "FlashAttention-2", arXiv:2307.08691 (the kernels); Ainslie et al., "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints", arXiv:2305.13245 (grouped key/value heads); Su et al., "RoFormer:
Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864 (rotary positions); Kim et al., "Learned Token
Pruning for Transformers", arXiv:2107.00910 (the attention a token receives, for pruning).

The rule. For query ``i`` and key ``j`` of one batch element and head ``h`` (key head ``h // (H / Hkv)``):

```text
out[i] = sum_j softmax_j(scale * q[i] . k[j] + bias[i, j]) v[j],   scale = 1 / sqrt(D) unless given
bias[i, j] = -inf where key j is padding (key_padding_mask False), or where causal and j > i + Lk - Lq
```

so a causal mask with ``Lq != Lk`` is aligned bottom-right, as flash-attn aligns it (the last query sees every key).
A row whose keys are all masked gives zeros, not NaN. The flash kernels compute this in tiles with an online
softmax, never storing the (Lq, Lk) score matrix: memory linear in the sequence length.

Backends ([`select_backend`][lightning_peft.nn.select_backend]): ``"flash_attn"`` (the ``flash-attn`` package:
importable, CUDA tensors, fp16 or bf16, head_dim <= 256), ``"sdpa"``
(`torch.nn.functional.scaled_dot_product_attention`, whose CPU dispatcher picks a fused flash-style kernel for every
case here except attention dropout), ``"math"`` (explicit scores, quadratic in memory: what soft-capping needs off
flash-attn), and ``"auto"``: flash_attn where it can run, else sdpa (math with soft-capping).

Shapes:

| tensor | shape | meaning |
| --- | --- | --- |
| ``q`` | (B, H, Lq, D) | queries, H heads of size D |
| ``k``, ``v`` | (B, Hkv, Lk, D) | keys and values; Hkv divides H (GQA; Hkv = 1 is MQA) |
| ``key_padding_mask`` | (B, Lk) bool | True for a real key, False for padding |
| ``cu_seqlens`` | (N + 1,) int32 | packed sequences of a (1, L) batch: 0, l0, l0 + l1, ..., L |
| ``position_ids`` | (B, L) long | rotary positions |
| ``cos``, ``sin`` | (B, 1, L, D) | rotary tables ([`RotaryEmbedding`][lightning_peft.nn.RotaryEmbedding]) |
| `attention` out | (B, H, Lq, D) | |
| [`attention_received`][lightning_peft.nn.attention_received] | (B, Lk) float32 | attention each key receives, mean over heads and queries |
| [`FlashAttention`][lightning_peft.nn.FlashAttention] | (B, L, hidden) -> same | |

Where each piece lives (every name stays importable from here): `lightning_peft.nn.attention_backends`
([`select_backend`][lightning_peft.nn.select_backend], [`flash_attn_available`][lightning_peft.nn.flash_attn_available],
the kernels' calls), `lightning_peft.nn.attention_functional` (`attention`,
[`packed_attention`][lightning_peft.nn.packed_attention], [`attention_received`][lightning_peft.nn.attention_received]),
`lightning_peft.nn.rotary` ([`RotaryEmbedding`][lightning_peft.nn.RotaryEmbedding],
[`apply_rotary`][lightning_peft.nn.apply_rotary]); [`FlashAttention`][lightning_peft.nn.FlashAttention], the module, is
here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_peft._checks import choice, integer, probability
from lightning_peft.nn.attention_backends import (
    BACKENDS,
    FLASH_DTYPES,
    FLASH_MAX_HEAD_DIM,
    flash_attn_available,
    select_backend,
)
from lightning_peft.nn.attention_functional import (
    _as_bool_mask,
    _check_cu_seqlens,
    attention,
    attention_received,
    packed_attention,
)
from lightning_peft.nn.feed_forward import RMSNorm
from lightning_peft.nn.kv_cache import LayerKVCache
from lightning_peft.nn.rotary import RotaryEmbedding, apply_rotary

__all__ = ["BACKENDS", "FLASH_DTYPES", "FLASH_MAX_HEAD_DIM", "FlashAttention", "RotaryEmbedding", "apply_rotary",
           "attention", "attention_received", "flash_attn_available", "packed_attention", "select_backend"]


class FlashAttention(nn.Module):
    """Multi-head self-attention with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, on `attention`.

    The projection names match Llama's (and LoRA ``target_modules``, layer-wise LR decay and tensor-parallel plans
    that name them). Grouped-query attention with ``num_kv_heads``; rotary positions with ``rotary=True``; packed
    sequences with ``cu_seqlens``; the attention each token receives with ``need_importance`` (token pruning).

    Args:
        hidden_size: Model width.
        num_heads: Query heads H.
        num_kv_heads: Key/value heads (dividing H); None for H.
        causal: Decoder (causal) attention.
        dropout: Attention-probability dropout, applied in training mode only.
        rotary: Apply [`RotaryEmbedding`][lightning_peft.nn.RotaryEmbedding] to queries and keys.
        bias: Bias on the four projections.
        rope_theta: The rotary base.
        head_dim: Size of a head; None for ``hidden_size // num_heads``.
        backend: ``"auto"``, ``"flash_attn"``, ``"sdpa"`` or ``"math"``; `last_backend` records what ran.
        qkv_bias: Bias on ``q_proj``, ``k_proj``, ``v_proj`` (Qwen2: True with ``bias=False``, which then covers
            ``o_proj`` only); None for ``bias``.
        rope_scaling: Rotary frequency scaling (`RotaryEmbedding`'s ``scaling``: ``linear``, ``llama3``).
        sliding_window: Each query sees only the ``sliding_window`` keys ending at its own position (Mistral;
            causal only); None for all earlier keys.
        qk_norm: An RMSNorm over each head's queries and keys before rotary, ``q_norm`` and ``k_norm`` of size
            ``head_dim`` (Qwen3, Gemma 3; Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion
            Parameters", arXiv:2302.05442), with ``norm_eps`` and ``norm_offset`` (`RMSNorm`'s ``eps``, ``offset``).
        norm_eps: Epsilon of ``q_norm`` and ``k_norm``.
        norm_offset: Weight offset of ``q_norm`` and ``k_norm`` (Gemma 3: 1.0).
        scale: The score scale; None for ``1 / sqrt(head_dim)`` (Gemma 2: ``query_pre_attn_scalar ** -0.5``).
        softcap: Soft-capped scores ``softcap * tanh(scores / softcap)`` (Gemma 2's ``attn_logit_softcapping``):
            flash-attn's ``softcap`` on CUDA, else the ``"math"`` backend (SDPA cannot); None for plain scores.

    Examples:
        >>> attn = FlashAttention(16, num_heads=4, num_kv_heads=2, causal=True, rotary=True)
        >>> out, importance = attn(torch.randn(2, 5, 16), need_importance=True)
        >>> out.shape, importance.shape, attn.last_backend
        (torch.Size([2, 5, 16]), torch.Size([2, 5]), 'sdpa')
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        causal: bool = False,
        dropout: float = 0.0,
        rotary: bool = False,
        bias: bool = True,
        rope_theta: float = 10000.0,
        head_dim: int | None = None,
        backend: str = "auto",
        qkv_bias: bool | None = None,
        rope_scaling: dict | None = None,
        sliding_window: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = self._check_sizes(hidden_size, num_heads, num_kv_heads, head_dim)
        probability("FlashAttention", "dropout", dropout)
        choice("FlashAttention", "backend", backend, BACKENDS)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.causal, self.dropout, self.backend = causal, float(dropout), backend
        self.last_backend: str | None = None
        self.sliding_window = self._check_window(sliding_window, causal)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rope_scaling) if rotary else None
        self.q_norm = RMSNorm(head_dim, norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, norm_offset) if qk_norm else None
        self.scale, self.softcap = self._check_scores(scale, softcap, backend)
        if rope_scaling and not rotary:
            raise ValueError(f"FlashAttention(rope_scaling={rope_scaling!r}, rotary=False): rope_scaling scales "
                             "rotary frequencies; set rotary=True or drop rope_scaling.")

    @staticmethod
    def _check_window(window: int | None, causal: bool) -> int | None:
        if window is None:
            return None
        integer("FlashAttention", "sliding_window", window, minimum=1, example="4096")
        if not causal:
            raise ValueError(f"FlashAttention(sliding_window={window}, causal=False): a sliding window is "
                             "implemented for causal attention only; set causal=True or sliding_window=None.")
        return window

    @staticmethod
    def _check_scores(scale: float | None, softcap: float | None, backend: str) -> tuple[float | None, float | None]:
        for name, value in (("scale", scale), ("softcap", softcap)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"FlashAttention({name}={value!r}): {name} must be a positive number, or None.")
        if softcap is not None and backend == "sdpa":
            raise ValueError(f"FlashAttention(softcap={softcap}, backend='sdpa'): scaled_dot_product_attention "
                             "cannot soft-cap the scores; use backend='auto' (flash-attn's softcap on CUDA, else "
                             "'math') or backend='math'.")
        return (None if scale is None else float(scale)), (None if softcap is None else float(softcap))

    @staticmethod
    def _check_sizes(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> int:
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            integer("FlashAttention", name, value, minimum=1)
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"FlashAttention(hidden_size={hidden_size}, num_heads={num_heads}): num_heads must "
                             "divide hidden_size, or pass head_dim explicitly.")
        if num_heads % num_kv_heads:
            raise ValueError(f"FlashAttention(num_heads={num_heads}, num_kv_heads={num_kv_heads}): num_kv_heads "
                             "must divide num_heads (grouped-query attention).")
        if head_dim is None:
            return hidden_size // num_heads
        return integer("FlashAttention", "head_dim", head_dim, minimum=1)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        need_importance: bool | str = False,
        kv_cache: LayerKVCache | None = None,
        rotary_tables: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend ``x`` (B, L, hidden) to itself (and to the tokens in ``kv_cache``).

        Args:
            x: (B, L, hidden_size).
            key_padding_mask: (B, L), True (or 1) for real tokens.
            position_ids: (B, L) rotary positions; by default 0..L-1, restarting at each packed sequence.
            cu_seqlens: (N + 1,) cumulative lengths of sequences packed into a batch of one (0 first, L last).
            need_importance: True or ``"mean"``: also return the attention each token receives, mean over heads and real
                queries; ``"cls"``: the attention from the first token
                ([`attention_received`][lightning_peft.nn.attention_received]).
            kv_cache: This layer's `lightning_peft.nn.KVCache` slot: ``x`` holds the tokens after the cached ones;
                their keys and values are appended, the queries attend over all (causal: bottom-right aligned), the
                mask covers the cached and the new tokens (B, cached + L) and positions default to cached + 0..L-1.
            rotary_tables: ``(cos, sin)`` float32 (B, 1, L, D), this layer's ``rotary(position_ids)`` computed by
                the caller (a decoder computes them once per forward for all its layers with the same rotary, as
                transformers does); None computes them here.

        Returns:
            (B, L, hidden_size), or ``(output, importance)`` with importance (B, L) float32 (no gradient).
        """
        batch, length = self._check_input(x, key_padding_mask, position_ids, cu_seqlens, need_importance, kv_cache)
        past = 0 if kv_cache is None else kv_cache.length
        mask = _as_bool_mask(key_padding_mask, batch, past + length, "FlashAttention")
        bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, length, "FlashAttention")
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        if self.q_norm is not None:  # over each head's D, before rotary (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = (self._rotary_tables(batch, length, bounds, past, position_ids, x.device, q.dtype)
                        if rotary_tables is None else (t.to(q.dtype) for t in rotary_tables))  # (B, 1, L, D)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, Hkv, past + L, D)
        dropout_p = self.dropout if self.training else 0.0
        # One query after the cached keys sees them all: no mask to build (a sliding window still bounds them).
        causal = self.causal and (length > 1 or self.sliding_window is not None)
        if bounds is None:
            self.last_backend = select_backend(q, self.backend, key_padding_mask=mask, dropout_p=dropout_p,
                                               causal=causal, softcap=self.softcap)
            out = attention(q, k, v, causal, mask, dropout_p, self.last_backend, window=self.sliding_window,
                            scale=self.scale, softcap=self.softcap)
        else:
            self.last_backend = select_backend(q, self.backend, dropout_p=dropout_p, causal=self.causal,
                                               softcap=self.softcap)
            out = packed_attention(q, k, v, cu_seqlens, self.causal, dropout_p, self.last_backend,
                                   window=self.sliding_window, scale=self.scale, softcap=self.softcap)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))  # (B, L, hidden)
        if not need_importance:
            return out
        return out, self._importance(q, k, mask, bounds, "first" if need_importance == "cls" else "all")

    def _check_input(self, x: Tensor, mask: Tensor | None, position_ids: Tensor | None, cu_seqlens: Tensor | None,
                     need_importance: bool | str, kv_cache: LayerKVCache | None) -> tuple[int, int]:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"FlashAttention(hidden_size={self.hidden_size}): x must be (batch, length, "
                             f"{self.hidden_size}), got {tuple(x.shape)}.")
        batch, length = x.shape[:2]
        if position_ids is not None and tuple(position_ids.shape) != (batch, length):
            raise ValueError(f"FlashAttention: position_ids must have shape ({batch}, {length}), got "
                             f"{tuple(position_ids.shape)}.")
        if cu_seqlens is not None and (batch != 1 or mask is not None):
            raise ValueError(f"FlashAttention: cu_seqlens packs sequences into a batch of one without padding; got "
                             f"batch {batch}{' and a key_padding_mask' if mask is not None else ''}.")
        if kv_cache is not None and (cu_seqlens is not None or need_importance):
            raise ValueError("FlashAttention: kv_cache decodes one batch of sequences; it does not combine with "
                             f"{'cu_seqlens (packed training)' if cu_seqlens is not None else 'need_importance'}; "
                             "pass one or the other.")
        if not (isinstance(need_importance, bool) or need_importance in ("mean", "cls")):
            raise ValueError(f"FlashAttention(need_importance={need_importance!r}): choose False, True, 'mean' "
                             "or 'cls'.")
        if need_importance and self.sliding_window is not None:
            raise ValueError(f"FlashAttention(sliding_window={self.sliding_window}): need_importance computes the "
                             "attention without the window; token pruning needs sliding_window=None.")
        if need_importance and self.softcap is not None:
            raise ValueError(f"FlashAttention(softcap={self.softcap}): need_importance computes the attention "
                             "without soft-capping; token pruning needs softcap=None.")
        return batch, length

    def _rotary_tables(self, batch: int, length: int, bounds: list[int] | None, past: int,
                       position_ids: Tensor | None, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` (B, 1, L, D) in ``dtype`` at ``position_ids``, by default 0..L-1 (per packed sequence)
        after the ``past`` cached tokens."""
        positions = self._positions(batch, length, bounds, device) if position_ids is None else position_ids
        if position_ids is None and past:
            positions = positions + past  # after the cached tokens
        return self.rotary(positions, dtype)

    @staticmethod
    def _positions(batch: int, length: int, bounds: list[int] | None, device: torch.device) -> Tensor:
        """0..L-1 for each row, or 0..l-1 within each packed sequence: (B, L) long."""
        if bounds is None:
            return torch.arange(length, device=device).expand(batch, length)
        pieces = [torch.arange(b - a, device=device) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces)[None]

    @torch.no_grad()
    def _importance(self, q: Tensor, k: Tensor, mask: Tensor | None, bounds: list[int] | None, queries: str) -> Tensor:
        if bounds is None:
            return attention_received(q, k, mask, self.causal, self.scale, queries=queries)
        pieces = [attention_received(q[:, :, a:b], k[:, :, a:b], None, self.causal, self.scale, queries=queries)
                  for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(pieces, dim=-1)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}, backend={self.backend!r}"
                + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else "")
                + (f", scale={self.scale}" if self.scale is not None else "")
                + (f", softcap={self.softcap}" if self.softcap is not None else ""))
