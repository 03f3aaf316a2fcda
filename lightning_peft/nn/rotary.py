"""Rotary position embeddings in the RoFormer / Llama "rotate_half" convention.

Paper: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.

Rule. For a head of even size ``D`` and position ``p``:

    inv_freq[i] = 1 / base^(2i / D),  i = 0 .. D/2 - 1
    angles = cat([p * inv_freq, p * inv_freq])                     (D,)
    rotary(x) = x * cos(angles) + rotate_half(x) * sin(angles),    rotate_half(x) = cat([-x[D/2:], x[:D/2]])

Shapes: ``position_ids`` (B, L) long; ``cos``, ``sin`` (B, 1, L, D); ``x`` (B, H, L, D).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_peft._checks import integer, positive

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(nn.Module):
    """Rotary position tables in the RoFormer / Llama "rotate_half" convention.

    ``inv_freq[i] = 1 / base^(2i / D)`` (a non-persistent float32 buffer); for position ``p`` the angles are
    ``p * inv_freq`` repeated twice along the head dimension, so ``cos`` and ``sin`` are (B, 1, L, D).

    Args:
        head_dim: D, even.
        base: The frequency base (Llama's ``rope_theta``).

    Examples:
        >>> rope = RotaryEmbedding(8)
        >>> cos, sin = rope(torch.arange(5)[None], torch.float32)
        >>> cos.shape, cos[0, 0, 0].tolist() == [1.0] * 8
        (torch.Size([1, 1, 5, 8]), True)
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        integer("RotaryEmbedding", "head_dim", head_dim, minimum=2, example="64")
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding(head_dim={head_dim!r}): head_dim must be even (the rotation turns "
                             "pairs of dimensions), e.g. 64.")
        positive("RotaryEmbedding", "base", base, example="10000.0")
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

    Examples:
        >>> x = torch.randn(1, 2, 3, 4)
        >>> cos, sin = RotaryEmbedding(4)(torch.zeros(1, 3, dtype=torch.long))
        >>> torch.equal(apply_rotary(x, cos, sin), x)  # position 0: no rotation
        True
    """
    return x * cos + _rotate_half(x) * sin

