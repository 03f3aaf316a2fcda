"""The VeRA layer and the shared projections (see `lightning_peft.peft.vera.model` for the technique).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are):

| tensor | shape | what |
| --- | --- | --- |
| ``vera_A`` | (r, in_max) | shared, frozen; a layer reads its first ``in`` columns |
| ``vera_B`` | (out_max, r) | shared, frozen; a layer reads its first ``out`` rows |
| ``vera_lambda_d`` | (r,) | per layer, trained: scales the ``r`` hidden features |
| ``vera_lambda_b`` | (out,) | per layer, trained: scales the output features |

``in_max`` / ``out_max`` are the largest input / output sizes among the targets. The base weight is ``nn.Linear``'s
(out, in) or transformers ``Conv1D``'s (in, out); the branch reads ``x`` the same way for both, only the merged
update is transposed for ``Conv1D``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._wrapping import AdditiveLayer, Switch, conv1d_type


def supported(module: nn.Module) -> bool:
    """Whether VeRA (PEFT's layers) can adapt ``module``: an ``nn.Linear`` or a transformers ``Conv1D``."""
    conv1d = conv1d_type()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def sizes(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a supported ``module`` (``Conv1D``'s weight is (in, out))."""
    out, inp = module.weight.shape if isinstance(module, nn.Linear) else module.weight.shape[::-1]
    return int(inp), int(out)


def draw_projections(rank: int, in_features: int, out_features: int, key: int) -> tuple[Tensor, Tensor]:
    """``vera_A`` (rank, in_features) and ``vera_B`` (out_features, rank), drawn as Hugging Face PEFT 0.21 draws them:
    one CPU generator seeded with ``key``, A first, each uniform in ``±sqrt(6 / fan_in)`` (Kaiming uniform, gain
    sqrt(2)), with ``fan_in`` its column count, in the default dtype (PEFT's ``torch.empty``)."""
    generator = torch.Generator(device="cpu").manual_seed(key)
    drawn = []
    for shape in ((rank, in_features), (out_features, rank)):
        std = math.sqrt(2) / math.sqrt(shape[1])  # PEFT's rounding: sqrt(3) * (gain / sqrt(fan_in))
        bound = math.sqrt(3.0) * std
        drawn.append(torch.empty(shape).uniform_(-bound, bound, generator=generator))
    return drawn[0], drawn[1]


class Projections(nn.Module):
    """The frozen random matrices every VeRA layer of one model shares, as buffers of one module (registered once, in
    the first layer, so that checkpoints and device moves hold them once). Being that layer's, they keep their dtype
    when the model is cast to half precision, as its vectors do (`LayerWrapper`): drawn in float32, they would round."""

    def __init__(self, vera_A: Tensor, vera_B: Tensor) -> None:
        super().__init__()
        self.register_buffer("vera_A", vera_A)  # (r, in_max)
        self.register_buffer("vera_B", vera_B)  # (out_max, r)

    def extra_repr(self) -> str:
        return f"rank={self.vera_A.shape[0]}, in_max={self.vera_A.shape[1]}, out_max={self.vera_B.shape[0]}"


class VeraLayer(AdditiveLayer):
    """``base_layer`` (frozen) plus ``lambda_b ⊙ (B[:out] (lambda_d ⊙ (A[:, :in] dropout(x))))``.

    Args:
        base_layer: An ``nn.Linear`` or transformers ``Conv1D``.
        projections: The model's shared `Projections` (held, not registered: the first layer registers them).
        dropout: Dropout probability on the branch's input.
        d_initial: The start value of ``vera_lambda_d`` (``vera_lambda_b`` starts at zero).
        init_weights: False: ``lambda_b = 1`` and a standard normal ``lambda_d`` instead.
        switch: The model's on/off switch (`disable_vera`); None: the layer's own.
    """

    def __init__(self, base_layer: nn.Module, projections: Projections, dropout: float = 0.0, d_initial: float = 0.1,
                 init_weights: bool = True, switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        object.__setattr__(self, "projections", projections)  # a plain reference: not a second copy in state dicts
        self.switch = switch or Switch()
        self.merged = False
        self.fan_in_fan_out = not isinstance(base_layer, nn.Linear)  # Conv1D: weight (in, out)
        self.in_features, self.out_features = sizes(base_layer)
        rank = projections.vera_A.shape[0]
        kind = {"device": base_layer.weight.device, "dtype": projections.vera_A.dtype}
        if init_weights:
            self.vera_lambda_b = nn.Parameter(torch.zeros(self.out_features, **kind))
            self.vera_lambda_d = nn.Parameter(torch.full((rank,), float(d_initial), **kind))
        else:
            self.vera_lambda_b = nn.Parameter(torch.ones(self.out_features, **kind))
            self.vera_lambda_d = nn.Parameter(torch.randn(rank, **kind))
        self.vera_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def sliced(self) -> tuple[Tensor, Tensor]:
        """This layer's parts of the shared projections: A[:, :in] (r, in) and B[:out] (out, r), in the vectors'
        dtype and device."""
        like = self.vera_lambda_d
        a = self.projections.vera_A[:, : self.in_features].to(like)
        b = self.projections.vera_B[: self.out_features].to(like)
        return a, b

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = self.base_layer(x, *args, **kwargs)
        if self.merged or self.switch.disabled:
            return out
        a, b = self.sliced()
        hidden = self.vera_lambda_d * F.linear(self.vera_dropout(x.to(a.dtype)), a)  # (..., r)
        return (out + self.vera_lambda_b * F.linear(hidden, b)).to(out.dtype)  # (..., out)

    def delta_weight(self) -> Tensor:
        """``(lambda_b ⊙ B) (lambda_d ⊙ A)`` in the base weight's layout ((out, in); ``Conv1D``: (in, out))."""
        a, b = self.sliced()
        delta = (self.vera_lambda_b.detach()[:, None] * b) @ (self.vera_lambda_d.detach()[:, None] * a)  # (out, in)
        return delta.T if self.fan_in_fan_out else delta

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
