"""Which attention kernel runs, and the two kernels' calls: ``flash-attn`` on CUDA, PyTorch's fused SDPA elsewhere.

Papers: Dao et al., "FlashAttention", arXiv:2205.14135, and "FlashAttention-2", arXiv:2307.08691 (the kernels).

Backends ([`select_backend`][lightning_peft.nn.select_backend]): ``"flash_attn"`` (the ``flash-attn`` package:
importable, CUDA tensors, fp16 or bf16, head_dim <= 256), ``"sdpa"``
(`torch.nn.functional.scaled_dot_product_attention`, whose CPU dispatcher picks a fused flash-style kernel for every
case here except attention dropout), ``"math"`` (the explicit ``softmax(q k^T) v`` of `_math_attention`, quadratic in
memory), and ``"auto"``: flash_attn where it can run, else sdpa. Soft-capped scores (Gemma 2: ``softcap *
tanh(scores / softcap)``, Gemma Team 2024, arXiv:2408.00118) are outside SDPA: ``"auto"`` runs them on flash-attn's
``softcap`` argument, else on ``"math"``. The rule all compute and the shapes: `lightning_peft.nn.attention`.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_peft._checks import choice, probability

BACKENDS = ("auto", "flash_attn", "sdpa", "math")
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


def _flash_attn_obstacles(q: Tensor, causal: bool, key_padding_mask: Tensor | None,
                          softcap: float | None = None) -> list[str]:
    """Why the flash_attn backend cannot run on these inputs (empty where it can)."""
    reasons = []
    if not flash_attn_available():
        reasons.append("the flash_attn package is not installed (pip install flash-attn; it builds only with CUDA)")
    elif softcap is not None and not _flash_attn_softcaps():
        reasons.append(f"softcap={softcap} needs flash_attn_func's softcap argument (flash-attn >= 2.6)")
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
    softcap: float | None = None,
) -> str:
    """The backend `attention` runs for these inputs: ``"flash_attn"``, ``"sdpa"`` or ``"math"``.

    ``"auto"`` picks flash_attn where it can run (package importable, CUDA, fp16/bf16, head_dim <= 256; with
    ``softcap``, a flash-attn that takes it) and sdpa elsewhere, or ``"math"`` where ``softcap`` is set (SDPA cannot
    soft-cap); a forced backend is returned as is, or refused with the reasons it cannot run.

    Args:
        q: The queries (B, H, Lq, D); their device, dtype and head size decide.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``.
        key_padding_mask: The (B, Lk) mask, if any (flash-attn cannot take causal + padding with Lq != Lk).
        dropout_p: Attention dropout (both backends support it; sdpa then runs its quadratic-memory math kernel).
        causal: Whether the attention is causal.
        softcap: Soft-capping of the scores (Gemma 2's ``attn_logit_softcapping``), or None.

    Returns:
        ``"flash_attn"``, ``"sdpa"`` or ``"math"`` (soft-capping off flash-attn).

    Raises:
        ValueError: If ``backend`` is not one of `BACKENDS` or ``dropout_p`` is outside [0, 1).
        TypeError: If ``dropout_p`` is not a number.
        RuntimeError: If ``backend="flash_attn"`` cannot run here; the message lists every reason.
        ValueError: If ``backend="sdpa"`` comes with ``softcap``.

    Examples:
        >>> select_backend(torch.zeros(1, 2, 4, 8))  # CPU float32: SDPA's fused CPU kernel
        'sdpa'
    """
    choice("attention", "backend", backend, BACKENDS)
    probability("attention", "dropout_p", dropout_p)
    if backend == "sdpa" and softcap is not None:
        raise ValueError(f"attention(backend='sdpa', softcap={softcap}): scaled_dot_product_attention cannot "
                         "soft-cap the scores; use backend='auto' (flash-attn's softcap on CUDA, else the explicit "
                         "math path) or softcap=None.")
    if backend in ("sdpa", "math"):
        return backend
    reasons = _flash_attn_obstacles(q, causal, key_padding_mask, softcap)
    if backend == "flash_attn" and reasons:
        fallback = "'sdpa') or backend='sdpa'" if softcap is None else "'math', which soft-caps) or backend='math'"
        raise RuntimeError("attention(backend='flash_attn') cannot run here: " + "; ".join(reasons)
                           + f". Use backend='auto' (falls back to {fallback}.")
    if not reasons:
        return "flash_attn"
    return "sdpa" if softcap is None else "math"


@functools.cache
def _flash_attn_softcaps() -> bool:
    """Whether the installed flash-attn takes ``softcap`` (2.6 and later)."""
    return "softcap" in inspect.signature(_flash_attn_module().flash_attn_func).parameters


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool, True where query i may see key j: j <= i + Lk - Lq (bottom-right aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def _band_mask(q_len: int, k_len: int, window: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool, causal (bottom-right aligned) within a sliding window: ``i' - window < j <= i'``,
    ``i' = i + Lk - Lq`` (each query sees itself and the ``window - 1`` keys before it, as Mistral)."""
    shift = k_len - q_len
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=shift) & ~ones.tril(diagonal=shift - window)


def flash_options(window: int | None, softcap: float | None) -> dict:
    """flash-attn's keyword arguments for a sliding window (``window_size=(window - 1, 0)``: the query and the
    ``window - 1`` keys before it) and soft-capping (``softcap``)."""
    options: dict = {} if window is None else {"window_size": (window - 1, 0)}
    return options if softcap is None else {**options, "softcap": softcap}


def _math_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, dropout_p: float,
                    scale: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """The explicit ``softmax(cap(scale * q k^T) + mask) v``, for what SDPA cannot compute (soft-capped scores).

    The operations of transformers' eager attention, which Gemma 2 runs: the scores in the input dtype, capped as
    ``softcap * tanh(scores / softcap)`` before the mask, the softmax in float32 and cast back (so a bfloat16 or
    float64 model rounds as there). Memory grows with Lq * Lk: (B, H, Lq, Lk) scores. Rows with no visible key are
    zeros.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, q_len, head_dim)  # (B, Hkv, G, Lq, D)
    scores = torch.matmul(grouped, k[:, :, None].transpose(-1, -2)) * scale  # (B, Hkv, G, Lq, Lk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = None
    if causal:
        allowed = (_causal_mask(q_len, k_len, q.device) if window is None
                   else _band_mask(q_len, k_len, window, q.device))  # (Lq, Lk)
    if mask is not None:
        padding = mask[:, None, None, None, :]  # (B, 1, 1, 1, Lk)
        allowed = padding if allowed is None else allowed & padding
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1, dtype=torch.float32), nan=0.0).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v[:, :, None])  # (B, Hkv, G, Lq, D)
    return out.reshape(batch, heads, q_len, head_dim)


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
                     scale: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """flash-attn: ``flash_attn_func`` on (B, L, H, D), or ``flash_attn_varlen_func`` on unpadded tokens.

    With a padding mask the real keys are gathered into one packed (total, Hkv, D) tensor; without causal every
    query stays (so padding queries attend to the real keys, as in sdpa); with causal (Lq == Lk) the queries are
    unpadded with the same mask, which keeps the order of the real tokens and so the causal rule among them, and
    the rows of padding queries are zeros. A sliding window and soft-capping: `flash_options`.
    """
    flash = _flash_attn_module()
    band = flash_options(window, softcap)
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

