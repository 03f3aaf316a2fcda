"""`KVCache`: the keys and values a causal decoder has computed, kept so that each new token costs one position.

Paper: the incremental decoding of Vaswani et al. 2017, "Attention Is All You Need" (arXiv:1706.03762); Pope et
al. 2022, "Efficiently Scaling Transformer Inference" (arXiv:2211.05102) on why decoding is bound by reading this
cache.

Rule. A causal layer's keys and values at positions ``< t`` do not depend on the tokens at ``>= t``, so they are
computed once and reused:

    prefill:  K[:, :, 0:L] = k(prompt)           attention of the L prompt queries over keys 0..L-1
    step t:   K[:, :, t]   = k(token t)          attention of 1 query over keys 0..t

Shapes: one buffer pair per layer, ``keys`` and ``values`` ``(B, Hkv, max_length, D)``, preallocated on the layer's
first call in the dtype and on the device of its keys (one allocation per generation, no copy of the past per
step); ``update`` returns the filled prefix ``(B, Hkv, length, D)``, a view. ``reorder`` picks rows of the batch
(beam search: each beam continues from its parent, `lightning_peft.nn.beam_search`).

The cache is for inference: a forward that would need gradients through it is refused (the buffers are written in
place, which autograd cannot differentiate through once a later step overwrites them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_peft._checks import integer

__all__ = ["KVCache", "LayerKVCache"]


class LayerKVCache:
    """One layer's preallocated keys and values; `update` appends and returns everything cached so far.

    Args:
        max_length: Tokens the buffers hold.
        index: The layer's index (named in errors).
    """

    def __init__(self, max_length: int, index: int) -> None:
        self.max_length, self.index = max_length, index
        self.keys: Tensor | None = None  # (B, Hkv, max_length, D)
        self.values: Tensor | None = None
        self.length = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k``, ``v`` ``(B, Hkv, L, D)`` after the cached tokens; return keys and values ``(B, Hkv,
        length + L, D)`` of every token so far.

        Raises:
            RuntimeError: If gradients are on for ``k`` or ``v`` (the cache is for inference).
            ValueError: If the tokens overflow ``max_length`` or the shape differs from the first call's.
        """
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError("KVCache: the keys and values require grad; the cache writes them in place, which "
                               "autograd cannot differentiate. Decode under torch.no_grad() (or torch.inference_mode()"
                               "), or run the forward without kv_cache for training.")
        batch, heads, length, head_dim = k.shape
        if self.keys is None:
            self.keys = k.new_empty(batch, heads, self.max_length, head_dim)
            self.values = v.new_empty(batch, heads, self.max_length, v.shape[-1])
        elif (batch, heads, head_dim) != (held := (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])):
            raise ValueError(f"KVCache: layer {self.index} holds keys of (batch, kv_heads, head_dim) = {held}, got "
                             f"{(batch, heads, head_dim)}; use one cache per batch (a new KVCache for a new batch).")
        end = self.length + length
        if end > self.max_length:
            raise ValueError(f"KVCache(max_length={self.max_length}): layer {self.index} holds {self.length} tokens "
                             f"and got {length} more; build the cache with max_length >= prompt + new tokens.")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reorder(self, indices: Tensor) -> None:
        """Keep the cached sequences ``indices`` ``(N,)`` (long, on the buffers' device), in that order: row ``i``
        becomes old row ``indices[i]`` (beam search: each beam continues from its parent; ``N`` may differ from the
        batch, to expand each prompt to its beams)."""
        if self.keys is None:
            return
        if indices.shape[0] == self.keys.shape[0]:  # in place: the same buffers, only the filled prefix copied
            self.keys[:, :, : self.length] = self.keys[:, :, : self.length].index_select(0, indices)
            self.values[:, :, : self.length] = self.values[:, :, : self.length].index_select(0, indices)
        else:
            self.keys, self.values = self.keys.index_select(0, indices), self.values.index_select(0, indices)


class KVCache:
    """Keys and values of every attention layer of a decoder, for incremental decoding.

    Pass one to `TransformerDecoder.forward(..., kv_cache=cache)`: the call attends over the cached tokens and the
    new ones, then appends the new ones' keys and values. Layer ``i`` uses ``cache.layer(i)``; the buffers are
    allocated on each layer's first call, so the cache needs to know only how many tokens it will hold.

    Args:
        max_length: Tokens it holds: the (padded) prompt length plus the tokens to generate.

    Examples:
        >>> from lightning_peft.nn import TransformerDecoder
        >>> decoder = TransformerDecoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4).eval()
        >>> ids = torch.tensor([[1, 5, 7, 9]])
        >>> cache = KVCache(max_length=4)
        >>> with torch.no_grad():
        ...     prefix = decoder(ids[:, :3], kv_cache=cache)  # prefill: 3 tokens
        ...     last = decoder(ids[:, 3:], kv_cache=cache)  # one step: 1 token over 4 keys
        ...     whole = decoder(ids)
        >>> cache.length, torch.allclose(last[:, -1], whole[:, -1], atol=1e-6)
        (4, True)
    """

    def __init__(self, max_length: int) -> None:
        self.max_length = integer("KVCache", "max_length", max_length, minimum=1, example="512",
                                  meaning="prompt tokens plus new tokens")
        self.layers: list[LayerKVCache] = []

    @property
    def length(self) -> int:
        """Tokens cached so far (the first layer's count; every layer holds as many after a forward)."""
        return self.layers[0].length if self.layers else 0

    def layer(self, index: int) -> LayerKVCache:
        """Layer ``index``'s cache (created on first use)."""
        while len(self.layers) <= index:
            self.layers.append(LayerKVCache(self.max_length, len(self.layers)))
        return self.layers[index]

    def reorder(self, indices: Tensor) -> None:
        """Every layer's cached sequences ``indices`` ``(N,)``, in that order (`LayerKVCache.reorder`); one
        ``index_select`` on the batch dimension per buffer, as transformers' ``Cache.reorder_cache`` for beams."""
        for layer in self.layers:
            layer.reorder(indices)

    def __repr__(self) -> str:
        return f"KVCache(max_length={self.max_length}, length={self.length}, layers={len(self.layers)})"
