"""Blocks: attention (flash-attn on CUDA, SDPA otherwise), transformer blocks, encoder and decoder, token pruning,
mixture of experts, reversible layers, activation checkpointing of chosen blocks, the chunked language-model loss,
generation with a key/value cache (greedy, sampled, beam search).

Pure PyTorch: nothing here imports Lightning. See `lightning_peft.nn.attention`, `lightning_peft.nn.transformer`,
`lightning_peft.nn.token_pruning`, `lightning_peft.nn.moe`, `lightning_peft.nn.reversible`,
`lightning_peft.nn.checkpointing`, `lightning_peft.nn.chunked_loss`, `lightning_peft.nn.kv_cache`,
`lightning_peft.nn.generation` and `lightning_peft.nn.beam_search`.
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
from lightning_peft.nn.checkpointing import (
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
)
from lightning_peft.nn.chunked_loss import chunked_cross_entropy
from lightning_peft.nn.generation import filter_logits, generate
from lightning_peft.nn.kv_cache import KVCache
from lightning_peft.nn.moe import MoE
from lightning_peft.nn.reversible import ReversibleSequence
from lightning_peft.nn.token_pruning import TokenPruner
from lightning_peft.nn.transformer import (
    FeedForward,
    RMSNorm,
    TransformerBlock,
    TransformerDecoder,
    TransformerEncoder,
    moe_aux_loss,
    moe_layers,
)

__all__ = [
    "BACKENDS",
    "FeedForward",
    "FlashAttention",
    "KVCache",
    "MoE",
    "RMSNorm",
    "ReversibleSequence",
    "RotaryEmbedding",
    "TokenPruner",
    "TransformerBlock",
    "TransformerDecoder",
    "TransformerEncoder",
    "apply_activation_checkpointing",
    "apply_rotary",
    "attention",
    "attention_received",
    "checkpointed_modules",
    "chunked_cross_entropy",
    "filter_logits",
    "flash_attn_available",
    "generate",
    "moe_aux_loss",
    "moe_layers",
    "packed_attention",
    "remove_activation_checkpointing",
    "select_backend",
]
