"""The IA³ layer: a frozen base layer whose output (or, for a feed-forward module, whose input) is scaled by a learned
vector, and the merge of that vector into the base weight (see `lightning_peft.peft.ia3.model` for the technique).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are):

| base layer | weight | ``ia3_l``: output scaled | ``ia3_l``: input scaled (feed-forward) |
| --- | --- | --- | --- |
| ``nn.Linear`` | (out, in) | (out, 1) | (1, in) |
| transformers ``Conv1D`` | (in, out) | (out, 1) | (1, in) |
| ``nn.Conv2d`` / ``nn.Conv3d`` | (out, in / groups, *kernel) | (1, out, 1, 1[, 1]) | (1, in, 1, 1[, 1]) |

Merged, the vector scales the weight's output rows (and the bias) or its input columns (the bias is then unchanged).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from .._common import LayerWrapper, adapter_dtype, dense_weight, is_quantized
from .._in_place import Switch

CONVOLUTIONS = (nn.Conv2d, nn.Conv3d)


def conv1d_type() -> type | None:
    """transformers' ``Conv1D`` if ``transformers`` is imported (a model can only hold one then), else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def supported(module: nn.Module) -> bool:
    """Whether IA³ (PEFT's layers) can scale ``module``."""
    conv1d = conv1d_type()
    return isinstance(module, (nn.Linear, *CONVOLUTIONS)) or (conv1d is not None and isinstance(module, conv1d))


class IA3Layer(LayerWrapper):
    """``base_layer`` (frozen) with its output, or its input if ``feedforward``, scaled channel-wise by ``ia3_l``.

    Args:
        base_layer: An ``nn.Linear``, transformers ``Conv1D``, ``nn.Conv2d`` or ``nn.Conv3d``.
        feedforward: Scale the input (the paper's ``l_ff``) instead of the output.
        init_ones: Start at ones (the base's output); False: a standard normal draw.
        switch: The model's on/off switch (`disable_ia3`); None: the layer's own.
    """

    def __init__(self, base_layer: nn.Module, feedforward: bool, init_ones: bool = True,
                 switch: Switch | None = None) -> None:
        super().__init__(base_layer)
        self.feedforward = feedforward
        self.merged = False
        self.switch = switch or Switch()
        self.conv = isinstance(base_layer, CONVOLUTIONS)
        self.fan_in_fan_out = not self.conv and not isinstance(base_layer, nn.Linear)  # Conv1D: weight (in, out)
        weight = base_layer.weight
        size = _sizes(base_layer)[0 if feedforward else 1]
        shape = (1, size, *([1] * (weight.dim() - 2))) if self.conv else ((1, size) if feedforward else (size, 1))
        make = torch.ones if init_ones else torch.randn
        self.ia3_l = nn.Parameter(make(shape, device=weight.device, dtype=adapter_dtype(weight)))

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.merged or self.switch.disabled:
            return self.base_layer(x, *args, **kwargs)
        scale = self.ia3_l if self.conv else self.ia3_l.flatten()  # (1, C, 1, ...) or (C,): broadcast over channels
        if self.feedforward:
            return self.base_layer((x * scale).to(x.dtype), *args, **kwargs)
        out = self.base_layer(x, *args, **kwargs)
        return (out * scale).to(out.dtype)

    def weight_scale(self) -> Tensor:
        """``ia3_l`` in the shape that scales the base weight elementwise (``W * s`` is the merged weight)."""
        v = self.ia3_l.detach()
        if not self.conv:
            return v.T if self.fan_in_fan_out else v  # Linear (out, in): (out, 1) / (1, in); Conv1D: transposed
        if not self.feedforward:
            return v.transpose(0, 1)  # (out, 1, 1, ...): one scale per output filter
        base = self.base_layer
        if base.groups == 1:
            return v  # (1, in, 1, ...)
        # grouped: output filter o of group g reads input channels g * (in / groups) + j, j < in / groups
        per_group_in, per_group_out = base.in_channels // base.groups, base.out_channels // base.groups
        kernel = v.shape[2:]
        v = v.reshape(base.groups, 1, per_group_in, *kernel).expand(base.groups, per_group_out, per_group_in, *kernel)
        return v.reshape(base.out_channels, per_group_in, *kernel)

    def merged_weights(self) -> dict[str, Tensor]:
        """The base layer's weight (and, for output scaling, bias) with the vector folded in: new tensors, computed in
        float32 or wider and cast to each tensor's dtype. A layer merged in place returns its tensors as they are."""
        base = self.base_layer
        weight = dense_weight(base.weight, base).detach()
        if self.merged:
            return {"weight": weight} | ({} if base.bias is None else {"bias": base.bias.detach()})
        wide = torch.promote_types(weight.dtype, self.ia3_l.dtype)
        merged = {"weight": (weight.to(wide) * self.weight_scale()).to(weight.dtype)}
        if base.bias is not None and not self.feedforward:
            bias = base.bias.detach()
            merged["bias"] = (bias.to(wide) * self.ia3_l.detach().reshape(bias.shape)).to(bias.dtype)
        return merged

    def merge(self) -> None:
        """Fold the vector into the base weight in place (`unmerge` divides it out again).

        Raises:
            RuntimeError: If the weight is quantized, the vector has a zero (no unmerge could restore the weight), or
                the merged weight is not finite; nothing changes then.
        """
        if self.merged:
            return
        if is_quantized(self.base_layer.weight):
            raise RuntimeError("its base weight is quantized; merging in place would have to requantize it. Use "
                               "merged_state_dict(model) for an export.")
        if (self.ia3_l == 0).any():
            raise RuntimeError("ia3_l has a zero entry, so the merged weight could not be divided back (unmerge). Use "
                               "merged_state_dict(model) or unload_ia3(model, merge=True), which need no unmerge.")
        merged = self.merged_weights()
        if not all(torch.isfinite(t).all() for t in merged.values()):
            raise RuntimeError("the merged weight would hold inf or NaN; nothing was merged.")
        self.write(merged)
        self.merged = True

    def unmerge(self) -> None:
        """Divide the vector out of the merged base weight (exact up to one rounding in the weight's dtype)."""
        if not self.merged:
            return
        base = self.base_layer
        weight = base.weight.detach()
        wide = torch.promote_types(weight.dtype, self.ia3_l.dtype)
        restored = {"weight": (weight.to(wide) / self.weight_scale()).to(weight.dtype)}
        if base.bias is not None and not self.feedforward:
            bias = base.bias.detach()
            restored["bias"] = (bias.to(wide) / self.ia3_l.detach().reshape(bias.shape)).to(bias.dtype)
        self.write(restored)
        self.merged = False

    def write(self, tensors: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for key, value in tensors.items():
                getattr(self.base_layer, key).copy_(value)

    def extra_repr(self) -> str:
        return f"feedforward={self.feedforward}"


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a Linear-like or convolution ``module``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, CONVOLUTIONS):
        return module.in_channels, module.out_channels
    shape = getattr(module.weight, "ds_shape", module.weight.shape)  # Conv1D (in, out); DeepSpeed's full shape
    return int(shape[0]), int(shape[1])
