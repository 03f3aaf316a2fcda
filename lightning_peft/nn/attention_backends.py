"""Which attention kernel runs, and the two kernels' calls: ``flash-attn`` on CUDA, PyTorch's fused SDPA elsewhere.

Papers: Dao et al., "FlashAttention", arXiv:2205.14135, and "FlashAttention-2", arXiv:2307.08691 (the kernels).

Backends ([`select_backend`][lightning_peft.nn.select_backend]): ``"flash_attn"`` (the ``flash-attn`` package:
importable, CUDA tensors, fp16 or bf16, head_dim <= 256), ``"sdpa"``
(`torch.nn.functional.scaled_dot_product_attention`, whose CPU dispatcher picks a fused flash-style kernel for every
case here except attention dropout), and ``"auto"``: flash_attn where it can run, else sdpa. The rule both compute and
the shapes: `lightning_peft.nn.attention`.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_peft._checks import choice, probability

BACKENDS = ("auto", "flash_attn", "sdpa")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256

__all__ = ["BACKENDS", "FLASH_DTYPES", "FLASH_MAX_HEAD_DIM", "flash_attn_available", "select_backend"]


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

    Examples:
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
    """The backend `attention` runs for these inputs: ``"flash_attn"`` or ``"sdpa"``.

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
        ValueError: If ``backend`` is not one of `BACKENDS` or ``dropout_p`` is outside [0, 1).
        TypeError: If ``dropout_p`` is not a number.
        RuntimeError: If ``backend="flash_attn"`` cannot run here; the message lists every reason.

    Examples:
        >>> select_backend(torch.zeros(1, 2, 4, 8))  # CPU float32: SDPA's fused CPU kernel
        'sdpa'
    """
    choice("attention", "backend", backend, BACKENDS)
    probability("attention", "dropout_p", dropout_p)
    if backend == "sdpa":
        return "sdpa"
    reasons = _flash_attn_obstacles(q, causal, key_padding_mask)
    if backend == "flash_attn" and reasons:
        raise RuntimeError("attention(backend='flash_attn') cannot run here: " + "; ".join(reasons)
                           + ". Use backend='auto' (falls back to 'sdpa') or backend='sdpa'.")
    return "sdpa" if reasons else "flash_attn"


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool, True where query i may see key j: j <= i + Lk - Lq (bottom-right aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def _band_mask(q_len: int, k_len: int, window: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool, causal (bottom-right aligned) within a sliding window: ``i' - window < j <= i'``,
    ``i' = i + Lk - Lq`` (each query sees itself and the ``window - 1`` keys before it, as Mistral)."""
    shift = k_len - q_len
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=shift) & ~ones.tril(diagonal=shift - window)


def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, dropout_p: float,
                    scale: float, window: int | None = None) -> Tensor:
    """SDPA with the mask kept broadcastable (B, 1, 1, Lk): the fused CPU kernel stays linear in memory. A sliding
    window shorter than the keys takes an explicit (B, 1, Lq, Lk) banded mask (quadratic memory)."""
    q_len, k_len = q.shape[2], k.shape[2]
    kwargs = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, Lk)
    if window is not None and window < k_len:  # sliding window (causal, checked by the caller)
        band = _band_mask(q_len, k_len, window, q.device)  # (Lq, Lk)
        attn_mask = band if attn_mask is None else attn_mask & band  # (B, 1, Lq, Lk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False, **kwargs)
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
                     scale: float, window: int | None = None) -> Tensor:
    """flash-attn: ``flash_attn_func`` on (B, L, H, D), or ``flash_attn_varlen_func`` on unpadded tokens.

    With a padding mask the real keys are gathered into one packed (total, Hkv, D) tensor; without causal every
    query stays (so padding queries attend to the real keys, as in sdpa); with causal (Lq == Lk) the queries are
    unpadded with the same mask, which keeps the order of the real tokens and so the causal rule among them, and
    the rows of padding queries are zeros. A sliding window is flash-attn's ``window_size=(window - 1, 0)``.
    """
    flash = _flash_attn_module()
    band = {} if window is None else {"window_size": (window - 1, 0)}
    batch, heads, q_len, head_dim = q.shape
    k_len, kv_heads = k.shape[2], k.shape[1]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, L, H, D)
    if mask is None:
        out = flash.flash_attn_func(q_t, k_t, v_t, dropout_p, softmax_scale=scale, causal=causal,
                                    **band)  # (B, Lq, H, D)
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
                                       softmax_scale=scale, causal=causal, **band)  # (total_q, H, D)
    if causal:
        out = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, index, out)
    return out.reshape(batch, q_len, heads, head_dim).transpose(1, 2)

