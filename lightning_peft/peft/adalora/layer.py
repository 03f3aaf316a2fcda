"""The AdaLoRA layer: a frozen base layer plus an update in SVD form, ``ΔW = P Λ Q`` (see
`lightning_peft.peft.adalora.model` for the technique).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are); ``r`` is the layer's rank:

| factor | shape | meaning |
| --- | --- | --- |
| ``lora_A`` | (r, in * kh * kw) | ``Q``: right singular vectors (``kh * kw = 1`` but for ``nn.Conv2d``) |
| ``lora_E`` | (r, 1) | ``Λ``: singular values; the allocator zeroes the pruned ones |
| ``lora_B`` | (out, r) | ``P``: left singular vectors |

The update is scaled by ``lora_alpha / (ranknum + 1e-5)``, where ``ranknum`` is the rank the layer was created with
(``init_r``; PEFT keeps it fixed, also after loading a resized file). transformers' ``Conv1D`` (weight (in, out))
adds the transposed update when merged; ``nn.Conv2d`` reshapes it to (out, in, kh, kw) and convolves with it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import adapter_dtype
from .._wrapping import AdditiveLayer, Switch, conv1d_type

__all__ = ["SVDLayer", "Switch", "supported"]


def supported(module: nn.Module) -> bool:
    """Whether AdaLoRA (PEFT's layers) can adapt ``module``: ``nn.Linear``, transformers ``Conv1D``, an ungrouped
    ``nn.Conv2d``."""
    conv1d = conv1d_type()
    if isinstance(module, nn.Conv2d):
        return module.groups == 1
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(the width of ``lora_A``'s rows, output features) of ``module``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, nn.Conv2d):
        return module.in_channels * module.kernel_size[0] * module.kernel_size[1], module.out_channels
    shape = getattr(module.weight, "ds_shape", module.weight.shape)  # Conv1D (in, out); DeepSpeed's full shape
    return int(shape[0]), int(shape[1])


class SVDLayer(AdditiveLayer):
    """``base_layer`` (frozen) plus ``B (A ⊙ E) * lora_alpha / (ranknum + 1e-5)``.

    Args:
        base_layer: An ``nn.Linear``, transformers ``Conv1D`` or ungrouped ``nn.Conv2d``.
        rank: The number of triplets (rows of ``A`` and ``E``, columns of ``B``).
        ranknum: The rank in the scale's denominator (``init_r``; a resized layer keeps its creation's).
        lora_alpha: The scale's numerator (0: ``rank``, as PEFT).
        dropout: Dropout probability on the adapter's input.
        init_weights: ``E = 0`` and ``A``, ``B`` ~ N(0, 0.02²) (the base's output); False: standard normal draws.
        switch: The model's on/off switch; None: the layer's own.
    """

    def __init__(self, base_layer: nn.Module, rank: int, ranknum: float, lora_alpha: float, dropout: float = 0.0,
                 init_weights: bool = True, switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        self.merged = False
        self.switch = switch or Switch()
        self.conv = isinstance(base_layer, nn.Conv2d)
        self.fan_in_fan_out = not self.conv and not isinstance(base_layer, nn.Linear)  # Conv1D: weight (in, out)
        self.ranknum = float(ranknum)
        self.scaling = float(lora_alpha) if lora_alpha > 0 else float(rank)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        width, out = _sizes(base_layer)
        # drawn in float32 and then cast, in PEFT's order, so that a seed gives PEFT's start
        a, e, b = torch.randn(rank, width), torch.randn(rank, 1), torch.randn(out, rank)
        if init_weights:
            e.zero_()
            a.normal_(0.0, 0.02)
            b.normal_(0.0, 0.02)
        weight = base_layer.weight
        place = {"device": weight.device, "dtype": adapter_dtype(weight)}
        self.lora_A = nn.Parameter(a.to(**place))  # (r, in * kh * kw)
        self.lora_E = nn.Parameter(e.to(**place))  # (r, 1)
        self.lora_B = nn.Parameter(b.to(**place))  # (out, r)

    @property
    def rank(self) -> int:
        return self.lora_E.shape[0]

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.merged or self.switch.disabled:
            return result
        x = x.to(self.lora_A.dtype)
        denominator = self.ranknum + 1e-5  # scaled as PEFT scales, operation by operation (the same roundings)
        if self.conv:
            base = self.base_layer
            delta = (self.lora_B @ (self.lora_A * self.lora_E) * self.scaling / denominator)  # (out, in * kh * kw)
            update = F.conv2d(self.lora_dropout(x), delta.reshape(base.weight.shape), stride=base.stride,
                              padding=base.padding, dilation=base.dilation, groups=base.groups)
        else:  # (..., in) @ (in, r) @ (r, out)
            update = (self.lora_dropout(x) @ (self.lora_A * self.lora_E).T @ self.lora_B.T) * self.scaling / denominator
        return result + update.to(result.dtype)

    def delta_weight(self) -> Tensor:
        """The update in the base weight's layout (detached; the adapter's dtype)."""
        product = self.lora_B.detach() @ (self.lora_A.detach() * self.lora_E.detach())  # (out, in * kh * kw)
        if self.conv:
            return (product * self.scaling / (self.ranknum + 1e-5)).reshape(self.base_layer.weight.shape)
        return (product.T if self.fan_in_fan_out else product) * self.scaling / (self.ranknum + 1e-5)

    def orthogonality(self) -> list[Tensor]:
        """``||A A^T - I||_F`` and ``||B^T B - I||_F`` (differentiable), the terms of the orthogonal
        regularisation."""
        terms = []
        for cov in (self.lora_A @ self.lora_A.T, self.lora_B.T @ self.lora_B):  # (r, r) each
            terms.append(torch.norm(cov - torch.eye(*cov.shape, dtype=cov.dtype, device=cov.device), p="fro"))
        return terms

    def resize(self, keep: list[bool]) -> None:
        """Keep only the triplets ``keep`` marks (PEFT's resize by a rank pattern); ``ranknum`` stays."""
        index = torch.tensor(keep, dtype=torch.bool, device=self.lora_E.device)
        with torch.no_grad():
            self.lora_A = nn.Parameter(self.lora_A[index].clone())
            self.lora_E = nn.Parameter(self.lora_E[index].clone())
            self.lora_B = nn.Parameter(self.lora_B[:, index].clone())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, ranknum={self.ranknum:g}, scaling={self.scaling:g}"
