"""The IA³ layer: a frozen base layer whose output (or, for a feed-forward module, whose input) is scaled by a learned
vector, and the merge of that vector into the base weight (see `lightning_peft.peft.ia3.model` for the technique).

Shapes, as Hugging Face PEFT keeps them (so its files load as they are):

| base layer | weight | ``ia3_l``: output scaled | ``ia3_l``: input scaled (feed-forward) |
| --- | --- | --- | --- |
| ``nn.Linear`` | (out, in) | (out, 1) | (1, in) |
| transformers ``Conv1D`` | (in, out) | (out, 1) | (1, in) |
| ``nn.Conv2d`` / ``nn.Conv3d`` | (out, in / groups, *kernel) | (1, out, 1, 1[, 1]) | (1, in, 1, 1[, 1]) |

Merged, the vector scales the weight's output rows (and the bias) or its input columns (the bias is then unchanged).

Named adapters (as PEFT keeps them): ``ia3_l`` is a ``ParameterDict`` with one vector per adapter name (state-dict keys
``<module>.ia3_l.<name>``, PEFT's own); the model's `Switch` says which one runs. A layer the active adapter does not
scale computes its base output. Whether the input or the output is scaled is the layer's, for all its adapters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .._common import adapter_dtype, dense_weight
from .._wrapping import InPlaceLayer, Switch, conv1d_type, linear_kinds
from ..adapter import DEFAULT

__all__ = ["CONVOLUTIONS", "IA3Layer", "Switch", "linear_kinds", "supported"]

CONVOLUTIONS = (nn.Conv2d, nn.Conv3d)


def supported(module: nn.Module) -> bool:
    """Whether IA³ (PEFT's layers) can scale ``module``."""
    conv1d = conv1d_type()
    return isinstance(module, (nn.Linear, *CONVOLUTIONS)) or (conv1d is not None and isinstance(module, conv1d))


class IA3Layer(InPlaceLayer):
    """``base_layer`` (frozen) with its output, or its input if ``feedforward``, scaled channel-wise by ``ia3_l``.

    Args:
        base_layer: An ``nn.Linear``, transformers ``Conv1D``, ``nn.Conv2d`` or ``nn.Conv3d``.
        feedforward: Scale the input (the paper's ``l_ff``) instead of the output.
        init_ones: Start at ones (the base's output); False: a standard normal draw.
        switch: The model's switch (`disable_ia3`, the active adapter); None: the layer's own.
        adapter_name: The name of its first vector.
    """

    def __init__(self, base_layer: nn.Module, feedforward: bool, init_ones: bool = True,
                 switch: Switch | None = None, adapter_name: str = DEFAULT) -> None:
        super().__init__(base_layer)
        self.feedforward = feedforward
        self.merged_adapter: str | None = None  # the adapter folded into the base weight in place
        self.switch = switch or Switch(adapter_name)
        self.conv = isinstance(base_layer, CONVOLUTIONS)
        self.fan_in_fan_out = not self.conv and not isinstance(base_layer, nn.Linear)  # Conv1D: weight (in, out)
        self.ia3_l = nn.ParameterDict()
        self.add_adapter(adapter_name, init_ones)
        self.register_load_state_dict_pre_hook(_single_vector_key)

    @property
    def merged(self) -> bool:
        return self.merged_adapter is not None

    def add_adapter(self, name: str, init_ones: bool = True) -> None:
        """A vector for adapter ``name``: ones (the base output), or a standard normal draw."""
        weight = self.base_layer.weight
        size = _sizes(self.base_layer)[0 if self.feedforward else 1]
        shape = (1, size, *([1] * (weight.dim() - 2))) if self.conv else ((1, size) if self.feedforward else (size, 1))
        make = torch.ones if init_ones else torch.randn
        self.ia3_l[name] = nn.Parameter(make(shape, device=weight.device, dtype=adapter_dtype(weight)))

    def vector(self, name: str | None = None) -> nn.Parameter | None:
        """Adapter ``name``'s vector (default: the active adapter's); None if this layer has none for it."""
        name = self.switch.active if name is None else name
        return self.ia3_l.get(name)

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        vector = None if self.merged or self.switch.disabled else self.vector()
        if vector is None:
            return self.base_layer(x, *args, **kwargs)
        scale = vector if self.conv else vector.flatten()  # (1, C, 1, ...) or (C,): broadcast over channels
        if self.feedforward:
            return self.base_layer((x * scale).to(x.dtype), *args, **kwargs)
        out = self.base_layer(x, *args, **kwargs)
        return (out * scale).to(out.dtype)

    def weight_scale(self, name: str | None = None) -> Tensor:
        """Adapter ``name``'s vector (default: the active one) in the shape that scales the base weight elementwise
        (``W * s`` is the merged weight)."""
        v = self.vector(name).detach()
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

    def merged_weights(self, name: str | None = None) -> dict[str, Tensor]:
        """The base layer's weight (and, for output scaling, bias) with adapter ``name``'s vector (default: the active
        one) folded in: new tensors, computed in float32 or wider and cast to each tensor's dtype. A layer merged in
        place, or without that adapter, returns its tensors as they are."""
        base = self.base_layer
        weight = dense_weight(base.weight, base).detach()
        vector = self.vector(name)
        if self.merged or vector is None:
            return {"weight": weight} | ({} if base.bias is None else {"bias": base.bias.detach()})
        wide = torch.promote_types(weight.dtype, vector.dtype)
        merged = {"weight": (weight.to(wide) * self.weight_scale(name)).to(weight.dtype)}
        if base.bias is not None and not self.feedforward:
            bias = base.bias.detach()
            merged["bias"] = (bias.to(wide) * vector.detach().reshape(bias.shape)).to(bias.dtype)
        return merged

    def merge(self) -> None:
        """Fold the active adapter's vector into the base weight in place (`unmerge` divides it out again); a layer
        without that adapter is left as it is.

        Raises:
            RuntimeError: If the weight is quantized, the vector has a zero (no unmerge could restore the weight), or
                the merged weight is not finite; nothing changes then.
        """
        name = self.switch.active
        if self.merged or name not in self.ia3_l:
            return
        if (self.ia3_l[name] == 0).any():
            raise RuntimeError("ia3_l has a zero entry, so the merged weight could not be divided back (unmerge). Use "
                               "merged_state_dict(model) or unload_ia3(model, merge=True), which need no unmerge.")
        self._write(self.mergeable_weights())
        self.merged_adapter = name

    def unmerge(self) -> None:
        """Divide the vector out of the merged base weight (exact up to one rounding in the weight's dtype)."""
        if not self.merged:
            return
        base, name = self.base_layer, self.merged_adapter
        weight, vector = base.weight.detach(), self.ia3_l[name].detach()
        wide = torch.promote_types(weight.dtype, vector.dtype)
        restored = {"weight": (weight.to(wide) / self.weight_scale(name)).to(weight.dtype)}
        if base.bias is not None and not self.feedforward:
            bias = base.bias.detach()
            restored["bias"] = (bias.to(wide) / vector.reshape(bias.shape)).to(bias.dtype)
        self._write(restored)
        self.merged_adapter = None

    def extra_repr(self) -> str:
        return f"feedforward={self.feedforward}"


def _single_vector_key(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    """Reads a state dict of lightning-peft before named IA³ adapters (``<module>.ia3_l``) as ``ia3_l.default``."""
    old, new = f"{prefix}ia3_l", f"{prefix}ia3_l.{DEFAULT}"
    if old in state and new not in state:
        state[new] = state.pop(old)


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a Linear-like or convolution ``module``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, CONVOLUTIONS):
        return module.in_channels, module.out_channels
    shape = getattr(module.weight, "ds_shape", module.weight.shape)  # Conv1D (in, out); DeepSpeed's full shape
    return int(shape[0]), int(shape[1])
