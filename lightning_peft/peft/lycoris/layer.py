"""The layer LyCORIS methods (LoHa, LoKr) share: a frozen base layer plus a weight update ``ΔW`` that the method builds
from its own factors, applied as a second linear map or convolution with the base layer's geometry.

```text
y = base(x) + F.linear(x, ΔW)                (nn.Linear; ΔW: (out, in))
y = base(x) + conv(x, ΔW)                    (nn.Conv1d / nn.Conv2d, the base's stride, padding, dilation, groups)
ΔW = alpha / r * method's product of factors, reshaped to the base weight's shape
```

In training, as Hugging Face PEFT 0.21.2's ``LycorisLayer``: ``module_dropout`` skips a layer's whole update for one
forward, ``rank_dropout`` zeroes rows (output channels) of ``ΔW`` for one forward, the kept rows rescaled by the
inverse of the kept share where the method says so (LoHa always). The random draws are PEFT's, in PEFT's order (one
``torch.rand(1)`` per layer and forward in training, then ``torch.rand(out)``), so a seeded step equals PEFT's. Merging
adds ``ΔW`` to the base weight. A method subclasses `lightning_peft.peft.lycoris.LycorisLayer` with
its parameters (`parameter_shapes`, `reset_parameters`) and its product (`delta`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import adapter_dtype
from .._wrapping import AdditiveLayer, Switch
from .config import LycorisConfig

KINDS = (nn.Linear, nn.Conv1d, nn.Conv2d)
KINDS_TEXT = "nn.Linear, nn.Conv1d, nn.Conv2d"


def supported(module: nn.Module) -> bool:
    """Whether a LyCORIS layer (PEFT's kinds) can wrap ``module``."""
    return isinstance(module, KINDS)


def flat_shape(base: nn.Module) -> tuple[int, int]:
    """(out, in) of ``base``'s weight as a matrix: a convolution's kernel (and its group's input channels) flattened
    into the input dimension, as PEFT flattens it."""
    weight = base.weight
    return int(weight.shape[0]), math.prod(int(s) for s in weight.shape[1:])


def effective_conv(base: nn.Module, config: LycorisConfig) -> bool:
    """Whether ``base`` gets the kernel-factored form (``use_effective_conv2d`` on a convolution whose kernel is not
    1: PEFT's rule, for Conv1d as well)."""
    return config.use_effective_conv2d and isinstance(base, (nn.Conv1d, nn.Conv2d)) and any(
        k != 1 for k in base.kernel_size)


class LycorisLayer(AdditiveLayer):
    """``base_layer`` (frozen) plus the update ``ΔW`` of a LyCORIS method (the module docstring).

    Args:
        base_layer: An ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d``.
        r: This layer's rank.
        alpha: This layer's alpha (``ΔW`` is scaled by ``alpha / r``).
        config: The method's config (dropouts, initialisation, the method's own fields).
        switch: The adapter's on/off switch; None: the layer's own.

    Attributes:
        parameter_names: The method's parameters, under PEFT's names (those a layer has, in this order).
        rescale_rank_dropout: Whether the rows kept by ``rank_dropout`` are divided by the kept share.
    """

    parameter_names: ClassVar[tuple[str, ...]] = ()
    rescale_rank_dropout: ClassVar[bool] = True

    def __init__(self, base_layer: nn.Module, r: int, alpha: float, config: LycorisConfig,
                 switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.rank_dropout, self.module_dropout = config.rank_dropout, config.module_dropout
        self.merged = False
        self.switch = switch or Switch()
        weight = base_layer.weight
        for name, shape in self.parameter_shapes(base_layer, r, config).items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=weight.device, dtype=adapter_dtype(weight))))
        with torch.no_grad():
            self.reset_parameters(config)

    @classmethod
    @abstractmethod
    def parameter_shapes(cls, base: nn.Module, r: int, config: LycorisConfig) -> dict[str, tuple[int, ...]]:
        """The method's parameters for ``base`` at rank ``r``, by PEFT's name (also read, before anything is
        allocated, to check a file's shapes)."""

    @abstractmethod
    def reset_parameters(self, config: LycorisConfig) -> None:
        """Initialise the parameters (``config.init_weights``: a zero ``ΔW``)."""

    @abstractmethod
    def delta(self) -> Tensor:
        """``ΔW`` (scaled by ``alpha / r``) in any shape that reshapes to the base weight's; differentiable."""

    def delta_weight(self) -> Tensor:
        """``ΔW`` in the base weight's shape: (out, in) or (out, in / groups, *kernel)."""
        return self.delta().reshape(self.base_layer.weight.shape)

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = self.base_layer(x, *args, **kwargs)
        if self.merged or self.switch.disabled:
            return out
        # PEFT draws this in every training forward, even with module_dropout=0: the same draws, the same masks
        if self.training and not torch.rand(1).item() > self.module_dropout:
            return out
        delta = self.delta_weight()
        if self.training and self.rank_dropout:
            delta = delta * self.rank_mask(delta)
        x = x.to(delta.dtype)
        if isinstance(self.base_layer, nn.Linear):
            update = F.linear(x, delta)
        else:  # the base's own convolution (its padding mode too), without its bias
            update = self.base_layer._conv_forward(x, delta, None)
        return (out + update).to(out.dtype)

    def rank_mask(self, delta: Tensor) -> Tensor:
        """The ``rank_dropout`` mask over ``delta``'s rows (output channels), broadcastable to it: PEFT's draw
        (``torch.rand(out) > rank_dropout``), the kept rows divided by the kept share if `rescale_rank_dropout`. All
        rows dropped: a zero update (PEFT divides 0 by 0 there and the output turns NaN)."""
        rows = delta.shape[0]
        keep = (torch.rand(rows) > self.rank_dropout).to(delta.dtype)
        if self.rescale_rank_dropout:
            keep = keep / keep.mean().clamp_min(1 / rows)  # the mean is 0 or at least 1 / rows
        return keep.view(-1, *[1] * (delta.dim() - 1)).to(delta.device)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"
