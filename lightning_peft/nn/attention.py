"""Exact attention with a flash-attention kernel: the ``flash-attn`` package on CUDA, PyTorch's fused SDPA elsewhere.

Papers: Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", arXiv:2205.14135,
and "FlashAttention-2", arXiv:2307.08691 (the kernels); Ainslie et al., "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints", arXiv:2305.13245 (grouped key/value heads); Su et al., "RoFormer:
Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864 (rotary positions); Kim et al., "Learned Token
Pruning for Transformers", arXiv:2107.00910 (the attention a token receives, for pruning).

The rule. For query ``i`` and key ``j`` of one batch element and head ``h`` (key head ``h // (H / Hkv)``)::

    out[i] = sum_j softmax_j(scale * q[i] . k[j] + bias[i, j]) v[j],   scale = 1 / sqrt(D) unless given
    bias[i, j] = -inf where key j is padding (key_padding_mask False), or where causal and j > i + Lk - Lq

so a causal mask with ``Lq != Lk`` is aligned bottom-right, as flash-attn aligns it (the last query sees every key).
A row whose keys are all masked gives zeros, not NaN. The flash kernels compute this in tiles with an online
softmax, never storing the (Lq, Lk) score matrix: memory linear in the sequence length.

Backends (:func:`select_backend`): ``"flash_attn"`` (the ``flash-attn`` package: importable, CUDA tensors, fp16 or
bf16, head_dim <= 256), ``"sdpa"`` (:func:`torch.nn.functional.scaled_dot_product_attention`, whose CPU dispatcher
picks a fused flash-style kernel for every case here except attention dropout), and ``"auto"``: flash_attn where it
can run, else sdpa.

Shapes:

=======================  ============================  =========================================================
tensor                   shape                         meaning
=======================  ============================  =========================================================
``q``                    (B, H, Lq, D)                 queries, H heads of size D
``k``, ``v``             (B, Hkv, Lk, D)               keys and values; Hkv divides H (GQA; Hkv = 1 is MQA)
``key_padding_mask``     (B, Lk) bool                  True for a real key, False for padding
``cu_seqlens``           (N + 1,) int32                packed sequences of a (1, L) batch: 0, l0, l0 + l1, ..., L
``position_ids``         (B, L) long                   rotary positions
``cos``, ``sin``         (B, 1, L, D)                  rotary tables (:class:`RotaryEmbedding`)
:func:`attention` out    (B, H, Lq, D)
:func:`attention_received` (B, Lk) float32             attention each key receives, mean over heads and queries
:class:`FlashAttention`  (B, L, hidden) -> same
=======================  ============================  =========================================================
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BACKENDS = ("auto", "flash_attn", "sdpa")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256

__all__ = ["BACKENDS", "FlashAttention", "RotaryEmbedding", "apply_rotary", "attention", "attention_received",
           "flash_attn_available", "select_backend"]


# ------------------------------------------------------------------------------------------------ dispatch


@functools.cache
def _flash_attn_module():
    """The ``flash_attn`` module, or None where it does not import (not installed, or built for another CUDA)."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def flash_attn_available() -> bool:
    """Whether the ``flash-attn`` package imports here (it is a CUDA-only, optional extra).

    Example:
        >>> isinstance(flash_attn_available(), bool)
        True
    """
    return _flash_attn_module() is not None


def _flash_attn_obstacles(q: Tensor, causal: bool, key_padding_mask: Tensor | None) -> list[str]:
    """Why the flash_attn backend cannot run on these inputs (empty where it can)."""
    reasons = []
    if not flash_attn_available():
        reasons.append("the flash_attn package is not installed (pip install flash-attn; it builds only with CUDA)")
    if q.device.type != "cuda":
        reasons.append(f"q is on {q.device.type}, flash-attn needs a CUDA device")
    if q.dtype not in FLASH_DTYPES:
        reasons.append(f"q is {q.dtype}, flash-attn needs torch.float16 or torch.bfloat16")
    if q.shape[-1] > FLASH_MAX_HEAD_DIM:
        reasons.append(f"head_dim is {q.shape[-1]}, flash-attn supports at most {FLASH_MAX_HEAD_DIM}")
    if causal and key_padding_mask is not None and key_padding_mask.shape[-1] != q.shape[-2]:
        reasons.append("causal attention with a key_padding_mask needs as many queries as keys on flash-attn")
    return reasons


def select_backend(
    q: Tensor,
    backend: str = "auto",
    *,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
) -> str:
    """The backend :func:`attention` runs for these inputs: ``"flash_attn"`` or ``"sdpa"``.

    ``"auto"`` picks flash_attn where it can run (package importable, CUDA, fp16/bf16, head_dim <= 256) and sdpa
    elsewhere; a forced backend is returned as is, or refused with the reasons it cannot run.

    Args:
        q: The queries (B, H, Lq, D); their device, dtype and head size decide.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``.
        key_padding_mask: The (B, Lk) mask, if any (flash-attn cannot take causal + padding with Lq != Lk).
        dropout_p: Attention dropout (both backends support it; sdpa then runs its quadratic-memory math kernel).
        causal: Whether the attention is causal.

    Returns:
        ``"flash_attn"`` or ``"sdpa"``.

    Raises:
        ValueError: If ``backend`` is not one of :data:`BACKENDS` or ``dropout_p`` is outside [0, 1).
        RuntimeError: If ``backend="flash_attn"`` cannot run here; the message lists every reason.

    Example:
        >>> select_backend(torch.zeros(1, 2, 4, 8))  # CPU float32: SDPA's fused CPU kernel
        'sdpa'
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention(backend={backend!r}): unknown backend; choose one of {BACKENDS}.")
    _check_dropout(dropout_p, "attention")
    if backend == "sdpa":
        return "sdpa"
    reasons = _flash_attn_obstacles(q, causal, key_padding_mask)
    if backend == "flash_attn" and reasons:
        raise RuntimeError("attention(backend='flash_attn') cannot run here: " + "; ".join(reasons)
                           + ". Use backend='auto' (falls back to 'sdpa') or backend='sdpa'.")
    return "sdpa" if reasons else "flash_attn"


# ------------------------------------------------------------------------------------------------ checks


def _check_dropout(dropout_p: float, who: str) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{who}(dropout_p={dropout_p}): dropout must be in [0, 1).")


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
) -> Tensor:
    """Exact multi-head attention ``softmax(scale * q k^T + mask) v`` without storing the score matrix.

    Args:
        q: Queries (B, H, Lq, D).
        k: Keys (B, Hkv, Lk, D); Hkv divides H (grouped-query attention).
        v: Values (B, Hkv, Lk, D).
        causal: Query ``i`` sees keys ``j <= i + Lk - Lq`` (bottom-right aligned, as flash-attn).
        key_padding_mask: (B, Lk), True for real keys (bool, or integer 0/1).
        dropout_p: Dropout on the attention probabilities; pass 0.0 in evaluation.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"`` (:func:`select_backend`).
        scale: The score scale; ``1 / sqrt(D)`` when None.

    Returns:
        (B, H, Lq, D), the dtype of ``q``. Rows with no visible key are zeros. On flash_attn with causal and a
        padding mask, the rows of padding queries are zeros too (they are arbitrary by convention; sdpa lets them
        attend to the real keys before them).

    Raises:
        ValueError: On shapes that do not fit, an unknown backend, or dropout outside [0, 1).
        TypeError: On a float key_padding_mask.
        RuntimeError: If ``backend="flash_attn"`` cannot run here.

    Example:
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
    chosen = select_backend(q, backend, key_padding_mask=mask, dropout_p=dropout_p, causal=causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if chosen == "flash_attn":
        return _flash_attention(q, k, v, causal, mask, dropout_p, scale)
    return _sdpa_attention(q, k, v, causal, mask, dropout_p, scale)


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool, True where query i may see key j: j <= i + Lk - Lq (bottom-right aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, dropout_p: float,
                    scale: float) -> Tensor:
    """SDPA with the mask kept broadcastable (B, 1, 1, Lk): the fused CPU kernel stays linear in memory."""
    q_len, k_len = q.shape[2], k.shape[2]
    kwargs = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, Lk)
    is_causal = causal and q_len == k_len
    if causal and q_len != k_len:  # SDPA aligns is_causal top-left; bottom-right needs an explicit (Lq, Lk) mask
        tri = _causal_mask(q_len, k_len, q.device)
        attn_mask = tri if attn_mask is None else attn_mask & tri  # (B, 1, Lq, Lk)
    elif is_causal and attn_mask is not None:
        # The fused CPU kernel applies is_causal and a (B, 1, 1, Lk) mask together (linear memory); SDPA's other
        # kernels refuse the pair, and then the two are combined into one (B, 1, L, L) mask.
        if q.device.type == "cpu" and dropout_p == 0.0:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=True, **kwargs)
            except RuntimeError as error:
                if "is_causal" not in str(error):
                    raise
        attn_mask, is_causal = attn_mask & _causal_mask(q_len, k_len, q.device), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, dropout_p: float,
                     scale: float) -> Tensor:
    """flash-attn: ``flash_attn_func`` on (B, L, H, D), or ``flash_attn_varlen_func`` on unpadded tokens.

    With a padding mask the real keys are gathered into one packed (total, Hkv, D) tensor; without causal every
    query stays (so padding queries attend to the real keys, as in sdpa); with causal (Lq == Lk) the queries are
    unpadded with the same mask, which keeps the order of the real tokens and so the causal rule among them, and
    the rows of padding queries are zeros.
    """
    flash = _flash_attn_module()
    batch, heads, q_len, head_dim = q.shape
    k_len, kv_heads = k.shape[2], k.shape[1]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, L, H, D)
    if mask is None:
        out = flash.flash_attn_func(q_t, k_t, v_t, dropout_p, softmax_scale=scale, causal=causal)  # (B, Lq, H, D)
        return out.transpose(1, 2)
    lengths = mask.sum(dim=-1, dtype=torch.int32)  # (B,)
    cu_k = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # (B + 1,)
    max_k = int(lengths.max())
    index = mask.flatten().nonzero().flatten()  # (total_k,) positions of real tokens in B * Lk
    k_packed = k_t.reshape(batch * k_len, kv_heads, head_dim).index_select(0, index)  # (total_k, Hkv, D)
    v_packed = v_t.reshape(batch * k_len, kv_heads, head_dim).index_select(0, index)
    q_flat = q_t.reshape(batch * q_len, heads, head_dim)  # (B * Lq, H, D)
    if causal:
        q_packed, cu_q, max_q = q_flat.index_select(0, index), cu_k, max_k
    else:
        q_packed, max_q = q_flat, q_len
        cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    out = flash.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, dropout_p,
                                       softmax_scale=scale, causal=causal)  # (total_q, H, D)
    if causal:
        out = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, index, out)
    return out.reshape(batch, q_len, heads, head_dim).transpose(1, 2)


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
                     dropout_p: float = 0.0, backend: str = "auto", scale: float | None = None) -> Tensor:
    """Attention within each of the packed sequences of a (1, H, L, D) batch: no token sees another sequence.

    flash_attn: one ``flash_attn_varlen_func`` call. sdpa: :func:`attention` on each sequence in turn (exact, and
    linear in memory, unlike a block-diagonal mask).

    Args:
        q: (1, H, L, D). k, v: (1, Hkv, L, D).
        cu_seqlens: (N + 1,) cumulative lengths, 0 first and L last.
        causal, dropout_p, backend, scale: as in :func:`attention`.

    Returns:
        (1, H, L, D).

    Example:
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
    chosen = select_backend(q, backend, dropout_p=dropout_p, causal=causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if chosen == "flash_attn":
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        q_t, k_t, v_t = (t[0].transpose(0, 1) for t in (q, k, v))  # (L, H, D)
        out = _flash_attn_module().flash_attn_varlen_func(q_t, k_t, v_t, cu, cu, longest, longest, dropout_p,
                                                          softmax_scale=scale, causal=causal)
        return out.transpose(0, 1)[None]
    pieces = [_sdpa_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, None, dropout_p, scale)
              for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(pieces, dim=2) if pieces else torch.zeros_like(q)


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
        causal: Mask as :func:`attention` does (bottom-right aligned).
        scale: ``1 / sqrt(D)`` when None.
        chunk_size: Queries per chunk.
        queries: ``"all"`` or ``"first"``.

    Returns:
        (B, Lk) float32; each row of a batch element with real queries sums to 1 over its keys.

    Example:
        >>> q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
        >>> mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        >>> received = attention_received(q, k, mask, chunk_size=4)
        >>> received.shape, received[1, 4:].tolist(), torch.allclose(received.sum(-1), torch.ones(2))
        (torch.Size([2, 6]), [0.0, 0.0], True)
    """
    if queries not in ("all", "first"):
        raise ValueError(f"attention_received(queries={queries!r}): choose 'all' or 'first'.")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"attention_received(chunk_size={chunk_size!r}): must be a positive integer.")
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


# ------------------------------------------------------------------------------------------------ rotary


class RotaryEmbedding(nn.Module):
    """Rotary position tables in the RoFormer / Llama "rotate_half" convention.

    ``inv_freq[i] = 1 / base^(2i / D)`` (a non-persistent float32 buffer); for position ``p`` the angles are
    ``p * inv_freq`` repeated twice along the head dimension, so ``cos`` and ``sin`` are (B, 1, L, D).

    Args:
        head_dim: D, even.
        base: The frequency base (Llama's ``rope_theta``).

    Example:
        >>> rope = RotaryEmbedding(8)
        >>> cos, sin = rope(torch.arange(5)[None], torch.float32)
        >>> cos.shape, cos[0, 0, 0].tolist() == [1.0] * 8
        (torch.Size([1, 1, 5, 8]), True)
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"RotaryEmbedding(head_dim={head_dim!r}): head_dim must be a positive even integer.")
        if not base > 0:
            raise ValueError(f"RotaryEmbedding(base={base!r}): base must be positive.")
        self.head_dim = head_dim
        self.base = float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (D / 2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each (B, 1, L, head_dim) in ``dtype``, for integer ``position_ids`` (B, L)."""
        if position_ids.dim() != 2:
            raise ValueError("RotaryEmbedding: position_ids must be (batch, length), got "
                             f"{tuple(position_ids.shape)}.")
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device, torch.float)  # (B, L, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, L, D) by the tables ``cos``, ``sin`` (B, 1, L, D): ``x cos + rotate_half(x) sin``.

    Example:
        >>> x = torch.randn(1, 2, 3, 4)
        >>> cos, sin = RotaryEmbedding(4)(torch.zeros(1, 3, dtype=torch.long))
        >>> torch.equal(apply_rotary(x, cos, sin), x)  # position 0: no rotation
        True
    """
    return x * cos + _rotate_half(x) * sin


# ------------------------------------------------------------------------------------------------ module


class FlashAttention(nn.Module):
    """Multi-head self-attention with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, on :func:`attention`.

    The projection names match Llama's (and LoRA ``target_modules``, layer-wise LR decay and tensor-parallel plans
    that name them). Grouped-query attention with ``num_kv_heads``; rotary positions with ``rotary=True``; packed
    sequences with ``cu_seqlens``; the attention each token receives with ``need_importance`` (token pruning).

    Args:
        hidden_size: Model width.
        num_heads: Query heads H.
        num_kv_heads: Key/value heads (dividing H); None for H.
        causal: Decoder (causal) attention.
        dropout: Attention-probability dropout, applied in training mode only.
        rotary: Apply :class:`RotaryEmbedding` to queries and keys.
        bias: Bias on the four projections.
        rope_theta: The rotary base.
        head_dim: Size of a head; None for ``hidden_size // num_heads``.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``; :attr:`last_backend` records what ran.

    Example:
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
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = self._check_sizes(hidden_size, num_heads, num_kv_heads, head_dim)
        _check_dropout(dropout, "FlashAttention")
        if backend not in BACKENDS:
            raise ValueError(f"FlashAttention(backend={backend!r}): unknown backend; choose one of {BACKENDS}.")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.causal, self.dropout, self.backend = causal, float(dropout), backend
        self.last_backend: str | None = None
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rotary else None

    @staticmethod
    def _check_sizes(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> int:
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FlashAttention({name}={value!r}): must be a positive integer.")
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"FlashAttention(hidden_size={hidden_size}, num_heads={num_heads}): num_heads must "
                             "divide hidden_size, or pass head_dim explicitly.")
        if num_heads % num_kv_heads:
            raise ValueError(f"FlashAttention(num_heads={num_heads}, num_kv_heads={num_kv_heads}): num_kv_heads "
                             "must divide num_heads (grouped-query attention).")
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"FlashAttention(head_dim={head_dim!r}): must be a positive integer.")
        return head_dim

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        need_importance: bool | str = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend ``x`` (B, L, hidden) to itself.

        Args:
            x: (B, L, hidden_size).
            key_padding_mask: (B, L), True (or 1) for real tokens.
            position_ids: (B, L) rotary positions; by default 0..L-1, restarting at each packed sequence.
            cu_seqlens: (N + 1,) cumulative lengths of sequences packed into a batch of one (0 first, L last).
            need_importance: True or ``"mean"``: also return the attention each token receives, mean over heads
                and real queries; ``"cls"``: the attention from the first token (:func:`attention_received`).

        Returns:
            (B, L, hidden_size), or ``(output, importance)`` with importance (B, L) float32 (no gradient).
        """
        batch, length = self._check_input(x, key_padding_mask, position_ids, cu_seqlens, need_importance)
        mask = _as_bool_mask(key_padding_mask, batch, length, "FlashAttention")
        bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, length, "FlashAttention")
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        if self.rotary is not None:
            positions = self._positions(batch, length, bounds, x.device) if position_ids is None else position_ids
            cos, sin = self.rotary(positions, q.dtype)  # (B, 1, L, D)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout_p = self.dropout if self.training else 0.0
        if bounds is None:
            self.last_backend = select_backend(q, self.backend, key_padding_mask=mask, dropout_p=dropout_p,
                                               causal=self.causal)
            out = attention(q, k, v, self.causal, mask, dropout_p, self.last_backend)
        else:
            self.last_backend = select_backend(q, self.backend, dropout_p=dropout_p, causal=self.causal)
            out = packed_attention(q, k, v, cu_seqlens, self.causal, dropout_p, self.last_backend)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))  # (B, L, hidden)
        if not need_importance:
            return out
        return out, self._importance(q, k, mask, bounds, "first" if need_importance == "cls" else "all")

    def _check_input(self, x: Tensor, mask: Tensor | None, position_ids: Tensor | None, cu_seqlens: Tensor | None,
                     need_importance: bool | str) -> tuple[int, int]:
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
        if not (isinstance(need_importance, bool) or need_importance in ("mean", "cls")):
            raise ValueError(f"FlashAttention(need_importance={need_importance!r}): choose False, True, 'mean' "
                             "or 'cls'.")
        return batch, length

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
            return attention_received(q, k, mask, self.causal, queries=queries)
        pieces = [attention_received(q[:, :, a:b], k[:, :, a:b], None, self.causal, queries=queries)
                  for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(pieces, dim=-1)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}, backend={self.backend!r}")
