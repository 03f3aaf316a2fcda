"""`TransformerDecoder`: a Llama-layout causal decoder built from `TransformerBlock`, which loads Llama checkpoints.

Papers: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" (arXiv:2302.13971): pre-norm
RMSNorm blocks, rotary positions, a SwiGLU feed-forward, no biases; Touvron et al. 2023, "Llama 2"
(arXiv:2307.09288): grouped-query attention.

Rule:

    x = embed_tokens[ids]
    x = block_i(x, key_padding_mask, position_ids)   causal, pre-norm, for each layer
    logits = lm_head(RMSNorm(x))                      lm_head tied to embed_tokens if asked

Shapes: ``input_ids`` and ``attention_mask`` (1 / True = real token) ``(B, L)``; output ``(B, L, V)`` logits,
``V = vocab_size``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from lightning_peft._checks import integer
from lightning_peft.nn._stack import check_reversible, feed_forwards, init_weights, key_padding_mask, run_reversible
from lightning_peft.nn.block import TransformerBlock
from lightning_peft.nn.feed_forward import FeedForward, RMSNorm
from lightning_peft.nn.hf_weights import llama_options, load_llama_weights
from lightning_peft.nn.kv_cache import KVCache

__all__ = ["TransformerDecoder"]


class TransformerDecoder(nn.Module):
    """A Llama-layout causal decoder built from `TransformerBlock`; loads Llama checkpoints.

    Pre-norm RMSNorm blocks with rotary positions, grouped-query attention and a SwiGLU feed-forward, a final
    norm and a language-model head (tied to the embeddings if asked).

    Args:
        vocab_size: Number of token ids.
        hidden_size: Width of the hidden states.
        num_layers: Number of blocks.
        num_heads: Attention heads (query heads).
        num_kv_heads: Key/value heads; ``None`` = ``num_heads``.
        ffn_size: Feed-forward width; ``None`` = Llama's ``8/3 * hidden`` rounded up to a multiple of 64.
        max_position_embeddings: Longest sequence accepted.
        rope_theta: Rotary base.
        norm_eps: RMSNorm epsilon.
        tie_word_embeddings: Share the embedding matrix with the head.
        bias: Biases on the attention projections (Llama's ``attention_bias``).
        mlp_bias: Biases on the feed-forward.
        dropout: Hidden dropout (Llama uses none).
        attention_dropout: Dropout on the attention probabilities (Llama uses none).
        backend: Attention backend.
        head_dim: Per-head width; ``None`` = ``hidden_size // num_heads``.
        initializer_range: Std of the normal initialisation.
        moe: Options of `lightning_peft.nn.MoE`: every layer's feed-forward becomes a mixture of ``ffn_size``-wide
            SwiGLU experts.
        reversible: Run the layers as reversible couplings on two copies of the hidden state (see
            `TransformerEncoder`).

    Examples:
        >>> import torch
        >>> decoder = TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> decoder(torch.tensor([[1, 5, 7]])).shape
        torch.Size([1, 3, 50])
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        ffn_size: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        bias: bool = False,
        mlp_bias: bool = False,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        backend: str = "auto",
        head_dim: int | None = None,
        initializer_range: float = 0.02,
        moe: dict[str, Any] | None = None,
        reversible: bool = False,
    ) -> None:
        super().__init__()
        check_reversible("TransformerDecoder", reversible, True, moe)
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_layers", num_layers),
                            ("max_position_embeddings", max_position_embeddings)):
            integer("TransformerDecoder", name, value, minimum=1)
        if ffn_size is None:
            ffn_size = 64 * math.ceil(8 * hidden_size / 3 / 64)
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "ffn_size": ffn_size, "max_position_embeddings": max_position_embeddings,
            "rope_theta": rope_theta, "norm_eps": norm_eps, "tie_word_embeddings": tie_word_embeddings,
            "bias": bias, "mlp_bias": mlp_bias, "dropout": dropout, "attention_dropout": attention_dropout,
            "backend": backend, "head_dim": head_dim, "moe": moe, "reversible": reversible,
        }
        self.max_position_embeddings = max_position_embeddings
        self.reversible = reversible
        layer_feed_forwards = feed_forwards(
            moe, num_layers, hidden_size, ffn_size, {"activation": "silu", "gated": True, "bias": mlp_bias},
            "TransformerDecoder",
        )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, num_heads, ffn_size, num_kv_heads=num_kv_heads, causal=True, norm_first=True,
                norm="rmsnorm", activation="silu", gated=True, dropout=dropout, attention_dropout=attention_dropout,
                rotary=True, rope_theta=rope_theta, bias=bias, norm_eps=norm_eps, backend=backend, head_dim=head_dim,
                feed_forward=feed_forward if feed_forward is not None else FeedForward(
                    hidden_size, ffn_size, activation="silu", gated=True, bias=mlp_bias
                ),
            )
            for feed_forward in layer_feed_forwards
        )
        self.norm = RMSNorm(hidden_size, eps=norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        init_weights(self, initializer_range)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Logits ``(B, L, V)`` of ``input_ids`` ``(B, L)``; ``attention_mask`` marks real tokens (1).

        With ``kv_cache`` (a `lightning_peft.nn.KVCache`, incremental decoding under ``torch.no_grad()``),
        ``input_ids`` are the tokens after the cached ones, ``attention_mask`` covers the cached and the new tokens
        ``(B, cached + L)``, ``position_ids`` default to ``cached + 0..L-1``, and the new tokens' keys and values
        are appended to the cache.
        """
        return self.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, kv_cache))

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """The final-norm hidden states ``(B, L, H)`` that ``lm_head`` turns into logits (for a loss that applies
        the head itself, such as `lightning_peft.nn.chunked_cross_entropy`); ``kv_cache`` as in `forward`."""
        if kv_cache is not None:
            return self._cached_hidden_states(input_ids, attention_mask, position_ids, kv_cache)
        if input_ids.shape[1] > self.max_position_embeddings:
            raise ValueError(
                f"TransformerDecoder: input of {input_ids.shape[1]} tokens exceeds max_position_embeddings="
                f"{self.max_position_embeddings}; truncate the input or raise the limit."
            )
        mask = key_padding_mask(attention_mask, input_ids, "TransformerDecoder")
        x = self.embed_tokens(input_ids)
        if self.reversible:
            x = run_reversible(self.layers, x, key_padding_mask=mask, position_ids=position_ids)
        else:
            for layer in self.layers:
                x = layer(x, key_padding_mask=mask, position_ids=position_ids)
        return self.norm(x)

    # ---- incremental decoding (kv_cache): its own path, so the training forward above runs exactly as before ----

    def _cached_hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None, kv_cache: KVCache
    ) -> Tensor:
        past = kv_cache.length
        if past + input_ids.shape[1] > self.max_position_embeddings:
            raise ValueError(
                f"TransformerDecoder: {past} cached tokens and {input_ids.shape[1]} new ones exceed "
                f"max_position_embeddings={self.max_position_embeddings}; generate fewer tokens or raise the limit."
            )
        mask = key_padding_mask(attention_mask, input_ids, "TransformerDecoder", past)
        x = self.embed_tokens(input_ids)
        if not self.reversible:
            for index, layer in enumerate(self.layers):
                x = layer(x, key_padding_mask=mask, position_ids=position_ids, kv_cache=kv_cache.layer(index))
            return self.norm(x)
        # The reversible couplings y1 = x1 + F(x2), y2 = x2 + G(y1) of `run_reversible`, run plainly: the cache is
        # inference-only, so there is no backward to save memory for, and each F needs its own layer's cache.
        x1 = x2 = x
        for index, layer in enumerate(self.layers):
            delta = layer.attention_branch(x2, mask, position_ids, kv_cache=kv_cache.layer(index))[0]
            x1 = x1 + layer.dropout(delta)
            x2 = x2 + layer.dropout(layer.feed_forward_branch(x1))
        return self.norm((x1 + x2) / 2)

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> TransformerDecoder:
        """Loads a Llama-style Hugging Face checkpoint directory (``model_type`` ``llama``).

        Args:
            path: A directory with ``config.json`` and weights (sharded or not), or an installed model package.
            **overrides: Constructor arguments that do not change the architecture (``dropout``, ``backend``).

        Raises:
            ValueError: If the directory or its config is missing, the model type is not Llama, the rotary scaling
                is one this decoder does not implement, or a weight does not fit (first key and shapes named).
        """
        directory, options = llama_options(path, overrides)
        model = cls(**options)
        load_llama_weights(model, directory, path)
        return model
