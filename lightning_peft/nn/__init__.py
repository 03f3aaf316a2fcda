"""Blocks: attention (flash-attn on CUDA, SDPA otherwise), transformer blocks, encoder and decoder, token pruning.

Pure PyTorch: nothing here imports Lightning. See `lightning_peft.nn.attention`, `lightning_peft.nn.transformer`
and `lightning_peft.nn.token_pruning`.
"""

from lightning_peft.nn.attention import (
    BACKENDS,
    FlashAttention,
    RotaryEmbedding,
    apply_rotary,
    attention,
    attention_received,
    flash_attn_available,
    packed_attention,
    select_backend,
)
from lightning_peft.nn.token_pruning import TokenPruner
from lightning_peft.nn.transformer import FeedForward, RMSNorm, TransformerBlock, TransformerDecoder, TransformerEncoder

__all__ = [
    "BACKENDS",
    "FeedForward",
    "FlashAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "TokenPruner",
    "TransformerBlock",
    "TransformerDecoder",
    "TransformerEncoder",
    "apply_rotary",
    "attention",
    "attention_received",
    "flash_attn_available",
    "packed_attention",
    "select_backend",
]
