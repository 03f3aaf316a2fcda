"""The bottleneck adapter's modules: the adapter MLP and the wrapper that adds it after a base layer (see
`lightning_peft.peft.bottleneck.model` for the update rule and the shapes)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import LayerWrapper

NON_LINEARITIES: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,  # another name for SiLU
    "tanh": torch.tanh,
}


class Projection(nn.Module):
    """``x @ weight.T + bias``: a linear map that is deliberately not an ``nn.Linear`` (LoRA leaves it alone)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class Bottleneck(nn.Module):
    """The adapter MLP: ``dropout(W_up f(W_down h + b_down) + b_up)``, the update added to ``h``.

    Args:
        d: Input and output size.
        size: Bottleneck size ``m``.
        non_linearity: A key of `NON_LINEARITIES`.
        dropout: Dropout probability on the output.
        init_scale: Standard deviation of the truncated-normal initialisation of ``W_down``.
    """

    def __init__(self, d: int, size: int, non_linearity: str, dropout: float, init_scale: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.non_linearity = non_linearity
        self.down = Projection(d, size, device=device, dtype=dtype)  # W_down (m, d)
        self.up = Projection(size, d, device=device, dtype=dtype)  # W_up (d, m), zero: the start equals the base
        self.dropout = nn.Dropout(dropout)
        nn.init.trunc_normal_(self.down.weight, std=init_scale, a=-2 * init_scale, b=2 * init_scale)

    def forward(self, h: Tensor) -> Tensor:
        x = h.to(self.down.weight.dtype)  # a half-precision base feeds its float32 adapter
        z = NON_LINEARITIES[self.non_linearity](self.down(x))  # (..., m)
        return self.dropout(self.up(z))  # (..., d)

    def extra_repr(self) -> str:
        return f"non_linearity={self.non_linearity!r}"


class BottleneckLayer(LayerWrapper):
    """A module (``base_layer``, unchanged) followed by a residual [`Bottleneck`][lightning_peft.peft.Bottleneck]
    (``adapter``).

    Attributes the wrapper lacks (``weight``, ``out_features``, ``nf``, ...) are read from the base layer.
    Precision: the adapter of a float16/bfloat16 base is float32 and stays float32 when the model is cast to half
    precision afterwards; the update is added in the dtype of the base output, so a zero update leaves the base
    output bit-for-bit unchanged.
    """

    def __init__(self, base_layer: nn.Module, adapter: Bottleneck) -> None:
        super().__init__(base_layer)
        self.adapter = adapter

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        h = self.base_layer(*args, **kwargs)  # (..., d)
        return h + self.adapter(h).to(h.dtype)


def output_size(module: nn.Module) -> int | None:
    """The output size ``d`` of a Linear-like module (``out_features``, or ``Conv1D``'s ``nf``), else None."""
    for attr in ("out_features", "nf"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
