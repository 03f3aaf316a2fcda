"""`TransformerDecoder`: a Llama-layout causal decoder built from `TransformerBlock`, which loads Llama, Qwen2,
Qwen3, Mistral, Gemma, Gemma 2 and Gemma 3 (text) checkpoints.

Papers: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" (arXiv:2302.13971): pre-norm
RMSNorm blocks, rotary positions, a SwiGLU feed-forward, no biases; Touvron et al. 2023, "Llama 2"
(arXiv:2307.09288): grouped-query attention. The families' differences are constructor options (defaults: Llama):
Qwen2's q/k/v biases (``qkv_bias``), Mistral's sliding window (``sliding_window``, Jiang et al. 2023, "Mistral 7B",
arXiv:2310.06825), Gemma's ``(1 + weight)`` RMSNorm, ``sqrt(hidden)`` embedding scale and GELU-tanh feed-forward
(``norm_offset``, ``embedding_scale``, ``activation``; Gemma Team 2024, arXiv:2403.08295), Llama 3.1's rotary
scaling (``rope_scaling``), Qwen3's and Gemma 3's per-head q/k RMSNorm (``qk_norm``; Qwen Team 2025, "Qwen3
Technical Report", arXiv:2505.09388), Gemma 2's soft-capped attention and output logits, query scale and
sandwich norms (``attn_logit_softcapping``, ``final_logit_softcapping``, ``attention_scale``, ``sandwich_norm``;
Gemma Team 2024, arXiv:2408.00118), Gemma 3's rotary base on its sliding-window layers (``sliding_rope_theta``;
Gemma Team 2025, arXiv:2503.19786).

Rule:

    x = embed_tokens[ids] * embedding_scale
    x = block_i(x, key_padding_mask, position_ids)   causal, pre-norm, for each layer (cu_seqlens: per sequence)
    logits = lm_head(RMSNorm(x))                      lm_head tied to embed_tokens if asked
    logits = cap * tanh(logits / cap)                 cap = final_logit_softcapping, if set (Gemma 2)

Shapes: ``input_ids`` and ``attention_mask`` (1 / True = real token) ``(B, L)``; output ``(B, L, V)`` logits,
``V = vocab_size``; packed: ``input_ids`` ``(1, T)``, ``cu_seqlens`` ``(N + 1,)`` int (0, l0, l0 + l1, ..., T).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft._checks import integer
from lightning_peft.nn._stack import (
    check_packed,
    check_reversible,
    feed_forwards,
    init_weights,
    key_padding_mask,
    run_reversible,
)
from lightning_peft.nn.block import TransformerBlock
from lightning_peft.nn.feed_forward import FeedForward, RMSNorm
from lightning_peft.nn.hf_families import decoder_options, load_decoder_weights
from lightning_peft.nn.kv_cache import KVCache

__all__ = ["ScaledEmbedding", "TransformerDecoder"]


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose rows are multiplied by ``scale`` (Gemma: ``sqrt(hidden_size)``).

    The scale is cast to the weight's dtype before the product, as transformers' Gemma does, so a bfloat16 model
    rounds it the same way.

    Examples:
        >>> embed = ScaledEmbedding(10, 4, scale=2.0)
        >>> torch.equal(embed(torch.tensor([3])), 2.0 * embed.weight[3:4])
        True
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: Tensor) -> Tensor:  # (B, L) -> (B, L, H)
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"


class TransformerDecoder(nn.Module):
    """A Llama-layout causal decoder built from `TransformerBlock`; loads Llama, Qwen2, Mistral and Gemma checkpoints.

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
        activation: Of the gated feed-forward: ``"silu"`` (SwiGLU, Llama) or ``"gelu_tanh"`` (GeGLU, Gemma), or
            another of `lightning_peft.nn.FeedForward`'s.
        qkv_bias: Biases on q/k/v only, ``bias`` then covering ``o_proj`` (Qwen2: ``bias=False, qkv_bias=True``);
            ``None`` = ``bias``.
        rope_scaling: Rotary frequency scaling, as a config's ``rope_parameters``: ``{"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings":
            8192}`` (Llama 3.1) or ``{"rope_type": "linear", "factor": 2.0}``; ``None``: unscaled.
        sliding_window: Causal attention over the last ``sliding_window`` positions only (Mistral); ``None``: all.
        sliding_window_layers: The layer indices that use the window (Qwen2's ``layer_types``); ``None``: every
            layer.
        norm_offset: The RMSNorms compute ``(norm_offset + weight) * x_normalised`` (Gemma: 1.0).
        embedding_scale: Multiplies the token embeddings (Gemma: ``sqrt(hidden_size)``); ``None``: 1.
        qk_norm: An RMSNorm over each head's queries and keys before rotary (Qwen3, Gemma 3).
        attention_scale: The attention score scale (Gemma 2 and 3: ``query_pre_attn_scalar ** -0.5``); ``None``:
            ``1 / sqrt(head_dim)``.
        attn_logit_softcapping: Attention scores become ``c * tanh(scores / c)`` (Gemma 2: 50.0); SDPA cannot,
            so attention runs on flash-attn's ``softcap`` (CUDA) or the explicit ``"math"`` backend, whose memory
            grows with the square of the length. ``None``: plain scores.
        final_logit_softcapping: The logits become ``c * tanh(logits / c)`` (Gemma 2: 30.0); ``None``: plain.
        sandwich_norm: Each block also normalises its attention and feed-forward outputs before the residual sums
            (Gemma 2 and 3; see `TransformerBlock`).
        sliding_rope_theta: The rotary base of the sliding-window layers, which then take no ``rope_scaling``
            (Gemma 3's ``rope_local_base_freq``); ``None``: ``rope_theta`` everywhere.

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
        activation: str = "silu",
        qkv_bias: bool | None = None,
        rope_scaling: dict[str, Any] | None = None,
        sliding_window: int | None = None,
        sliding_window_layers: list[int] | None = None,
        norm_offset: float = 0.0,
        embedding_scale: float | None = None,
        qk_norm: bool = False,
        attention_scale: float | None = None,
        attn_logit_softcapping: float | None = None,
        final_logit_softcapping: float | None = None,
        sandwich_norm: bool = False,
        sliding_rope_theta: float | None = None,
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
            "backend": backend, "head_dim": head_dim, "moe": moe, "reversible": reversible, "activation": activation,
            "qkv_bias": qkv_bias, "rope_scaling": rope_scaling, "sliding_window": sliding_window,
            "sliding_window_layers": sliding_window_layers, "norm_offset": norm_offset,
            "embedding_scale": embedding_scale, "qk_norm": qk_norm, "attention_scale": attention_scale,
            "attn_logit_softcapping": attn_logit_softcapping, "final_logit_softcapping": final_logit_softcapping,
            "sandwich_norm": sandwich_norm, "sliding_rope_theta": sliding_rope_theta,
        }
        windows = _layer_windows(sliding_window, sliding_window_layers, num_layers)
        self.final_logit_softcapping = _positive_or_none("final_logit_softcapping", final_logit_softcapping)
        if _positive_or_none("sliding_rope_theta", sliding_rope_theta) is not None and sliding_window is None:
            raise ValueError(f"TransformerDecoder(sliding_rope_theta={sliding_rope_theta}, sliding_window=None): the "
                             "base is for the sliding-window layers, and there are none; set sliding_window (and "
                             "sliding_window_layers), or sliding_rope_theta=None.")
        self.max_position_embeddings = max_position_embeddings
        self.reversible = reversible
        layer_feed_forwards = feed_forwards(
            moe, num_layers, hidden_size, ffn_size, {"activation": activation, "gated": True, "bias": mlp_bias},
            "TransformerDecoder",
        )
        self.embed_tokens = (nn.Embedding(vocab_size, hidden_size) if embedding_scale is None
                             else ScaledEmbedding(vocab_size, hidden_size, embedding_scale))
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, num_heads, ffn_size, num_kv_heads=num_kv_heads, causal=True, norm_first=True,
                norm="rmsnorm", activation=activation, gated=True, dropout=dropout,
                attention_dropout=attention_dropout, bias=bias, norm_eps=norm_eps, backend=backend, head_dim=head_dim,
                qkv_bias=qkv_bias, sliding_window=window, norm_offset=norm_offset, qk_norm=qk_norm,
                attention_scale=attention_scale, softcap=attn_logit_softcapping, sandwich_norm=sandwich_norm,
                **_layer_rope(rope_theta, rope_scaling, sliding_rope_theta if window is not None else None),
                feed_forward=feed_forward if feed_forward is not None else FeedForward(
                    hidden_size, ffn_size, activation=activation, gated=True, bias=mlp_bias
                ),
            )
            for feed_forward, window in zip(layer_feed_forwards, windows)
        )
        self.norm = RMSNorm(hidden_size, eps=norm_eps, offset=norm_offset)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        init_weights(self, initializer_range)  # Linear and Embedding weights; the norms keep 1 - norm_offset
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None, kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Logits ``(B, L, V)`` of ``input_ids`` ``(B, L)``; ``attention_mask`` marks real tokens (1);
        ``cu_seqlens`` packs sequences into a batch of one (see `hidden_states`).

        With ``kv_cache`` (a `lightning_peft.nn.KVCache`, incremental decoding under ``torch.no_grad()``),
        ``input_ids`` are the tokens after the cached ones, ``attention_mask`` covers the cached and the new tokens
        ``(B, cached + L)``, ``position_ids`` default to ``cached + 0..L-1``, and the new tokens' keys and values
        are appended to the cache.
        """
        hidden = self.hidden_states(input_ids, attention_mask, position_ids, cu_seqlens=cu_seqlens, kv_cache=kv_cache)
        return self.cap_logits(self.lm_head(hidden))

    def cap_logits(self, logits: Tensor) -> Tensor:
        """What follows ``lm_head``: ``c * tanh(logits / c)`` with ``c = final_logit_softcapping`` (divide, tanh,
        multiply: transformers' Gemma 2 order), or the logits as they are without a cap."""
        if self.final_logit_softcapping is None:
            return logits
        return torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None, kv_cache: KVCache | None = None,
    ) -> Tensor:
        """The final-norm hidden states ``(B, L, H)`` that ``lm_head`` turns into logits (for a loss that applies
        the head itself, such as `lightning_peft.nn.chunked_cross_entropy`).

        A packed batch (``SFTDataModule(packing=True)``) is ``input_ids`` ``(1, T)`` with ``cu_seqlens``
        ``(N + 1,)``, the sequences' boundaries ``0, l0, l0 + l1, ..., T``, and no ``attention_mask``: attention
        stays inside each sequence (`lightning_peft.nn.packed_attention`) and rotary positions restart at 0 at
        each one unless ``position_ids`` say otherwise, so every sequence gets what it gets alone.

        ``kv_cache``: incremental decoding, as in `forward`.

        Raises:
            ValueError: If the input (a packed sequence, when packed) is longer than ``max_position_embeddings``, or
                ``cu_seqlens`` comes with an ``attention_mask``, a ``kv_cache``, a batch of more than one row, or
                boundaries that do not rise from 0 to ``T``.
        """
        if kv_cache is not None:
            if cu_seqlens is not None:
                raise ValueError("TransformerDecoder: cu_seqlens (packed training batches) and kv_cache (incremental "
                                 "decoding) do not go together; decode left-padded batches with attention_mask.")
            return self._cached_hidden_states(input_ids, attention_mask, position_ids, kv_cache)
        # -- packed sequences (cu_seqlens): checked once here, then passed to every layer's attention; positions
        # restart in each sequence, so the longest sequence, not the row, must fit max_position_embeddings
        longest = input_ids.shape[1] if cu_seqlens is None else check_packed(
            cu_seqlens, attention_mask, input_ids, "TransformerDecoder")
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        # --
        if longest > self.max_position_embeddings:
            raise ValueError(
                f"TransformerDecoder: {'input' if cu_seqlens is None else 'a packed sequence'} of {longest} tokens "
                f"exceeds max_position_embeddings={self.max_position_embeddings}; truncate the input or raise the "
                "limit."
            )
        mask = key_padding_mask(attention_mask, input_ids, "TransformerDecoder")
        x = self.embed_tokens(input_ids)
        if self.reversible:
            x = run_reversible(self.layers, x, key_padding_mask=mask, position_ids=position_ids, **packed)
        else:
            for layer in self.layers:
                x = layer(x, key_padding_mask=mask, position_ids=position_ids, **packed)
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
        tables = self._rotary_tables(input_ids, position_ids, past)
        if not self.reversible:
            for index, layer in enumerate(self.layers):
                x = layer(x, key_padding_mask=mask, position_ids=position_ids, kv_cache=kv_cache.layer(index),
                          rotary_tables=tables[index])
            return self.norm(x)
        # The reversible couplings y1 = x1 + F(x2), y2 = x2 + G(y1) of `run_reversible`, run plainly: the cache is
        # inference-only, so there is no backward to save memory for, and each F needs its own layer's cache.
        x1 = x2 = x
        for index, layer in enumerate(self.layers):
            delta = layer.attention_branch(x2, mask, position_ids, kv_cache=kv_cache.layer(index),
                                           rotary_tables=tables[index])[0]
            x1 = x1 + layer.dropout(delta)
            x2 = x2 + layer.dropout(layer.feed_forward_branch(x1))
        return self.norm((x1 + x2) / 2)

    def _rotary_tables(self, input_ids: Tensor, position_ids: Tensor | None,
                       past: int) -> list[tuple[Tensor, Tensor] | None]:
        """Each layer's rotary ``(cos, sin)`` float32 (B, 1, L, D), computed once per distinct rotary (base,
        scaling; Gemma 3 has two) rather than in every layer: what transformers computes once per forward. The
        positions default to ``past + 0..L-1``, as `FlashAttention` would take them."""
        batch, length = input_ids.shape
        if position_ids is not None and tuple(position_ids.shape) != (batch, length):
            return [None] * len(self.layers)  # each attention refuses the shape, naming it
        positions = position_ids if position_ids is not None else (
            torch.arange(past, past + length, device=input_ids.device).expand(batch, length))
        tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        layers: list[tuple[Tensor, Tensor] | None] = []
        for layer in self.layers:
            rotary = layer.attn.rotary
            if rotary is None:
                layers.append(None)
                continue
            key = (rotary.head_dim, rotary.base, repr(rotary.scaling))
            if key not in tables:
                tables[key] = rotary(positions, torch.float32)
            layers.append(tables[key])
        return layers

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> TransformerDecoder:
        """Loads a Hugging Face checkpoint directory of a family in `lightning_peft.nn.hf_families.FAMILIES`
        (``model_type`` ``llama``, ``qwen2``, ``mistral``, ``gemma``).

        Args:
            path: A directory with ``config.json`` and weights (sharded or not), or an installed model package.
            **overrides: Constructor arguments that do not change the architecture (``dropout``, ``backend``).

        The weights stay in the checkpoint file's private mapping where their dtype is the model's, as
        transformers keeps them (faster decoding: 2 MB pages; writes go to private copies, never to the file). So
        do not overwrite the checkpoint's weight files in place while the model is alive: a rewrite would show
        through pages not yet written, a truncation would crash on them. This package's own exports write a new
        file and rename it, which leaves the mapping alone.

        Raises:
            ValueError: If the directory or its config is missing, the model type is not one of the families, the
                config asks for something this decoder does not implement (a rotary scaling type, an activation, a
                per-layer pattern: each named), or a weight does not fit (first key and shapes named).
        """
        directory, family, options = decoder_options(path, overrides)
        model = cls(**options)
        load_decoder_weights(model, directory, path, family)
        return model


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"TransformerDecoder({name}={value!r}): {name} must be a positive number, or None.")
    return None if value is None else float(value)


def _layer_rope(theta: float, scaling: dict[str, Any] | None, sliding_theta: float | None) -> dict[str, Any]:
    """One layer's rotary arguments: the sliding-window layers' own base, unscaled, where one is given (Gemma 3)."""
    if sliding_theta is not None:
        return {"rotary": True, "rope_theta": sliding_theta, "rope_scaling": None}
    return {"rotary": True, "rope_theta": theta, "rope_scaling": scaling}


def _layer_windows(window: int | None, layers: list[int] | None, num_layers: int) -> list[int | None]:
    """The sliding window of each layer: ``window`` on ``layers`` (all when None), None elsewhere."""
    if layers is None:
        return [window] * num_layers
    if window is None:
        raise ValueError(f"TransformerDecoder(sliding_window_layers={layers!r}, sliding_window=None): the layers "
                         "need a window size; set sliding_window=..., or sliding_window_layers=None.")
    for index, layer in enumerate(layers):
        integer("TransformerDecoder", f"sliding_window_layers[{index}]", layer, minimum=0, maximum=num_layers - 1,
                of=("sliding_window_layers", layers))
    return [window if i in layers else None for i in range(num_layers)]
