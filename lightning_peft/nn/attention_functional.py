"""The attention functions: `attention`, [`packed_attention`][lightning_peft.nn.packed_attention] and
[`attention_received`][lightning_peft.nn.attention_received].

Papers: Dao et al., "FlashAttention", arXiv:2205.14135 (exact attention without the score matrix); Ainslie et al.,
"GQA", arXiv:2305.13245 (grouped key/value heads); Kim et al., "Learned Token Pruning for Transformers",
arXiv:2107.00910 (the attention a token receives, for pruning).

The rule, the masks and the shapes: the docstring of `lightning_peft.nn.attention`, which exports these functions
(``from lightning_peft.nn.attention import attention``); the kernels they dispatch to:
`lightning_peft.nn.attention_backends`.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from lightning_peft._checks import choice, integer
from lightning_peft.nn.attention_backends import (
    _causal_mask,
    _flash_attention,
    _flash_attn_module,
    _math_attention,
    _sdpa_attention,
    flash_options,
    select_backend,
)
from lightning_peft.nn.packed_sdpa import PACKED_METHODS, packed_sdpa

__all__ = ["attention", "attention_received", "packed_attention"]


# ------------------------------------------------------------------------------------------------ checks


def _as_bool_mask(mask: Tensor | None, batch: int, length: int, who: str) -> Tensor | None:
    """Check a (B, L) key-padding mask (bool, or integer 0/1 as Hugging Face passes it) and return it as bool."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{who}: key_padding_mask must be a tensor, got {type(mask).__name__}.")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{who}: key_padding_mask must be bool (True = real token) or integer 0/1, got {mask.dtype}; "
                        "for an additive float mask convert it first, e.g. mask = float_mask == 0.")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{who}: key_padding_mask must have shape (batch, kv_len) = ({batch}, {length}), "
                         f"got {tuple(mask.shape)}.")
    return mask if mask.dtype == torch.bool else mask != 0


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention: q, k and v must be 4-D (batch, heads, length, head_dim), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError("attention: k and v must have the same shape, and batch and head_dim of q: got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: the {k.shape[1]} key/value heads must divide the {q.shape[1]} query heads "
                         "(grouped-query attention).")


# ------------------------------------------------------------------------------------------------ attention


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Exact multi-head attention ``softmax(scale * q k^T + mask) v`` without storing the score matrix.

    Args:
        q: Queries (B, H, Lq, D).
        k: Keys (B, Hkv, Lk, D); Hkv divides H (grouped-query attention).
        v: Values (B, Hkv, Lk, D).
        causal: Query ``i`` sees keys ``j <= i + Lk - Lq`` (bottom-right aligned, as flash-attn).
        key_padding_mask: (B, Lk), True for real keys (bool, or integer 0/1).
        dropout_p: Dropout on the attention probabilities; pass 0.0 in evaluation.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"`` ([`select_backend`][lightning_peft.nn.select_backend]).
        scale: The score scale; ``1 / sqrt(D)`` when None.
        window: Sliding-window attention (Mistral; needs ``causal``): query ``i`` sees only the ``window`` keys
            ending at its own position. On sdpa, keys longer than the window take an explicit banded
            (B, 1, Lq, Lk) mask, so memory grows with Lq * Lk there.
        softcap: Soft-capped scores ``softcap * tanh(scale * q k^T / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``): flash-attn's ``softcap`` on CUDA, else the explicit math path, which
            stores the (B, H, Lq, Lk) scores; SDPA cannot soft-cap.

    Returns:
        (B, H, Lq, D), the dtype of ``q``. Rows with no visible key are zeros. On flash_attn with causal and a
        padding mask, the rows of padding queries are zeros too (they are arbitrary by convention; sdpa lets them
        attend to the real keys before them).

    Raises:
        ValueError: On shapes that do not fit, an unknown backend, dropout outside [0, 1), a softcap that is not
            positive, or ``backend="sdpa"`` with a softcap.
        TypeError: On a float key_padding_mask, or a ``dropout_p`` that is not a number.
        RuntimeError: If ``backend="flash_attn"`` cannot run here.

    Examples:
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
        >>> mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        >>> attention(q, k, v, causal=True, key_padding_mask=mask).shape
        torch.Size([2, 4, 5, 8])
    """
    _check_qkv(q, k, v)
    batch, _, q_len, head_dim = q.shape
    mask = _as_bool_mask(key_padding_mask, batch, k.shape[2], "attention")
    if mask is not None and bool(mask.all()):
        mask = None  # nothing to mask: keeps the mask-free kernels
    _check_window(window, causal, "attention")
    _check_softcap(softcap, "attention")
    chosen = select_backend(q, backend, key_padding_mask=mask, dropout_p=dropout_p, causal=causal, softcap=softcap)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if chosen == "flash_attn":
        return _flash_attention(q, k, v, causal, mask, dropout_p, scale, window, softcap)
    if chosen == "math":
        return _math_attention(q, k, v, causal, mask, dropout_p, scale, window, softcap)
    return _sdpa_attention(q, k, v, causal, mask, dropout_p, scale, window)


def _check_window(window: int | None, causal: bool, who: str) -> None:
    """A sliding window is a positive integer on causal attention (Mistral's; a bidirectional one is not built)."""
    if window is None:
        return
    integer(who, "window", window, minimum=1, example="4096")
    if not causal:
        raise ValueError(f"{who}(window={window}, causal=False): a sliding window is implemented for causal "
                         "attention only; pass causal=True or window=None.")


def _check_softcap(softcap: float | None, who: str) -> None:
    """A soft-cap is a positive number (Gemma 2: 50.0 on the attention scores)."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"{who}(softcap={softcap!r}): softcap must be a positive number (Gemma 2: 50.0), or None.")


def _check_cu_seqlens(cu_seqlens: Tensor, length: int, who: str) -> list[int]:
    """Validate cumulative lengths (0, ..., L) and return them as a list."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise TypeError(f"{who}: cu_seqlens must be a 1-D integer tensor (0, l0, l0 + l1, ..., L), got "
                        f"{cu_seqlens!r}.")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or any(b > a for a, b in
                                                                          zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"{who}: cu_seqlens must rise from 0 to the sequence length {length}, got {bounds}.")
    return bounds


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool = False,
                     dropout_p: float = 0.0, backend: str = "auto", scale: float | None = None,
                     window: int | None = None, sdpa_method: str = "auto",
                     softcap: float | None = None) -> Tensor:
    """Attention within each of the packed sequences of a (1, H, L, D) batch: no token sees another sequence.

    flash_attn: one ``flash_attn_varlen_func`` call. sdpa: the sequences gathered into padded groups of similar
    length, one SDPA call per group (`lightning_peft.nn.packed_sdpa`; exact, and linear in memory, unlike a
    block-diagonal mask).

    Args:
        q: (1, H, L, D).
        k: (1, Hkv, L, D).
        v: (1, Hkv, L, D).
        cu_seqlens: (N + 1,) cumulative lengths, 0 first and L last.
        causal: As in `attention`.
        dropout_p: As in `attention`.
        backend: As in `attention`.
        scale: As in `attention`.
        window: As in `attention` (within each sequence).
        sdpa_method: How sdpa runs the sequences: ``"auto"`` (groups of similar length), ``"loop"`` (one call
            each) or ``"padded"`` (one padded call); all exact. flash_attn and math ignore it.
        softcap: As in `attention`; off flash-attn, the sequences run one at a time on the math backend.

    Returns:
        (1, H, L, D).

    Examples:
        >>> q = torch.randn(1, 2, 5, 4)
        >>> whole = packed_attention(q, q, q, torch.tensor([0, 2, 5], dtype=torch.int32))
        >>> torch.allclose(whole[:, :, 2:], attention(q[:, :, 2:], q[:, :, 2:], q[:, :, 2:]), atol=1e-6)
        True
    """
    _check_qkv(q, k, v)
    if q.shape[0] != 1 or q.shape[2] != k.shape[2]:
        raise ValueError(f"packed_attention: packed sequences need batch 1 and as many keys as queries, got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}.")
    bounds = _check_cu_seqlens(cu_seqlens, q.shape[2], "packed_attention")
    _check_window(window, causal, "packed_attention")
    choice("packed_attention", "sdpa_method", sdpa_method, PACKED_METHODS)
    _check_softcap(softcap, "packed_attention")
    chosen = select_backend(q, backend, dropout_p=dropout_p, causal=causal, softcap=softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if chosen == "flash_attn":
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        q_t, k_t, v_t = (t[0].transpose(0, 1) for t in (q, k, v))  # (L, H, D)
        band = flash_options(window, softcap)
        out = _flash_attn_module().flash_attn_varlen_func(q_t, k_t, v_t, cu, cu, longest, longest, dropout_p,
                                                          softmax_scale=scale, causal=causal, **band)
        return out.transpose(0, 1)[None]
    if chosen == "math":
        pieces = [_math_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, None, dropout_p, scale, window,
                                  softcap) for a, b in itertools.pairwise(bounds) if b > a]
        return torch.cat(pieces, dim=2) if pieces else torch.zeros_like(q)
    return packed_sdpa(q, k, v, bounds, causal, dropout_p, scale, sdpa_method, window)


# ------------------------------------------------------------------------------------------------ importance


def attention_received(
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 256,
    queries: str = "all",
) -> Tensor:
    """The attention each key receives: column means of ``softmax(scale * q k^T)``, computed in query chunks.

    ``queries="all"``: the mean over heads and over real queries (learned token pruning, Kim et al. 2022);
    ``queries="first"``: the row of the first query only, mean over heads (EViT, Liang et al. 2022: attention from
    the [CLS] token). Queries are real where ``key_padding_mask`` is True when Lq == Lk; with Lq != Lk every query
    counts. Only (B, H, chunk_size, Lk) scores exist at a time, never the full (Lq, Lk) matrix.

    Args:
        q: Queries (B, H, Lq, D).
        k: Keys (B, Hkv, Lk, D), Hkv dividing H.
        key_padding_mask: (B, Lk), True for real keys; padding keys receive 0.
        causal: Mask as `attention` does (bottom-right aligned).
        scale: ``1 / sqrt(D)`` when None.
        chunk_size: Queries per chunk.
        queries: ``"all"`` or ``"first"``.

    Returns:
        (B, Lk) float32; each row of a batch element with real queries sums to 1 over its keys.

    Examples:
        >>> q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
        >>> mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        >>> received = attention_received(q, k, mask, chunk_size=4)
        >>> received.shape, received[1, 4:].tolist(), torch.allclose(received.sum(-1), torch.ones(2))
        (torch.Size([2, 6]), [0.0, 0.0], True)
    """
    choice("attention_received", "queries", queries, ("all", "first"))
    integer("attention_received", "chunk_size", chunk_size, minimum=1, example="256")
    _check_qkv(q, k, k)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    mask = _as_bool_mask(key_padding_mask, batch, k_len, "attention_received")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    grouped_q = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, q_len, head_dim)  # (B, Hkv, G, Lq, D)
    keys_t = k.to(dtype).transpose(-1, -2)[:, :, None]  # (B, Hkv, 1, D, Lk)
    if queries == "first":
        probs = _chunk_probs(grouped_q, keys_t, mask, causal, scale, 0, 1, k_len)  # (B, Hkv, G, 1, Lk)
        return probs.mean(dim=(1, 2, 3)).float()
    real_queries = mask if mask is not None and q_len == k_len else None
    total = q.new_zeros(batch, k_len, dtype=dtype)
    for start in range(0, q_len, chunk_size):
        stop = min(start + chunk_size, q_len)
        probs = _chunk_probs(grouped_q, keys_t, mask, causal, scale, start, stop, k_len)  # (B, Hkv, G, c, Lk)
        if real_queries is not None:
            probs = probs * real_queries[:, None, None, start:stop, None]
        total += probs.sum(dim=(1, 2, 3))
    count = q_len if real_queries is None else real_queries.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return (total / (heads * count)).float()


def _chunk_probs(grouped_q: Tensor, keys_t: Tensor, mask: Tensor | None, causal: bool, scale: float, start: int,
                 stop: int, k_len: int) -> Tensor:
    """Softmax rows of queries ``start:stop``: (B, Hkv, G, stop - start, Lk); a row with no visible key is 0."""
    q_len = grouped_q.shape[3]
    scores = torch.matmul(grouped_q[:, :, :, start:stop], keys_t) * scale  # (B, Hkv, G, c, Lk)
    allowed = None if mask is None else mask[:, None, None, None, :]  # (B, 1, 1, 1, Lk)
    if causal:
        tri = _causal_mask(q_len, k_len, scores.device)[start:stop]  # (c, Lk)
        allowed = tri if allowed is None else allowed & tri
    if allowed is None:
        return scores.softmax(dim=-1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)

