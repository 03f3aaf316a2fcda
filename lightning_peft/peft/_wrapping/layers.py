"""The layer side: the on/off `Switch` a technique's layers and ``modules_to_save`` wrappers share, and
`InPlaceLayer` / `AdditiveLayer`, the layers whose update is folded into the base tensors in place."""

from __future__ import annotations

import torch
from torch import Tensor

from .._common import LayerWrapper, dense_weight, is_quantized
from ..adapter import DEFAULT


class Switch:
    """Turns every layer of one technique on one model off (the base output), and its ``modules_to_save`` wrappers
    with them (a `lightning_peft.peft.modules_to_save.BaseSamples`: disabled, they run the original module, as PEFT's
    do); with named adapters (IA³), ``active`` is the one every layer runs."""

    def __init__(self, active: str = DEFAULT) -> None:
        self.disabled = False
        self.active = active

    def base_samples(self) -> bool:
        return self.disabled


class InPlaceLayer(LayerWrapper):
    """A technique's layer around ``base_layer`` whose update can be folded into the base tensors in place (the
    module docstring lists what a subclass supplies)."""

    def mergeable_weights(self, *adapter: str) -> dict[str, Tensor]:
        """``merged_weights(*adapter)``, refused (``RuntimeError``, the reason) if the base weight is quantized or a
        merged tensor would not be finite."""
        if is_quantized(self.base_layer.weight):
            raise RuntimeError("its base weight is quantized; merging in place would have to requantize it. Use "
                               "merged_state_dict(model) for an export.")
        merged = self.merged_weights(*adapter)
        if not all(torch.isfinite(t).all() for t in merged.values()):
            raise RuntimeError("the merged weight would hold inf or NaN; nothing was merged.")
        return merged

    def merge(self) -> None:
        """Fold the update into the base tensors in place (`unmerge` takes it out again); a layer with one unnamed
        update (named adapters merge their own way).

        Raises:
            RuntimeError: If the weight is quantized or the merged weight is not finite; nothing changes then.
        """
        if not self.merged:
            self._write(self.mergeable_weights())
            self.merged = True

    def _write(self, tensors: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for key, value in tensors.items():
                getattr(self.base_layer, key).copy_(value)


class AdditiveLayer(InPlaceLayer):
    """An `InPlaceLayer` whose update is added to the base weight, ``W + ΔW``; a subclass supplies ``merged`` (False
    at first) and ``delta_weight()`` (``ΔW`` in the base weight's layout)."""

    merged: bool

    def merged_weights(self) -> dict[str, Tensor]:
        """The base weight with ``ΔW`` added: a new tensor, computed in the wider of the two dtypes (the update's is
        float32 or wider) and cast to the weight's. A layer merged in place returns its weight as it is."""
        weight = dense_weight(self.base_layer.weight, self.base_layer).detach()
        if self.merged:
            return {"weight": weight}
        return {"weight": self._shifted(weight, 1)}

    def unmerge(self) -> None:
        """Subtract ``ΔW`` from the merged base weight (exact up to one rounding in the weight's dtype)."""
        if self.merged:
            self._write({"weight": self._shifted(self.base_layer.weight.detach(), -1)})
            self.merged = False

    def _shifted(self, weight: Tensor, sign: int) -> Tensor:
        with torch.no_grad():
            delta = self.delta_weight()
        wide = torch.promote_types(weight.dtype, delta.dtype)
        return (weight.to(wide) + sign * delta.to(wide)).to(weight.dtype)
