"""The LoHa layer: a frozen base layer plus ``ΔW``, the Hadamard (elementwise) product of two low-rank products
(`lightning_peft.peft.lycoris.layer` applies it; this file holds LoHa's factors).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are); ``k`` the kernel, ``in`` a group's input
channels:

| base layer | ``hada_w1_a`` / ``hada_w2_a`` | ``hada_w1_b`` / ``hada_w2_b`` | ``hada_t1`` / ``hada_t2`` |
| --- | --- | --- | --- |
| ``nn.Linear`` (out, in) | (out, r) | (r, in) | none |
| ``nn.Conv1d`` / ``nn.Conv2d`` | (out, r) | (r, in * prod(k)) | none |
| the same, ``use_effective_conv2d`` and a kernel not 1 | (r, out) | (r, in) | (r, r, k1, k2) (Conv1d: (r, r, k, 1)) |

```text
ΔW = alpha / r * (w1_a @ w1_b) ⊙ (w2_a @ w2_b)                                    reshaped to the base weight
ΔW = alpha / r * (t1 ×₁ w1_aᵀ ×₂ w1_bᵀ) ⊙ (t2 ×₁ w2_aᵀ ×₂ w2_bᵀ)                the Tucker form (out, in, k1, k2)
```

Initialised as PEFT: Kaiming-uniform factors, ``hada_w2_b`` zero (so ``ΔW = 0``); ``init_weights=False``: all Kaiming.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..lycoris.config import LycorisConfig
from ..lycoris.layer import LycorisLayer, effective_conv, flat_shape


class LoHaLayer(LycorisLayer):
    """``base_layer`` (frozen) plus LoHa's update (the module docstring); the arguments are
    `lightning_peft.peft.lycoris.LycorisLayer`'s."""

    parameter_names: ClassVar[tuple[str, ...]] = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1",
                                                  "hada_t2")

    @classmethod
    def parameter_shapes(cls, base: nn.Module, r: int, config: LycorisConfig) -> dict[str, tuple[int, ...]]:
        if not effective_conv(base, config):
            out, fan_in = flat_shape(base)
            return {"hada_w1_a": (out, r), "hada_w1_b": (r, fan_in), "hada_w2_a": (out, r), "hada_w2_b": (r, fan_in)}
        out, fan_in, *kernel = base.weight.shape  # (out, in / groups, *kernel)
        core = (r, r, *kernel, 1) if len(kernel) == 1 else (r, r, *kernel)
        return {"hada_w1_a": (r, out), "hada_w1_b": (r, fan_in), "hada_w2_a": (r, out), "hada_w2_b": (r, fan_in),
                "hada_t1": core, "hada_t2": core}

    @property
    def tucker(self) -> bool:
        """Whether the kernel is factored too (``use_effective_conv2d``)."""
        return "hada_t1" in self._parameters

    def reset_parameters(self, config: LycorisConfig) -> None:
        for name in self.parameter_names:
            if name in self._parameters:
                nn.init.kaiming_uniform_(getattr(self, name), a=math.sqrt(5))
        if config.init_weights:
            nn.init.zeros_(self.hada_w2_b)  # ΔW = 0: the adapted model starts as the base

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # alpha / r rounded to float32: PEFT's LoHa multiplies by torch.tensor(alpha / r) (float32), so a scale such
        # as 5 / 3 differs from the float64 one by ~1e-8 relative; the same rounding gives PEFT's outputs
        self.peft_scaling = float(torch.tensor(self.scaling, dtype=torch.float32))

    def delta(self) -> Tensor:
        # Both forms keep only the factors for backward and recompute the two (out, in) products there, as PEFT's
        # do: autograd would hold both products per layer (twice the adapted weights, in float32) until backward.
        if not self.tucker:
            return HadamardProduct.apply(self.hada_w1_a, self.hada_w1_b, self.hada_w2_a, self.hada_w2_b,
                                         self.peft_scaling)
        factors = (self.hada_t1, self.hada_w1_a, self.hada_w1_b, self.hada_t2, self.hada_w2_a, self.hada_w2_b)
        if not torch.is_grad_enabled():
            return _tucker_pair(*factors, self.peft_scaling)
        return checkpoint(_tucker_pair, *factors, self.peft_scaling, use_reentrant=False)


class HadamardProduct(torch.autograd.Function):
    """``scale * (w1_a @ w1_b) ⊙ (w2_a @ w2_b)`` (out, in) from w1_a, w2_a (out, r) and w1_b, w2_b (r, in), saving only
    the factors: backward recomputes each product where it needs it.

    ``∂L/∂(w1_a w1_b) = s G ⊙ (w2_a w2_b)``, then ``∂L/∂w1_a = (that) w1_bᵀ`` and ``∂L/∂w1_b = w1_aᵀ (that)``; the
    same for pair 2 with pair 1's product.
    """

    @staticmethod
    def forward(ctx, w1_a: Tensor, w1_b: Tensor, w2_a: Tensor, w2_b: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(w1_a, w1_b, w2_a, w2_b)
        ctx.scale = scale
        return (w1_a @ w1_b) * (w2_a @ w2_b) * scale

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        w1_a, w1_b, w2_a, w2_b = ctx.saved_tensors
        grad = grad * ctx.scale
        first = grad * (w2_a @ w2_b)  # ∂L/∂(w1_a w1_b): (out, in)
        second = grad * (w1_a @ w1_b)  # ∂L/∂(w2_a w2_b)
        return first @ w1_b.T, w1_a.T @ first, second @ w2_b.T, w2_a.T @ second, None


def _tucker_pair(t1: Tensor, w1_a: Tensor, w1_b: Tensor, t2: Tensor, w2_a: Tensor, w2_b: Tensor,
                 scale: float) -> Tensor:
    """``scale * (t1 ×₁ w1_aᵀ ×₂ w1_bᵀ) ⊙ (t2 ×₁ w2_aᵀ ×₂ w2_bᵀ)``: (out, in, k1, k2)."""
    return _tucker(t1, w1_a, w1_b) * _tucker(t2, w2_a, w2_b) * scale


def _tucker(core: Tensor, out_factor: Tensor, in_factor: Tensor) -> Tensor:
    """The Tucker product: core (r, r, k1, k2), out_factor (r, out), in_factor (r, in) -> (out, in, k1, k2)."""
    return torch.einsum("ijkl,ip,jq->pqkl", core, out_factor, in_factor)
