"""The pieces of a transformer block below attention: the dense feed-forward and the normalisations.

Papers: Vaswani et al. 2017, "Attention Is All You Need" (the feed-forward); Shazeer 2020, "GLU Variants Improve
Transformer" (arXiv:2002.05202: the gated SwiGLU feed-forward); Zhang and Sennrich 2019, "Root Mean Square Layer
Normalization" (arXiv:1910.07467).

Rule:

    mlp(x) = down(act(up(x)))  or, gated (SwiGLU), down(act(gate(x)) * up(x))
    rmsnorm(x) = (offset + weight) * x / sqrt(mean(x^2) + eps)     offset 0 (Llama) or 1 (Gemma)

Shapes: input and output ``(..., H)``; ``up`` and ``gate`` map ``H -> ffn_size``, ``down`` maps back.

`FeedForward` is the dense feed-forward of `lightning_peft.nn.TransformerBlock` and the expert of
`lightning_peft.nn.MoE`; both import it from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_peft._checks import choice

__all__ = ["ACTIVATIONS", "NORMS", "FeedForward", "RMSNorm", "norm_layer"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang and Sennrich 2019), computed in float32 as Llama does.

    ``y = (offset + weight) * x / sqrt(mean(x^2) + eps)``; input ``(..., H)``, output the input's dtype. With
    ``offset=0`` (Llama) the normalised ``x`` is cast back before the weight multiplies it; with ``offset != 0``
    (Gemma stores ``weight - 1``) the product is taken in float32 and then cast, as Gemma does. The weight starts at
    ``1 - offset``, so a fresh norm scales by 1 either way.

    Examples:
        >>> norm = RMSNorm(4)
        >>> norm(torch.tensor([[3.0, -3.0, 3.0, -3.0]])).round(decimals=4).tolist()
        [[1.0, -1.0, 1.0, -1.0]]
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset))
        self.eps = eps
        self.offset = float(offset)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


class FeedForward(nn.Module):
    """The dense feed-forward of a block: ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated.

    Examples:
        >>> mlp = FeedForward(8, 32, activation="silu", gated=True, bias=False)
        >>> mlp(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self, hidden_size: int, ffn_size: int, activation: str = "gelu", gated: bool = False, bias: bool = True
    ) -> None:
        super().__init__()
        choice("FeedForward", "activation", activation, ACTIVATIONS)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.activation = activation
        self._act = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:  # (B, L, H) -> (B, L, H)
        if self.gate_proj is None:
            return self.down_proj(self._act(self.up_proj(x)))
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


def norm_layer(kind: str, hidden_size: int, eps: float, offset: float = 0.0) -> nn.Module:
    """``nn.LayerNorm`` for ``"layernorm"``, `RMSNorm` (with ``offset``) for ``"rmsnorm"`` (``kind`` checked by
    the caller; an offset on a LayerNorm is refused).

    Examples:
        >>> norm_layer("rmsnorm", 8, 1e-6)
        RMSNorm(8, eps=1e-06)
    """
    if kind == "layernorm":
        if offset:
            raise ValueError(f"norm_layer(kind='layernorm', offset={offset!r}): the weight offset is for RMSNorm "
                             "(Gemma's 1 + weight); use norm='rmsnorm' or offset=0.")
        return nn.LayerNorm(hidden_size, eps=eps)
    return RMSNorm(hidden_size, eps=eps, offset=offset)
