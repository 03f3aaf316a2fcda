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

| tensor | shape | notes |
| --- | --- | --- |
| input_ids | (B, L) | long |
| attention_mask | (B, L) | 1 / True = real token |
| block input / output | (B, L, H) | H = hidden_size |
| encoder output | (B, L, H) | last hidden states (pruned tokens: see below) |
| decoder output | (B, L, V) | logits, V = vocab_size |

Token pruning. With a `TokenPruner`, a layer whose keep ratio is below 1 computes the attention each token
receives, keeps the most important tokens (never the first, never padding before a real token) and runs its
feed-forward and every later layer on those alone. A dropped token's output is the hidden state it had when it was
dropped, so the encoder output keeps its ``(B, L, H)`` shape.

Where each piece lives (every name stays importable from here): `lightning_peft.nn.feed_forward` (`FeedForward`,
`RMSNorm`), `lightning_peft.nn.block` (`TransformerBlock`), `lightning_peft.nn.encoder` (`TransformerEncoder`),
`lightning_peft.nn.decoder` (`TransformerDecoder`), `lightning_peft.nn.hf_weights` (reading Hugging Face
checkpoints), `lightning_peft.nn.moe` (`moe_layers`, `moe_aux_loss`).

Examples:
    >>> import torch
    >>> decoder = TransformerDecoder(vocab_size=20, hidden_size=8, num_layers=2, num_heads=2,
    ...                              moe={"num_experts": 2, "top_k": 1})
    >>> decoder(torch.tensor([[1, 2, 3]])).shape, list(moe_layers(decoder)), moe_aux_loss(decoder).shape
    (torch.Size([1, 3, 20]), ['layers.0.mlp', 'layers.1.mlp'], torch.Size([]))
"""

from __future__ import annotations

from lightning_peft.nn.block import TransformerBlock
from lightning_peft.nn.decoder import TransformerDecoder
from lightning_peft.nn.encoder import TransformerEncoder
from lightning_peft.nn.feed_forward import FeedForward, RMSNorm
from lightning_peft.nn.moe import moe_aux_loss, moe_layers

__all__ = [
    "FeedForward", "RMSNorm", "TransformerBlock", "TransformerDecoder", "TransformerEncoder", "moe_aux_loss",
    "moe_layers",
]
