"""Packed batches inside a transformers 5 model without a ``(T, T)`` mask: an attention implementation that runs
`lightning_peft.nn.packed_attention` on the packed rows.

transformers' ``sdpa`` sees a packed ``(1, T)`` batch through its ``position_ids`` and builds a block-diagonal
``(1, 1, T, T)`` mask; SDPA then computes the whole ``T x T`` square, of which only ``sum_i l_i^2 / T^2`` lies inside
a row (6% at a 4096-token pack of SFT rows). `PACKED_SDPA` is ``sdpa`` with one change: a call that carries the row
boundaries (``cu_seq_lens_q``, transformers' own keyword, forwarded by every model of the functional attention API to
its attention layers) runs `packed_attention`: the rows gathered into padded groups of similar length, one SDPA call
per group (flash-attn's varlen kernel on CUDA when installed), exact, linear in memory. Every other call (padded
batches, ``generate``) runs transformers' ``sdpa_attention_forward`` unchanged.

Its mask function is transformers' ``sdpa_mask``, except inside `packed_forward`, where it builds none: the mask is
built once per model call, before the layers, so the flag only has to last that call. The attention function reads
the boundaries from its keywords, never from the flag, so a layer recomputed under activation checkpointing (after
the call returned) still takes the packed path.

The layer's own settings reach `packed_attention`: ``scaling`` (Gemma's query scale, ...), grouped key/value heads
(SDPA's ``enable_gqa``), a causal ``sliding_window`` within each row (Mistral, Qwen2's sliding layers), an attention
``softcap`` (Gemma 2; one row at a time on the math backend), attention dropout in training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft.nn import packed_attention

__all__ = ["PACKED_SDPA", "packed_forward", "register_packed_sdpa"]

PACKED_SDPA = "lightning_peft_packed_sdpa"  # the name registered with AttentionInterface and AttentionMaskInterface
_PACKED_CALL: ContextVar[bool] = ContextVar("lightning_peft_packed_call", default=False)
# keywords that change the attention arithmetic in ways packed_attention does not implement
_UNSUPPORTED = ("s_aux", "position_bias")


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """Inside: a model whose implementation is `PACKED_SDPA` builds no attention mask (its caller passes the rows'
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` instead)."""
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


def _packed_sdpa_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' ``sdpa_mask``, or no mask at all inside `packed_forward`."""
    if _PACKED_CALL.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _packed_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query`` (B, H, L, D), ``key``/``value`` (B, Hkv, L, D) ->
    ``(out (B, L, H, D), None)``; packed rows when ``cu_seq_lens_q`` is given, transformers' sdpa otherwise.

    Raises:
        ValueError: If the packed call has more than one row, different query and key boundaries, or a keyword whose
            arithmetic packed attention lacks (attention sinks, a position bias).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    same_bounds = cu_k is None or cu_k is cu_q or torch.equal(cu_k, cu_q)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or not same_bounds or unsupported:
        raise ValueError(
            f"{PACKED_SDPA} on {type(module).__name__}: packed rows (cu_seq_lens_q) need one (1, T) row of queries "
            f"and keys with the same boundaries and plain attention; got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, cu_seq_lens_k {'equal to' if same_bounds else 'different from'} cu_seq_lens_q, "
            f"keywords {unsupported or 'none'} unsupported. Run this model with attn_implementation='sdpa' or "
            "'eager' (transformers' block-diagonal mask).")
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    out = packed_attention(query, key, value, cu_q, causal=causal, dropout_p=dropout, scale=scaling,
                           window=kwargs.get("sliding_window") if causal else None,
                           softcap=kwargs.get("softcap"))  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None  # (1, T, H, D)


def register_packed_sdpa() -> str:
    """Registers `PACKED_SDPA` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)
    and returns the name, for ``from_pretrained(attn_implementation=...)`` or ``set_attn_implementation``."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, _packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)
    return PACKED_SDPA
