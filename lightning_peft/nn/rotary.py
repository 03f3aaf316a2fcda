"""Rotary position embeddings in the RoFormer / Llama "rotate_half" convention.

Paper: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.

Rule. For a head of even size ``D`` and position ``p``:

    inv_freq[i] = 1 / base^(2i / D),  i = 0 .. D/2 - 1
    angles = cat([p * inv_freq, p * inv_freq])                     (D,)
    rotary(x) = x * cos(angles) + rotate_half(x) * sin(angles),    rotate_half(x) = cat([-x[D/2:], x[:D/2]])

Scaled frequencies (``scaling``), computed once at construction as transformers' ``ROPE_INIT_FUNCTIONS`` do:

    linear (Chen et al. 2023, "Extending Context Window of Large Language Models via Positional Interpolation",
    arXiv:2306.15595):   inv_freq / factor
    llama3 (Llama 3.1; Grattafiori et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783): with
    wavelen = 2 pi / inv_freq and the original context C,
        wavelen < C / high_freq_factor:  inv_freq                       (high frequencies kept)
        wavelen > C / low_freq_factor:   inv_freq / factor              (low frequencies interpolated)
        otherwise, s = (C / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor):
                                         (1 - s) inv_freq / factor + s inv_freq

Shapes: ``position_ids`` (B, L) long; ``cos``, ``sin`` (B, 1, L, D); ``x`` (B, H, L, D).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_peft._checks import integer, positive

__all__ = ["ROPE_SCALINGS", "RotaryEmbedding", "apply_rotary", "scale_inv_freq"]

# rope_type -> the keys its scaling dict needs (transformers' names, as in a config's rope_parameters).
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class RotaryEmbedding(nn.Module):
    """Rotary position tables in the RoFormer / Llama "rotate_half" convention.

    ``inv_freq[i] = 1 / base^(2i / D)`` (a non-persistent float32 buffer); for position ``p`` the angles are
    ``p * inv_freq`` repeated twice along the head dimension, so ``cos`` and ``sin`` are (B, 1, L, D).

    Args:
        head_dim: D, even.
        base: The frequency base (Llama's ``rope_theta``).
        scaling: Frequency scaling as a config's ``rope_parameters`` / ``rope_scaling`` gives it: ``rope_type``
            ``"default"``, ``"linear"`` (``factor``) or ``"llama3"`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``); other keys (``rope_theta``) are ignored.
            ``None``: unscaled.

    Examples:
        >>> rope = RotaryEmbedding(8)
        >>> cos, sin = rope(torch.arange(5)[None], torch.float32)
        >>> cos.shape, cos[0, 0, 0].tolist() == [1.0] * 8
        (torch.Size([1, 1, 5, 8]), True)
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        integer("RotaryEmbedding", "head_dim", head_dim, minimum=2, example="64")
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding(head_dim={head_dim!r}): head_dim must be even (the rotation turns "
                             "pairs of dimensions), e.g. 64.")
        positive("RotaryEmbedding", "base", base, example="10000.0")
        self.head_dim = head_dim
        self.base = float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (D / 2,)
        self.scaling = None if scaling is None else dict(scaling)
        self.register_buffer("inv_freq", scale_inv_freq(inv_freq, scaling, "RotaryEmbedding"), persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each (B, 1, L, head_dim) in ``dtype``, for integer ``position_ids`` (B, L)."""
        if position_ids.dim() != 2:
            raise ValueError("RotaryEmbedding: position_ids must be (batch, length), got "
                             f"{tuple(position_ids.shape)}.")
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device, torch.float)  # (B, L, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}" + (f", scaling={self.scaling}" if self.scaling else "")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The ``rope_type`` of a scaling dict (``type`` in configs written before transformers 4.45); ``"default"``
    for None."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def scale_inv_freq(inv_freq: Tensor, scaling: dict[str, Any] | None, who: str) -> Tensor:
    """``inv_freq`` (D / 2,) float32 scaled as ``scaling`` asks (the rules in the module docstring).

    Raises:
        ValueError: If the rope type is not one of `ROPE_SCALINGS`, or a key it needs is missing or not positive.

    Examples:
        >>> inv_freq = torch.tensor([1.0, 0.1, 0.001])
        >>> scale_inv_freq(inv_freq, {"rope_type": "linear", "factor": 2.0}, "x").tolist()
        [0.5, 0.05000000074505806, 0.0005000000237487257]
    """
    kind = rope_type(scaling)
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"{who}(scaling={scaling!r}): rope_type {kind!r} is not implemented; implemented: "
            f"{', '.join(map(repr, ROPE_SCALINGS))} (dynamic, yarn and longrope change the frequencies with the "
            "sequence length or need attention factors this rotary table does not apply)."
        )
    for key in ROPE_SCALINGS[kind]:
        if key not in scaling:
            raise ValueError(f"{who}(scaling={scaling!r}): rope_type {kind!r} needs {key!r} "
                             f"(all of {', '.join(ROPE_SCALINGS[kind])}).")
        positive(who, f"scaling[{key!r}]", scaling[key])
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1's scaling in transformers' ``_compute_llama3_parameters`` order of operations (same rounding)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    if high <= low:
        raise ValueError(f"RotaryEmbedding(scaling={scaling!r}): llama3 needs high_freq_factor > low_freq_factor "
                         "(it interpolates between the two wavelengths), e.g. 4.0 and 1.0.")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


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

